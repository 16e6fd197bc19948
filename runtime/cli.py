"""Command line of the runtime: ``kvdrive serve``, ``kvdrive generate`` and ``kvdrive bench``.

User errors (a missing model, a prompt too long, a bad size) print one ``kvdrive: error:`` line
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvdrive.router import cli as route_cli
from kvdrive.runtime import __version__, bench_cli
from kvdrive.runtime.cli_args import (
    DTYPES,
    add_kv_dtype_arg,
    add_threads_arg,
    add_weights_arg,
    default_threads,
    dtype_of,
    seconds_arg,
    size_arg,
)

log = logging.getLogger("kvdrive")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_threads_arg(p)
    # the names are runtime/model/registry.py's, spelled out here: the router's command line never imports
    # the model package (torch); tests/model/test_model_registry.py holds the two lists equal
    p.add_argument("--model", default="demo", help="'demo' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M base, "
                   "hybrid sliding/global attention, 32K context), 'qwen2.5-coder-0.5b' or 'qwen2.5-coder-1.5b' "
                   "(Qwen2.5-Coder-Instruct, 32K context; `kvdrive models` lists them), a .gguf file or a Hugging "
                   "Face model directory")
    p.add_argument("--device", default="auto",
                   help="torch device for compute and the device KV tier: auto (CUDA when torch sees a device, "
                        "else the CPU; logged at start), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto",
                   help="activations dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    add_kv_dtype_arg(p)
    add_weights_arg(p)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--gpu-budget", type=size_arg, default=None,
                   help="bytes of KV in the device tier incl. one open page per running sequence, e.g. 256MiB "
                        "(default: one full-context sequence)")
    p.add_argument("--dram-budget", type=size_arg, default=0, help="bytes of KV in host DRAM (default 0)")
    p.add_argument("--dram-hugepage-dir", default=None,
                   help="hugetlbfs mount backing the DRAM tier (else anonymous memory with transparent hugepages)")
    p.add_argument("--ssd-dir", default=None, help="directory on the NVMe drive for the SSD tier (default: none)")
    p.add_argument("--ssd-budget", type=size_arg, default=None, help="bytes of the SSD tier on disk (default 1GiB)")
    p.add_argument("--ssd-compression", choices=["none", "int8"], default="none",
                   help="int8 halves the SSD tier's bytes (per page and head scales)")
    p.add_argument("--ssd-backend", choices=["posix", "kvikio"], default="posix",
                   help="how the SSD tier does its I/O: posix (O_DIRECT preadv/pwritev) or kvikio (cuFile/GPUDirect "
                        "Storage; needs CUDA and the 'gpu' extra; experimental: docs/tiers.md#gpu-paths)")
    p.add_argument("--shared-tier", default=None, metavar="URL",
                   help="a KV tier shared by every replica: valkey://HOST:PORT[,HOST:PORT...] (a Valkey or Redis "
                        "node or cluster; valkeys:// for TLS). Prompts' pages are published to it and fetched "
                        "from it by any replica (docs/tiers.md#the-shared-tier)")
    p.add_argument("--shared-tier-namespace", default="default",
                   help="key namespace in the shared tier (keys are kvd:<namespace>:<page digest>)")
    p.add_argument("--shared-tier-user", default=None, help="ACL user of the shared tier (default: none)")
    p.add_argument("--shared-tier-auth-file", default=None,
                   help="file holding the shared tier's password (a mounted Secret)")
    p.add_argument("--shared-tier-ca-file", default=None, help="PEM CA bundle verifying the shared tier's TLS")
    p.add_argument("--shared-tier-timeout-ms", type=int, default=500,
                   help="time budget of one round trip to a shard of the shared tier (a slower shard is a miss)")
    p.add_argument("--token-budget", type=int, default=1024, help="tokens each decode query attends to")
    p.add_argument("--selection-radius", type=float, default=1.0,
                   help="weight of each page's key-box radius in its selection score: 1 is Quest's upper bound, "
                        "lower trusts the box center more (docs/attention.md)")
    p.add_argument("--selection-carry", choices=["layer", "shared", "shared+neighbours"], default="layer",
                   help="the previous step's attention a page carries into its selection score: its own layer's; "
                        "also the most it drew at any layer (shared); and half that of the pages beside it "
                        "(shared+neighbours) (docs/attention.md)")
    p.add_argument("--selection-sketch", type=int, choices=[0, 4, 8], default=8,
                   help="keep every key quantised to this many bits inside its page's box and pick pages by the "
                        "attention those keys predict (default 8; 0: by the box bound alone, Quest's rule; "
                        "docs/attention.md)")
    p.add_argument("--selection-rest", choices=["auto", "drop", "means", "sketch"], default="auto",
                   help="the pages a decode step does not select: attend them as one column, 'sketch', each of "
                        "their keys and values as an 8-bit sketch gives it, or 'means', each page its mean value at "
                        "the weight the key sketch predicts for it; or 'drop' them from the softmax (faster; loses "
                        "RULER's aggregation tasks). auto (default): sketch, or drop under --selection-sketch 0, "
                        "which has no sketch; sketch and means need --selection-sketch 4 or 8 (docs/attention.md)")
    p.add_argument("--full-attention", action="store_true", help="attend to every page (exact; no selection)")
    p.add_argument("--placement", choices=["kvdrive", "lru", "ondemand", "fullfetch"], default="kvdrive",
                   help="tier policy: kvdrive, or a baseline it is measured against")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdrive", description="KVDrive: tiered KV-cache LLM runtime")
    parser.add_argument("--version", action="version", version=f"kvdrive {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    route_cli.add_parser(sub)
    g = sub.add_parser("generate", help="complete one prompt and print the completion")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model id served by /v1/models")
    s.add_argument("--api-key-file", default=None, help=(
        "file of the Bearer keys that open /v1: one key, or one a line as KEY or TENANT KEY (one per tenant)"))
    s.add_argument("--isolate-tenants", action="store_true", help=(
        "each API key's requests share prefix pages only among themselves (a cache salt derived from the key, "
        "on every tier and across restarts); needs --api-key-file"))
    s.add_argument("--admin-token-file", default=None, help="file holding the Bearer token required on /admin")
    s.add_argument("--protect-metadata", action="store_true",
                   help="require the API key on /metrics, /openapi.json and /docs too (open by default)")
    s.add_argument("--max-body-bytes", type=size_arg, default=8 << 20, help="largest request body (413 above)")
    s.add_argument("--drain-seconds", type=float, default=30.0,
                   help="after SIGTERM/SIGINT: stop admitting, let in-flight requests finish this long, then abort "
                        "them, flush the SSD index and exit 0")
    s.add_argument("--max-running", type=int, default=16,
                   help="sequences in the running batch to start with (live: PUT /admin/tiers max_running); each "
                        "takes one decode step buffer from the --gpu-budget envelope, the rest is the hot tier")
    s.add_argument("--max-sequences", type=int, default=None,
                   help="the most sequences --max-running may ever be set to (their rows and open pages are "
                        "reserved at start; default: --max-running)")
    s.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429")
    s.add_argument("--step-tokens", type=int, default=512, help="tokens per engine step (chunked prefill)")
    s.add_argument("--step-seconds", type=seconds_arg, default=1.0,
                   help="latency target of one engine step (every stream's inter-token gap): steps carry fewer "
                        "prompt tokens when they run slower than this; 0 keeps --step-tokens fixed")
    s.add_argument("--scheduling", choices=("fair", "fifo"), default="fair",
                   help="how prompts share a step: fair (shortest remaining first, the oldest always moves) "
                        "or fifo (arrival order)")
    s.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ADDRESS", help=(
        "publish KV events (vLLM's kv_events wire: pages stored on / removed from each tier) on this ZMQ "
        "address: tcp://*:5557 binds it (routers and indexers subscribe), tcp://HOST:PORT connects to an "
        "indexer that binds"))
    s.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ADDRESS",
                   help="bind a replay (ROUTER) socket here for subscribers that join late, e.g. tcp://*:5558")
    s.add_argument("--kv-events-topic", default="", help="the topic of every KV-event message (llm-d: kv@POD@MODEL); {model} is the served model's id")
    s.add_argument("--kv-events-encoding", choices=("array", "map"), default="array", help=(
        "KV-event structs as msgspec tagged arrays (vLLM's original wire, what llm-d's and Dynamo's decoders read) "
        "or as maps with a \"type\" key (vLLM's newer form)"))
    s.add_argument("--kv-events-hashes", choices=("int", "bytes"), default="int", help=(
        "how a page is named in KV events: int (its digest's low 64 bits, vLLM's default) or bytes (the whole "
        "16-byte digest, as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"))
    s.add_argument("--config", default=None,
                   help="YAML/JSON file of flag values (keys as the long flags, e.g. gpu_budget: 512MiB); "
                        "flags given on the command line win")

    md = sub.add_parser("models", help="list the models served by name; --prepare assembles and verifies them")
    md.add_argument("--prepare", nargs="*", default=[], metavar="NAME",
                    help="assemble each named model into the cache and check its sha256 (make install / make models)")

    bench_cli.add_parser(sub)
    return parser


def _models(args: argparse.Namespace) -> int:
    """Print each named model and where its verified GGUF is; assemble those in ``--prepare`` first."""
    from kvdrive.runtime.model import ModelLoadError
    from kvdrive.runtime.model.registry import NAMED_MODELS, named_model

    for name in args.prepare:
        model = named_model(name)
        if model is None:
            raise ValueError(f"--prepare {name!r}: expected one of {', '.join(m.alias for m in NAMED_MODELS)}")
        print(f"{name}: {model.locate()} (verified)")
    if args.prepare:
        return 0
    for model in NAMED_MODELS:
        try:
            where = str(model.locate())
        except ModelLoadError as exc:
            where = f"not available: {exc}"
        print(f"{model.alias:<20} {model.description}\n{'':<20} {where}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvdrive.runtime.engine import LLMEngine, ModelRunner, SamplingParams, TextStream
    from kvdrive.runtime.model import load_model
    from kvdrive.runtime.prompt import ChatMessage

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop),
    )
    loaded = load_model(args.model, device=args.device, dtype=dtype_of(args.dtype),
                        progress=sys.stderr.isatty() or args.verbose, weights=args.weights, gemm=args.gemm)
    tok = loaded.tokenizer
    ids = tok.encode_chat([ChatMessage("user", args.prompt)]) if args.chat else tok.encode(args.prompt)
    gen = ModelRunner(loaded, engine_config(args, max_sequences=1))
    stream = TextStream(tok, params.stop)
    try:
        for token in LLMEngine(gen).generate_tokens(ids, params):
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
            if stream.stopped:
                break
        sys.stdout.write(stream.flush() + "\n")
    finally:
        gen.close()
    return 0


def engine_config(args: argparse.Namespace, max_sequences: int,  # type: ignore[no-untyped-def]
                  max_running: int | None = None):
    """The engine's KV configuration from the model/tier flags."""
    from kvdrive.runtime.engine import EngineConfig, TierConfig
    from kvdrive.runtime.kvcache import SharedTierConfig
    from kvdrive.runtime.protocol.secret_files import read_secret

    if not 0.0 <= args.selection_radius <= 1.0:
        raise ValueError(f"--selection-radius {args.selection_radius}: expected a number from 0 to 1")
    if args.token_budget < 2 * args.page_size:
        raise ValueError(f"--token-budget {args.token_budget} is below two pages of {args.page_size} tokens")
    ssd_budget = args.ssd_budget if args.ssd_budget is not None else (1 << 30 if args.ssd_dir else 0)
    shared = None
    if args.shared_tier is not None:
        shared = SharedTierConfig.parse(args.shared_tier, args.shared_tier_namespace, args.shared_tier_user,
                                        read_secret(args.shared_tier_auth_file), args.shared_tier_ca_file,
                                        args.shared_tier_timeout_ms)
    elif args.shared_tier_auth_file or args.shared_tier_ca_file or args.shared_tier_user:
        raise ValueError("--shared-tier-user, --shared-tier-auth-file and --shared-tier-ca-file need --shared-tier")
    tiers = TierConfig(envelope_bytes=args.gpu_budget, dram_bytes=args.dram_budget, ssd_dir=args.ssd_dir,
                       ssd_bytes=ssd_budget, hugetlbfs_dir=args.dram_hugepage_dir, ssd_codec=args.ssd_compression,
                       ssd_backend=args.ssd_backend, shared=shared)
    return EngineConfig(tiers=tiers, page_size=args.page_size, placement=args.placement,
                        full_attention=args.full_attention, token_budget=args.token_budget,
                        selection_radius=args.selection_radius, selection_carry=args.selection_carry,
                        selection_sketch=args.selection_sketch, selection_rest=args.selection_rest,
                        max_sequences=max_sequences, max_running=max_running,
                        kv_dtype=dtype_of(args.kv_dtype) or dtype_of(args.dtype))


