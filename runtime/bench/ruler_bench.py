"""RULER through lm-eval against ``kvdrive serve``: full attention and sparse budgets on the same samples
(``kvdrive bench ruler``, issue 44).

Owns running the cells (their pairing and report: ``ruler_report``). A cell is one (context, task, leg); a leg
is ``full`` or ``sparse-<token budget>`` (``sparse-<budget>-<tag>`` for legs run with other selection flags).
For each context and task the legs run one after another, each against its own ``kvdrive serve`` (the attention
mode is a server flag) on the task's SSD directory (``<work>/ssd/<context>-<task>``) with tight device and DRAM
tiers, so the pages really move: the first leg prefills every prompt and writes its pages through to the SSD
tier, and the later legs' servers recover the stored pages and reuse them (``cached`` in the result counts
the prompt tokens that came from stored pages instead of being computed). Once a task's legs are all measured
its directory is removed (``keep_ssd`` keeps it): the tier allocates its whole budget on disk, and one folder
for every task of a run filled the disk that the cluster tests need.

lm-eval's ``local-completions`` model sends each prompt, rendered through the model's own chat template
(an HF tokenizer folder written from the GGUF into the cache), with greedy ``generate_until``. RULER's
synthetic tasks generate their samples from that tokenizer, deterministically in a fresh process: each
cell's lm-eval run (and ``ruler_prompts``) therefore runs in a child process of its own, since ``ruler_cwe``'s
generator shuffles with a module-level ``random.Random(42)`` that lm-eval never reseeds, so a second build of
its samples in one process gives other prompts than the first (with the same answers). A finished cell is saved under ``<work>/cells/`` and lm-eval's response cache under
``<work>/lm-eval-cache/``, so a run that stops resumes where it was.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvdrive.runtime.attention import resolve_rest
from kvdrive.runtime.bench.routing_fleet import Proc, free_port, metrics_of
from kvdrive.runtime.model.loader import resolve_model_path
from kvdrive.runtime.model.registry import MODEL_ALIASES, cache_dir

log = logging.getLogger(__name__)

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


@dataclass(frozen=True)
class RulerSetup:
    model: str
    contexts: tuple[int, ...]
    tasks: tuple[str, ...]
    limit: int  # samples per task and context (the first ``limit`` of RULER's generated samples)
    budgets: tuple[int, ...]  # sparse legs' --token-budget
    threads: int
    gpu_budget: str  # each server's tiers
    dram_budget: str
    ssd_budget: str
    page_size: int = 16
    weights: str = "auto"
    sparse_flags: tuple[str, ...] = ()  # more serve flags of the sparse legs (a selection rule under test)
    tag: str = ""  # what names those legs: sparse-<budget>-<tag>
    sketch: int = 8  # every sparse leg's --selection-sketch (before sparse_flags; the engine's default)
    keep_ssd: bool = False  # keep each task's SSD directory once its legs are measured

    @property
    def legs(self) -> tuple[str, ...]:
        """``full`` and a sparse leg per budget: ``sparse-<budget>-k<sketch>-sketch`` (the engine's default rule:
        the key sketch, the pages left out attended from their sketches), ``sparse-<budget>`` under the box bound
        (``sketch`` 0, pages left out dropped: the name of the legs measured before the sketch), or
        ``sparse-<budget>-<tag>``. (``sparse-<budget>-k<sketch>`` names the legs measured before session 12,
        when the default dropped the pages left out.)"""
        suffix = f"-{self.tag}" if self.tag else f"-k{self.sketch}-sketch" if self.sketch else ""
        return ("full", *(f"sparse-{b}{suffix}" for b in self.budgets))


@dataclass(frozen=True)
class Sample:
    doc_id: int
    score: float  # RULER's string_match_all for this sample, 0..1
    response: str
    target: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    context: int
    task: str
    leg: str
    samples: tuple[Sample, ...]
    seconds: float
    prompt_tokens: int  # the server's prompt tokens over the cell
    cached_tokens: int  # of which came from stored pages (prefix reuse)

    @property
    def score(self) -> float:
        return 100.0 * float(np.mean([s.score for s in self.samples])) if self.samples else float("nan")


@dataclass
class RulerResult:
    setup: RulerSetup
    versions: dict[str, str]
    cells: list[Cell] = field(default_factory=list)


def tokenizer_dir(model: str) -> Path:
    """An HF tokenizer folder for ``model`` (what lm-eval and RULER's generators load), written once into the
    cache from the GGUF by transformers."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    target = cache_dir() / "tokenizers" / (path.stem if path.is_file() else path.name)
    if (target / "tokenizer_config.json").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if path.is_file():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    tok.save_pretrained(str(tmp))
    tmp.replace(target)
    return target


def serve_args(setup: RulerSetup, leg: str, port: int, ssd_dir: Path) -> list[str]:
    if leg == "full":
        attention = ["--full-attention"]
    else:
        budget = leg.removeprefix("sparse-").partition("-")[0]
        rest = resolve_rest("auto", setup.sketch)  # named, so a leg's name says its rule whatever the default
        attention = ["--token-budget", budget, "--selection-sketch", str(setup.sketch), "--selection-rest", rest,
                     *setup.sparse_flags]
    return ["serve", "--model", setup.model, "--port", str(port), "--threads", str(setup.threads),
            "--weights", setup.weights, "--page-size", str(setup.page_size), "--gpu-budget", setup.gpu_budget,
            "--dram-budget", setup.dram_budget, "--ssd-dir", str(ssd_dir), "--ssd-budget", setup.ssd_budget,
            "--max-running", "1", *attention]


def _cell_path(work: Path, context: int, task: str, leg: str) -> Path:
    return work / "cells" / str(context) / task / f"{leg}.json"


def ssd_dir(work: Path, context: int, task: str) -> Path:
    """The SSD tier the legs of one (context, task) share: the first leg's prefills, the later legs' reuse."""
    return work / "ssd" / f"{context}-{task}"


def _drop_ssd(path: Path) -> None:
    if not path.is_dir():
        return
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path)
    log.info("ruler: removed %s (%.1f GiB of stored prompt pages; --keep-ssd keeps them)", path, size / (1 << 30))


