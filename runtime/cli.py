"""Command line of the runtime: ``kvdrive serve``, ``kvdrive generate`` and ``kvdrive bench``.

User errors (a missing model, a prompt too long, a bad size) print one ``kvdrive: error:`` line
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvdrive.router import cli as route_cli
from kvdrive.runtime import __version__
from kvdrive.runtime.sizes import parse_size

log = logging.getLogger("kvdrive")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _dtype(name: str):  # type: ignore[no-untyped-def]
    import torch

    return None if name == "auto" else getattr(torch, name)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from exc
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds >= 0")
    return value


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: every CPU this process may run on)")


def default_threads() -> int:
    """CPUs this process may run on (the cgroup/affinity set, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# weight_formats.WEIGHT_CHOICES, spelled out: building the parser must not import torch (kvdrive route)
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8", "int4")


def _add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="how the projection, embedding and LM-head weights are kept: auto (the GGUF file's own "
                        "blocks, computed in float32: int4 for Q4 tensors, int8 for Q5/Q6/Q8; bf16 for BF16, "
                        "fp32 otherwise), fp32, bf16, int8 or int4 (docs/weights.md)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    _add_threads_arg(p)
    p.add_argument("--model", default="demo", help="'demo' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M base, "
                        "hybrid sliding/global attention, 32K context), a .gguf file or a Hugging Face model directory")
    p.add_argument("--device", default="auto",
                   help="torch device for compute and the device KV tier: auto (CUDA when torch sees a device, "
                        "else the CPU; logged at start), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                   help="activations and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    _add_weights_arg(p)
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--gpu-budget", type=_size, default=None,
                   help="bytes of KV in the device tier incl. one open page per running sequence, e.g. 256MiB "
                        "(default: one full-context sequence)")
    p.add_argument("--dram-budget", type=_size, default=0, help="bytes of KV in host DRAM (default 0)")
    p.add_argument("--dram-hugepage-dir", default=None,
                   help="hugetlbfs mount backing the DRAM tier (else anonymous memory with transparent hugepages)")
    p.add_argument("--ssd-dir", default=None, help="directory on the NVMe drive for the SSD tier (default: none)")
    p.add_argument("--ssd-budget", type=_size, default=None, help="bytes of the SSD tier on disk (default 1GiB)")
    p.add_argument("--ssd-compression", choices=["none", "int8"], default="none",
                   help="int8 halves the SSD tier's bytes (per page and head scales)")
    p.add_argument("--token-budget", type=int, default=1024, help="tokens each decode query attends to")
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
    s.add_argument("--api-key-file", default=None, help="file holding the Bearer key required on /v1")
    s.add_argument("--admin-token-file", default=None, help="file holding the Bearer token required on /admin")
    s.add_argument("--protect-metadata", action="store_true",
                   help="require the API key on /metrics, /openapi.json and /docs too (open by default)")
    s.add_argument("--max-body-bytes", type=_size, default=8 << 20, help="largest request body (413 above)")
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
    s.add_argument("--step-seconds", type=_seconds, default=1.0,
                   help="latency target of one engine step (every stream's inter-token gap): steps carry fewer "
                        "prompt tokens when they run slower than this; 0 keeps --step-tokens fixed")
    s.add_argument("--scheduling", choices=("fair", "fifo"), default="fair",
                   help="how prompts share a step: fair (shortest remaining first, the oldest always moves) "
                        "or fifo (arrival order)")
    s.add_argument("--config", default=None,
                   help="YAML/JSON file of flag values (keys as the long flags, e.g. gpu_budget: 512MiB); "
                        "flags given on the command line win")

    b = sub.add_parser("bench", help="benchmarks (JSON to stdout or --out)")
    bsub = b.add_subparsers(dest="bench", required=True)
    m = bsub.add_parser("model", help="load time, prefill and decode throughput of a model")
    _add_threads_arg(m)
    m.add_argument("--model", default="demo")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as serve)")
    m.add_argument("--dtype", choices=sorted(_DTYPES), default="auto")
    _add_weights_arg(m)
    m.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths")
    m.add_argument("--decode-context", type=int, nargs="+", default=[128, 2048], help="contexts for decode")
    m.add_argument("--decode-tokens", type=int, default=64)
    m.add_argument("--out", type=Path, default=None, help="write JSON here (and a PNG plot beside it)")
    tb = bsub.add_parser("tiers", help="read/write bandwidth of each KV tier vs raw O_DIRECT")
    tb.add_argument("--ssd-dir", required=True, help="directory on the drive to measure (writes ~270 MiB)")
    tb.add_argument("--out", type=Path, default=Path("bench/results/tiers.json"))

    dc = bsub.add_parser("decode", help="decode throughput of kvdrive vs the baselines, the compute floor and "
                                         "llama.cpp across the tiers")
    dc.add_argument("--model", default="demo")
    dc.add_argument("--ssd-dir", required=True, help="SSD tier directory (prompts are prefilled into it once)")
    dc.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 7168])
    dc.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    dc.add_argument("--modes", nargs="+", default=None, help="subset of full-gpu sparse-gpu kvdrive lru ondemand fullfetch")
    dc.add_argument("--steps", type=int, default=16)
    dc.add_argument("--warmup", type=int, default=8)
    dc.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    dc.add_argument("--token-budget", type=int, default=1024)
    _add_weights_arg(dc)
    _add_threads_arg(dc)
    dc.add_argument("--ssd-budget", type=_size, default=4 << 30,
                    help="SSD tier size, the same in every run on this directory (a smaller one drops stored pages)")
    dc.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    rs = bsub.add_parser("rss", help="resident memory of a demo server as its DRAM tier fills")
    _add_threads_arg(rs)
    rs.add_argument("--ssd-dir", required=True)
    rs.add_argument("--gpu-budget", type=_size, default=32 << 20)
    rs.add_argument("--dram-budget", type=_size, default=128 << 20)
    rs.add_argument("--out", type=Path, default=Path("bench/results/rss.json"))
    rt = bsub.add_parser("routing", help="prefix-aware routing vs round-robin over local replicas, with faults")
    rt.add_argument("--work-dir", required=True, help="replicas' SSD directories and logs (fresh per run)")
    rt.add_argument("--replicas", type=int, default=3)
    rt.add_argument("--clients", type=int, default=16)
    rt.add_argument("--seconds", type=float, default=120.0)
    rt.add_argument("--replica-threads", type=int, default=1, help="compute threads of each replica")
    rt.add_argument("--replica-ssd", default="1GiB",
                    help="each replica's --ssd-budget (1GiB holds ~23K tokens: ~10 of the 12 documents, all of them "
                         "only across the fleet; 512MiB about 5)")
    rt.add_argument("--affinity-share", type=float, default=0.5,
                    help="the prefix router's --affinity-share (above 1: route by cost alone)")
    rt.add_argument("--no-faults", action="store_true", help="skip the run with a replica and the router killed")
    rt.add_argument("--fault-seconds", type=float, default=120.0, help="length of that run")
    rt.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    ld = bsub.add_parser("load", help="N concurrent streaming clients against a running server")
    ld.add_argument("--url", default="http://127.0.0.1:8000")
    ld.add_argument("--clients", type=int, default=16)
    ld.add_argument("--seconds", type=float, default=60.0)
    ld.add_argument("--max-tokens", type=int, default=48)
    ld.add_argument("--long-clients", type=int, default=0, help="clients sending long documents (mixed load)")
    ld.add_argument("--long-sentences", type=int, default=170, help="length of a long document (~12 tokens each)")
    ld.add_argument("--api-key-file", default=None)
    ld.add_argument("--out", type=Path, default=None)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from kvdrive.runtime.engine import Generator, SamplingParams, TextStream
    from kvdrive.runtime.model import load_model
    from kvdrive.runtime.prompt import ChatMessage

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop),
    )
    loaded = load_model(args.model, device=args.device, dtype=_dtype(args.dtype),
                        progress=sys.stderr.isatty() or args.verbose, weights=args.weights)
    tok = loaded.tokenizer
    ids = tok.encode_chat([ChatMessage("user", args.prompt)]) if args.chat else tok.encode(args.prompt)
    gen = Generator(loaded, engine_config(args, max_sequences=1))
    stream = TextStream(tok, params.stop)
    try:
        for token in gen.generate(ids, params):
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

    if args.token_budget < 2 * args.page_size:
        raise ValueError(f"--token-budget {args.token_budget} is below two pages of {args.page_size} tokens")
    ssd_budget = args.ssd_budget if args.ssd_budget is not None else (1 << 30 if args.ssd_dir else 0)
    tiers = TierConfig(gpu_bytes=args.gpu_budget, dram_bytes=args.dram_budget, ssd_dir=args.ssd_dir,
                       ssd_bytes=ssd_budget, hugetlbfs_dir=args.dram_hugepage_dir, ssd_codec=args.ssd_compression)
    return EngineConfig(tiers=tiers, page_size=args.page_size, placement=args.placement,
                        full_attention=args.full_attention, token_budget=args.token_budget,
                        max_sequences=max_sequences, max_running=max_running, kv_dtype=_dtype(args.dtype))