def _serve(args: argparse.Namespace) -> int:
    from kvdrive.runtime.engine import SchedulerConfig
    from kvdrive.runtime.protocol.secret_files import read_api_keys, read_secret
    from kvdrive.runtime.server.kv_event_publisher import KVEventsConfig
    from kvdrive.runtime.server.serve import ServeOptions, serve

    if args.isolate_tenants and not args.api_key_file:
        raise ValueError("--isolate-tenants needs --api-key-file: the tenants are told apart by their API keys")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    ceiling = args.max_sequences if args.max_sequences is not None else args.max_running
    if not 1 <= args.max_running <= ceiling:
        raise ValueError(f"--max-running {args.max_running} must be between 1 and --max-sequences {ceiling}")
    opts = ServeOptions(
        model=args.model, host=args.host, port=args.port, device=args.device, dtype=dtype_of(args.dtype),
        weights=args.weights, gemm=args.gemm,
        engine=engine_config(args, max_sequences=ceiling, max_running=args.max_running),
        served_model_name=args.served_model_name,
        api_keys=read_api_keys(args.api_key_file), isolate_tenants=args.isolate_tenants,
        admin_token=read_secret(args.admin_token_file),
        protect_metadata=args.protect_metadata, max_body_bytes=args.max_body_bytes, drain_seconds=args.drain_seconds,
        scheduler=SchedulerConfig(max_running=args.max_running, max_waiting=args.max_waiting,
                                  step_token_budget=args.step_tokens, step_seconds=args.step_seconds,
                                  policy=args.scheduling),
        progress=sys.stderr.isatty() or args.verbose,
        kv_events=KVEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint, args.kv_events_topic,
                                 int_hashes=args.kv_events_hashes == "int", maps=args.kv_events_encoding == "map")
        if args.kv_events_endpoint else None,
    )
    serve(opts)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``serve --config FILE`` supplies flags that the command line does not."""
    from kvdrive.runtime.config_file import ConfigFileError, config_flags, options_of

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.config:
        try:
            commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            extra = config_flags(args.config, options_of(commands.choices["serve"]))
        except ConfigFileError as exc:
            parser.error(str(exc))
        at = argv.index("serve") + 1
        args = parser.parse_args(argv[:at] + extra + argv[at:])  # later (command-line) flags win
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "route":  # the router process never imports torch
        from kvdrive.router.cli import run

        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        run(args)
        return 0
    from kvdrive.runtime.engine import PromptTooLongError
    from kvdrive.runtime.kvcache.store import CacheFullError
    from kvdrive.runtime.model import ModelLoadError
    from kvdrive.runtime.prompt.tokenizer import TokenizerError

    if hasattr(args, "threads"):  # the commands that compute: torch uses every allowed CPU unless told
        import torch

        args.threads = args.threads or default_threads()
        torch.set_num_threads(args.threads)
    verbose = args.verbose or args.command in ("serve", "bench")  # long work says what it did
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request the benchmarks make says nothing
    try:
        if hasattr(args, "device"):  # auto -> cuda or cpu, once, before any model is loaded
            from kvdrive.runtime.model.device import resolve_device

            choice = resolve_device(args.device)
            args.device = choice.device
            log.info("device: %s (%s)", choice.device, choice.reason)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "models":
            return _models(args)
        return bench_cli.run(args)
    except (ModelLoadError, PromptTooLongError, CacheFullError, TokenizerError, ValueError, OSError) as exc:
        print(f"kvdrive: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