def load_cell(path: Path) -> Cell:
    raw = json.loads(path.read_text())
    raw["samples"] = tuple(Sample(**{**s, "target": tuple(s["target"])}) for s in raw["samples"])
    return Cell(**raw)


T = TypeVar("T")


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a child process started afresh (spawn): RULER's generators then build their samples
    from the state a separate lm-eval run starts from, however many were built in this process before."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def evaluate(url: str, model_id: str, tokenizer: Path, task: str, context: int, limit: int,
             cache: Path) -> list[Sample]:
    """lm-eval's local-completions over one task at one context; each sample's score and response."""
    import lm_eval

    model_args = (f"model={model_id},base_url={url}/v1/completions,tokenizer={tokenizer},"
                  f"tokenizer_backend=huggingface,tokenized_requests=True,max_length={context + 1024},"
                  "num_concurrent=1,max_retries=3,timeout=7200")
    cache.parent.mkdir(parents=True, exist_ok=True)
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task], limit=limit,
                                  apply_chat_template=True, log_samples=True, use_cache=str(cache),
                                  metadata={"max_seq_lengths": [context], "tokenizer": str(tokenizer)})
    if out is None:
        raise RuntimeError(f"lm-eval returned nothing for {task} at {context}")
    samples = []
    for s in out["samples"][task]:
        target = s["target"] if isinstance(s["target"], list) else [s["target"]]
        samples.append(Sample(int(s["doc_id"]), float(s[str(context)]), str(s["filtered_resps"][0]),
                              tuple(str(t) for t in target)))
    return sorted(samples, key=lambda x: x.doc_id)


def ruler_prompts(model: str, task: str, context: int, limit: int) -> list[tuple[str, list[int]]]:
    """The token ids ``evaluate`` sends for the first ``limit`` samples of ``task`` at ``context`` (labelled
    ``task#doc_id``): lm-eval builds the requests with the same metadata and chat template, and they are
    tokenized as its local-completions model does (no special tokens added)."""
    import random

    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager, get_task_dict
    from transformers import AutoTokenizer

    tokenizer = tokenizer_dir(model)
    tok = AutoTokenizer.from_pretrained(str(tokenizer))

    def chat_template(history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=not add_generation_prompt))

    # RULER's generators draw from the global generators: seed them as simple_evaluate does before it builds
    # the tasks, or the samples differ from the ones the cells scored
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    manager = TaskManager(metadata={"tokenizer": str(tokenizer), "max_seq_lengths": [context]})
    lm_task = get_task_dict([task], manager)[task]
    lm_task.build_all_requests(limit=limit, apply_chat_template=True, chat_template=chat_template)
    return [(f"{task}#{inst.doc_id}", tok(inst.arguments[0], add_special_tokens=False).input_ids)
            for inst in sorted(lm_task.instances, key=lambda i: i.doc_id)]


