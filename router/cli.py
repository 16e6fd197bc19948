"""``kvdrive route``: run the prefix-aware router in front of KVDrive replicas."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvdrive.runtime.sizes import parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("route", help="prefix-aware router across KVDrive replicas (OpenAI-compatible proxy)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeat for each); or use --service")
    p.add_argument("--service", help="discover replicas from this Service's EndpointSlices")
    p.add_argument("--namespace", default="default", help="namespace of --service")
    p.add_argument("--backend-port", type=int, default=8000, help="replica port (when the slice names none)")
    p.add_argument("--backend-port-name", default="http", help="the EndpointSlice port name to use")
    p.add_argument("--kubeconfig", help="kubeconfig for --service outside a cluster (default: in-cluster)")
    p.add_argument("--policy", choices=("prefix", "round-robin"), default="prefix")
    p.add_argument("--load-tokens", type=int, default=128,
                   help="prompt tokens each running or queued request costs besides its own prefill")
    p.add_argument("--recompute-weight", type=float, default=3.0,
                   help="a prompt token a replica would compute costs this many tokens already queued there")
    p.add_argument("--max-imbalance", type=int, default=8,
                   help="never route to a replica this many requests above the least loaded")
    p.add_argument("--affinity-share", type=float, default=0.5,
                   help="a replica holding this share of a prompt's pages keeps it unless an idle replica is faster")
    p.add_argument("--shared-tier-weight", type=_fraction, default=0.5, help=(
        "a prompt page a replica would fetch from the fleet's shared tier (announced by any replica in the KV "
        "events' EXTERNAL medium) counts as this fraction of a page it holds itself, in [0, 1)"))
    p.add_argument("--api-key-file", type=Path, help="the replicas' API key, for the router's own polls")
    p.add_argument("--isolate-tenants", action="store_true", help=(
        "the replicas run --isolate-tenants: a prompt's pages are found under its caller's key"))
    p.add_argument("--max-body-bytes", type=parse_size, default=8 << 20)
    p.add_argument("--poll-seconds", type=float, default=1.0)
    p.add_argument("--ignore-kv-events", action="store_true", help=(
        "poll every replica's page list even when it publishes KV events (by default the router follows them)"))
    p.add_argument("--ext-proc-port", type=int, default=0, metavar="PORT", help=(
        "also serve Envoy ext_proc on this port (on --host), as the Gateway API Inference Extension's "
        "endpoint picker, with gRPC health; 0: off (GIE's usual port is 9002)"))


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1): a fetched page must count less than a held one")
    return value


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from kvdrive.router.app import create_app
    from kvdrive.router.core import Router, RouterConfig
    from kvdrive.router.discovery import Discovery, EndpointSliceDiscovery, StaticDiscovery
    from kvdrive.router.extproc import ExtProcServer
    from kvdrive.router.selection import Policy
    from kvdrive.runtime.protocol.secret_files import read_api_keys

    if bool(args.backend) == bool(args.service):
        raise SystemExit("kvdrive route: error: give either --backend URL (one or more) or --service NAME")
    discovery: Discovery = StaticDiscovery(tuple(args.backend)) if args.backend else EndpointSliceDiscovery(
        args.service, args.namespace, args.backend_port, args.backend_port_name, args.kubeconfig)
    keys = read_api_keys(args.api_key_file)  # one key, or the replicas' per-tenant file: its first key
    api_key = keys[0].key if keys else None
    policy = Policy(mode=args.policy, load_tokens=args.load_tokens, recompute_weight=args.recompute_weight,
                    max_imbalance=args.max_imbalance, affinity_share=args.affinity_share,
                    shared_weight=args.shared_tier_weight)
    config = RouterConfig(policy=policy, api_key=api_key, max_body_bytes=args.max_body_bytes,
                          isolate_tenants=args.isolate_tenants,
                          poll_seconds=args.poll_seconds, kv_events=not args.ignore_kv_events)
    router = Router(config, discovery)
    listeners = [ExtProcServer(router, args.host, args.ext_proc_port)] if args.ext_proc_port else []
    logging.getLogger("kvdrive.router").info("routing (%s) on http://%s:%d", args.policy, args.host, args.port)
    uvicorn.run(create_app(router, listeners), host=args.host, port=args.port, log_level="warning")
