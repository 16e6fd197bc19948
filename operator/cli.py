"""Command line of the operator: ``kvdrive-operator run`` and ``kvdrive-operator render``.

Owns argument parsing and process exit codes. ``render`` is a dry run without a cluster: it
validates a CR like the CRD does (schema and cross-field rules) and prints its children as
multi-document YAML. ``run`` starts Kopf with the handlers and a liveness endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

from kvdrive.operator import __version__

EXIT_INVALID = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdrive-operator", description="KVDrive Kubernetes operator")
    parser.add_argument("--version", action="version", version=f"kvdrive-operator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser("render", help="print the children of a KVDriveDeployment as YAML (dry run)")
    render.add_argument("-f", "--filename", required=True, help="CR file (YAML, may hold several CRs); - for stdin")
    render.add_argument("--admin-token", default=None, help="admin token to render into the Secret (default: random)")
    render.add_argument("--namespace", default=None, help="namespace for CRs that name none (default: default)")

    run = sub.add_parser("run", help="run the operator (Kopf)")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)")
    run.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint of the operator itself (default: %(default)s)",
    )
    run.add_argument("--metrics", default="http://0.0.0.0:8081/metrics", help=(
        "where the operator serves its own Prometheus metrics (reconciles, decisions, scrape failures); "
        "'' for nowhere (default: %(default)s)"))
    run.add_argument("--resync-seconds", type=float, default=60.0, help="periodic re-reconcile interval")
    run.add_argument("--peering", default=None, help="Kopf peering name for several operator replicas")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    return parser


class _BlockDumper(yaml.SafeDumper):
    """Dumps multi-line strings (the ConfigMap's file) as literal blocks."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


def _load_documents(filename: str) -> list[Any]:
    text = sys.stdin.read() if filename == "-" else Path(filename).read_text(encoding="utf-8")
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def cmd_render(args: argparse.Namespace) -> int:
    from kvdrive.operator.api.cr import SpecError, parse_cr
    from kvdrive.operator.render.manifests import render

    try:
        documents = _load_documents(args.filename)
    except (OSError, yaml.YAMLError) as exc:
        print(f"error: {args.filename}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if not documents:
        print(f"error: {args.filename}: no KVDriveDeployment found", file=sys.stderr)
        return EXIT_INVALID
    children: list[dict[str, Any]] = []
    failed = False
    for index, doc in enumerate(documents):
        if isinstance(doc, dict) and args.namespace and not (doc.get("metadata") or {}).get("namespace"):
            doc = {**doc, "metadata": {**(doc.get("metadata") or {}), "namespace": args.namespace}}
        try:
            cr = parse_cr(doc)
        except SpecError as exc:
            failed = True
            name = (doc.get("metadata") or {}).get("name", f"document {index}") if isinstance(doc, dict) else index
            for problem in exc.problems:
                print(f"error: {args.filename}: {name}: {problem}", file=sys.stderr)
            continue
        children += render(cr, args.admin_token or secrets.token_urlsafe(32))
    if failed:
        return EXIT_INVALID
    text = yaml.dump_all(children, Dumper=_BlockDumper, sort_keys=False)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `| head`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import kopf

    from kvdrive.operator.act.handlers import build_registry
    from kvdrive.operator.clients.login import login

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    registry = build_registry(connect=login, resync_seconds=args.resync_seconds, metrics_address=args.metrics or None)
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(quiet_watch_finalization)
        runner.run(kopf.operator(
            registry=registry,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            standalone=args.peering is None,
            peering_name=args.peering,
        ))
    return 0


def quiet_watch_finalization(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler while the operator runs: passes everything on, except Kopf's
    watch streams finalized in the wrong order at shutdown.

    When the operator stops, the loop closes the async generators still alive in no fixed order. Kopf's
    ``infinite_watch`` holds its ``streaming_block`` context manager open; if the loop closed that context
    manager's generator first, Python 3.11 answers the later ``athrow()`` on it by returning instead of
    raising, and contextlib reports "generator didn't stop after athrow()". Both streams are already shut,
    nothing is lost; it is logged at DEBUG with what happened instead of a traceback.
    """
    exc = context.get("exception")
    agen = context.get("asyncgen")
    code = getattr(agen, "ag_code", None)
    if (isinstance(exc, RuntimeError) and "didn't stop after athrow()" in str(exc)
            and code is not None and code.co_name == "infinite_watch"
            and Path(code.co_filename).match("kopf/_cogs/clients/watching.py")):
        logging.getLogger(__name__).debug(
            "a Kopf watch stream was finalized after its own context manager at shutdown (harmless): %s", exc)
        return
    loop.default_exception_handler(context)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "render":
        return cmd_render(args)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