def run_cell(setup: RulerSetup, work: Path, context: int, task: str, leg: str, tokenizer: Path) -> Cell:
    """One (context, task, leg) against a fresh server on the shared SSD directory (or its saved result)."""
    path = _cell_path(work, context, task, leg)
    if path.is_file():
        log.info("ruler: %s %s %s already measured (%s)", context, task, leg, path)
        return load_cell(path)
    port = free_port()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    proc = Proc(serve_args(setup, leg, port, ssd_dir(work, context, task)), port,
                logs / f"serve-{context}-{task}-{leg}.log")
    t0 = time.perf_counter()
    proc.start(wait_s=900)
    try:
        model_id = MODEL_ALIASES.get(setup.model, setup.model)
        samples = in_fresh_process(evaluate, proc.url, model_id, tokenizer, task, context, setup.limit,
                                   work / "lm-eval-cache" / f"{setup.model}-{leg}-{context}-{task}")
        m = metrics_of(proc.url)
    finally:
        proc.stop()
    cell = Cell(context, task, leg, tuple(samples), time.perf_counter() - t0,
                int(m.get("kvdrive_prompt_tokens_total", 0)),
                int(m.get("kvdrive_prefix_hit_pages_total", 0)) * setup.page_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cell), indent=1) + "\n")
    log.info("ruler: %s %s %s: %.1f points over %d samples in %.0f s (%d of %d prompt tokens from stored pages)",
             context, task, leg, cell.score, len(samples), cell.seconds, cell.cached_tokens, cell.prompt_tokens)
    return cell


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {d: md.version(d) for d in ("kvdrive", "lm-eval", "transformers", "torch")}
    try:
        out["kvdrive_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except OSError:
        out["kvdrive_commit"] = ""
    return out


def restore_cells(result_file: Path, setup: RulerSetup, work: Path) -> int:
    """Write the cells of an earlier result file (``--out``) that ``work`` lacks into it, so a run resumes from
    the committed result on a machine where the work folder is gone; only a file of the same model, sample
    count and weights counts. Returns how many cells were restored."""
    if not result_file.is_file():
        return 0
    earlier = json.loads(result_file.read_text())
    old = earlier.get("setup", {})
    if (old.get("model"), old.get("limit"), old.get("weights")) != (setup.model, setup.limit, setup.weights):
        log.warning("ruler: %s is of another setup; not resuming from it", result_file)
        return 0
    restored = 0
    for raw in earlier.get("cells", []):
        path = _cell_path(work, raw["context"], raw["task"], raw["leg"])
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(raw, indent=1) + "\n")
            restored += 1
    if restored:
        log.info("ruler: %d measured cells restored from %s into %s", restored, result_file, work)
    return restored


def run_ruler_bench(setup: RulerSetup, work: Path,
                    on_cell: Callable[[RulerResult], None] | None = None, measure: bool = True) -> RulerResult:
    """Every (context, task) with its legs in order (full first: it prefills the prompts into the SSD tier);
    ``measure=False`` reports the cells already measured and runs nothing."""
    res = RulerResult(setup, versions())
    tokenizer = Path()
    if measure:
        tokenizer = tokenizer_dir(setup.model)
        res.versions["model_file"] = str(resolve_model_path(setup.model))
    for context in setup.contexts:
        for task in setup.tasks:
            for leg in setup.legs:
                if not measure and not _cell_path(work, context, task, leg).is_file():
                    continue
                res.cells.append(run_cell(setup, work, context, task, leg, tokenizer))
                if on_cell is not None:
                    on_cell(res)
            if measure and not setup.keep_ssd:
                _drop_ssd(ssd_dir(work, context, task))
    return res