def _serve(args: argparse.Namespace) -> int:
    from kvdrive.runtime.engine import SchedulerConfig
    from kvdrive.runtime.server.auth import read_secret
    from kvdrive.runtime.server.serve import ServeOptions, serve

    ceiling = args.max_sequences if args.max_sequences is not None else args.max_running
    if not 1 <= args.max_running <= ceiling:
        raise ValueError(f"--max-running {args.max_running} must be between 1 and --max-sequences {ceiling}")
    opts = ServeOptions(
        model=args.model, host=args.host, port=args.port, device=args.device, dtype=_dtype(args.dtype),
        weights=args.weights,
        engine=engine_config(args, max_sequences=ceiling, max_running=args.max_running),
        served_model_name=args.served_model_name,
        api_key=read_secret(args.api_key_file), admin_token=read_secret(args.admin_token_file),
        protect_metadata=args.protect_metadata, max_body_bytes=args.max_body_bytes, drain_seconds=args.drain_seconds,
        scheduler=SchedulerConfig(max_running=args.max_running, max_waiting=args.max_waiting,
                                  step_token_budget=args.step_tokens, step_seconds=args.step_seconds,
                                  policy=args.scheduling),
        progress=sys.stderr.isatty() or args.verbose,
    )
    serve(opts)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``serve --config FILE`` supplies flags that the command line does not."""
    from kvdrive.runtime.config_file import ConfigFileError, config_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.config:
        try:
            extra = config_flags(args.config)
        except ConfigFileError as exc:
            parser.error(str(exc))
        at = argv.index("serve") + 1
        args = parser.parse_args(argv[:at] + extra + argv[at:])  # later (command-line) flags win
    return args


def _bench(args: argparse.Namespace) -> int:
    from kvdrive.runtime.bench import model_bench

    if args.bench == "tiers":
        from kvdrive.runtime.bench import tier_bench

        args.out.parent.mkdir(parents=True, exist_ok=True)
        res = tier_bench.run_tier_bench(args.ssd_dir, out_json=str(args.out), out_png=str(args.out.with_suffix(".png")))
        print(json.dumps(res, indent=2))
        return 0
    if args.bench == "decode":
        from kvdrive.runtime.bench import decode_bench, decode_report

        res = decode_bench.run_decode_bench(
            args.ssd_dir, args.model, tuple(args.contexts), tuple(args.batches),
            tuple(args.modes or decode_bench.MODES), args.steps, args.warmup, args.token_budget, args.ssd_budget,
            with_llama_cpp=not args.no_llama_cpp, weights=args.weights)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(decode_bench.as_dict(res), indent=2) + "\n")
        report = decode_report.markdown(res)
        args.out.with_suffix(".md").write_text(report)
        decode_report.plot(res, str(args.out.with_suffix(".png")))
        print(report)
        return 0
    if args.bench == "rss":
        from kvdrive.runtime.bench import rss_bench

        exe = str(Path(sys.executable).parent / "kvdrive")
        rss = rss_bench.as_dict(rss_bench.run_rss_bench(exe, args.ssd_dir, args.gpu_budget, args.dram_budget))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rss, indent=2) + "\n")
        print(json.dumps(rss, indent=2))
        return 0
    if args.bench == "routing":
        from dataclasses import asdict

        from kvdrive.runtime.bench import routing_bench, routing_report

        res = routing_bench.run_routing_bench(args.work_dir, args.replicas, args.clients, args.seconds,
                                              args.replica_threads, not args.no_faults,
                                              fault_seconds=args.fault_seconds, ssd_budget=args.replica_ssd,
                                              affinity_share=args.affinity_share)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(res), indent=2) + "\n")
        report = routing_report.markdown(res, "kvdrive bench routing " + " ".join(sys.argv[3:]))
        args.out.with_suffix(".md").write_text(report)
        routing_report.plot(res, str(args.out.with_suffix(".png")))
        print(report)
        return 0
    if args.bench == "load":
        import asyncio

        from kvdrive.runtime.bench import load_bench
        from kvdrive.runtime.server.auth import read_secret

        res = asyncio.run(load_bench.run_load(args.url, args.clients, args.seconds, args.max_tokens,
                                              read_secret(args.api_key_file), args.long_clients,
                                              args.long_sentences))
        text = json.dumps(load_bench.as_dict(res), indent=2)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        print(text)
        return 0 if res.errors == 0 else 1

    result = model_bench.run_model_bench(
        args.model, tuple(args.prefill), tuple(args.decode_context), args.decode_tokens, device=args.device,
        dtype=_dtype(args.dtype), weights=args.weights,
    )
    text = json.dumps(model_bench.as_dict(result), indent=2)
    print(model_bench.table(result), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        png = args.out.with_suffix(".png")
        if model_bench.plot(result, str(png)):
            print(f"wrote {args.out} and {png}", file=sys.stderr)
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "route":  # the router process never imports torch
        from kvdrive.router.cli import run

        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        run(args)
        return 0
    from kvdrive.runtime.engine import PromptTooLongError
    from kvdrive.runtime.kvcache import CacheFullError
    from kvdrive.runtime.model import ModelLoadError
    from kvdrive.runtime.prompt.tokenizer import TokenizerError

    if hasattr(args, "threads"):  # the commands that compute: torch uses every allowed CPU unless told
        import torch

        args.threads = args.threads or default_threads()
        torch.set_num_threads(args.threads)
    verbose = args.verbose or args.command == "serve"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
        return _bench(args)
    except (ModelLoadError, PromptTooLongError, CacheFullError, TokenizerError, ValueError, OSError) as exc:
        print(f"kvdrive: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
