"""RULER through lm-eval against ``kvdrive serve``: full attention and sparse budgets on the same samples
(``kvdrive bench ruler``, issue 44).

Owns running the cells and pairing their scores. A cell is one (context, task, leg); a leg is ``full`` or
``sparse-<token budget>`` (``sparse-<budget>-<tag>`` for legs run with other selection flags). For each context and task the legs run one after another, each against its own
``kvdrive serve`` (the attention mode is a server flag) on one SSD directory with tight device and DRAM
tiers, so the pages really move: the first leg prefills every prompt and writes its pages through to the SSD
tier, and the later legs' servers recover the stored pages and reuse them (``cached`` in the result counts
the prompt tokens that came from stored pages instead of being computed).

lm-eval's ``local-completions`` model sends each prompt, rendered through the model's own chat template
(an HF tokenizer folder written from the GGUF into the cache), with greedy ``generate_until``. RULER's
synthetic tasks generate their samples from that tokenizer, deterministically, so every leg sees the same
samples. A finished cell is saved under ``<work>/cells/`` and lm-eval's response cache under
``<work>/lm-eval-cache/``, so a run that stops resumes where it was.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvdrive.runtime.bench.routing_fleet import Proc, free_port, metrics_of
from kvdrive.runtime.model.loader import resolve_model_path
from kvdrive.runtime.model.registry import MODEL_ALIASES, cache_dir

log = logging.getLogger(__name__)

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
BOOTSTRAP = 10_000
SEED = 0


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

    @property
    def legs(self) -> tuple[str, ...]:
        suffix = f"-{self.tag}" if self.tag else ""
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


@dataclass(frozen=True)
class Paired:
    """One sparse leg against full attention on one (context, task): points, paired over samples."""

    context: int
    task: str
    leg: str
    n: int
    full: float
    sparse: float
    diff: float
    low: float  # bootstrap 95% interval of the mean paired difference
    high: float
    identical: float  # share of samples whose greedy response equals full attention's


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
        attention = ["--token-budget", budget, *setup.sparse_flags]
    return ["serve", "--model", setup.model, "--port", str(port), "--threads", str(setup.threads),
            "--weights", setup.weights, "--page-size", str(setup.page_size), "--gpu-budget", setup.gpu_budget,
            "--dram-budget", setup.dram_budget, "--ssd-dir", str(ssd_dir), "--ssd-budget", setup.ssd_budget,
            "--max-running", "1", *attention]


def _cell_path(work: Path, context: int, task: str, leg: str) -> Path:
    return work / "cells" / str(context) / task / f"{leg}.json"


def load_cell(path: Path) -> Cell:
    raw = json.loads(path.read_text())
    raw["samples"] = tuple(Sample(**{**s, "target": tuple(s["target"])}) for s in raw["samples"])
    return Cell(**raw)


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
    proc = Proc(serve_args(setup, leg, port, work / "ssd"), port, logs / f"serve-{context}-{task}-{leg}.log")
    t0 = time.perf_counter()
    proc.start(wait_s=900)
    try:
        model_id = MODEL_ALIASES.get(setup.model, setup.model)
        samples = evaluate(proc.url, model_id, tokenizer, task, context, setup.limit,
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
    return res


# -- pairing and reporting -------------------------------------------------------------------------------

def _bootstrap(diffs: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean of ``diffs`` [N] (resampled with replacement)."""
    if len(diffs) == 0:
        return float("nan"), float("nan")
    means = diffs[rng.integers(0, len(diffs), size=(BOOTSTRAP, len(diffs)))].mean(axis=1)  # [B]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _pairs(res: RulerResult) -> dict[tuple[int, str, str], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(context, task, sparse leg) -> full's and the leg's scores in points [N] and whether each response
    equals full attention's [N], on the samples both cells have."""
    full = {(c.context, c.task): c for c in res.cells if c.leg == "full"}
    out = {}
    for c in res.cells:
        ref = full.get((c.context, c.task))
        if c.leg == "full" or ref is None:
            continue
        by_id = {s.doc_id: s for s in ref.samples}
        both = [(by_id[s.doc_id], s) for s in c.samples if s.doc_id in by_id]
        out[(c.context, c.task, c.leg)] = (np.array([100.0 * a.score for a, _ in both]),
                                           np.array([100.0 * b.score for _, b in both]),
                                           np.array([a.response == b.response for a, b in both]))
    return out


def paired(res: RulerResult) -> list[Paired]:
    """Each sparse cell against the full cell of the same (context, task)."""
    rng = np.random.default_rng(SEED)
    out = []
    for (context, task, leg), (f, s, same) in _pairs(res).items():
        if len(f) == 0:
            continue
        low, high = _bootstrap(s - f, rng)
        out.append(Paired(context, task, leg, len(f), float(f.mean()), float(s.mean()), float((s - f).mean()),
                          low, high, float(same.mean())))
    return out


def averages(res: RulerResult) -> list[Paired]:
    """Per (context, leg): the mean over tasks (each task weighs the same); its 95% interval from resampling
    every task's samples at once."""
    rng = np.random.default_rng(SEED + 1)
    pairs = {k: v for k, v in _pairs(res).items() if len(v[0])}
    out = []
    for context, leg in dict.fromkeys((k[0], k[2]) for k in pairs):
        group = [v for k, v in pairs.items() if (k[0], k[2]) == (context, leg)]
        draws = np.mean([(s - f)[rng.integers(0, len(f), size=(BOOTSTRAP, len(f)))].mean(axis=1)
                         for f, s, _ in group], axis=0)  # [B]
        out.append(Paired(context, "average", leg, sum(len(f) for f, _, _ in group),
                          float(np.mean([f.mean() for f, _, _ in group])), float(np.mean([s.mean() for _, s, _ in group])),
                          float(np.mean([(s - f).mean() for f, s, _ in group])), float(np.percentile(draws, 2.5)),
                          float(np.percentile(draws, 97.5)), float(np.mean([same.mean() for _, _, same in group]))))
    return out


def markdown(res: RulerResult, command: str) -> str:
    s = res.setup
    pairs = paired(res)
    means = averages(res)
    lines = [f"# RULER: {s.model}, sparse against full attention on the same samples", "",
             f"`{command}`", "",
             f"- versions: {', '.join(f'{k} {v}' for k, v in res.versions.items())}",
             f"- {s.limit} samples per task and context; budgets {', '.join(map(str, s.budgets))}; tiers: device "
             f"{s.gpu_budget}, DRAM {s.dram_budget}, SSD {s.ssd_budget}; page {s.page_size} tokens; weights "
             f"{s.weights}; {s.threads} threads; lm-eval local-completions, chat template, greedy; RULER's own "
             f"sample seeds; bootstrap {BOOTSTRAP} resamples (seed {SEED})", ""]
    for context in s.contexts:
        lines += [f"## {context} tokens", "",
                  "| task | leg | n | full | sparse | paired diff | 95% CI | identical outputs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in [p for p in pairs if p.context == context] + [a for a in means if a.context == context]:
            ci = "" if np.isnan(p.low) else f"[{p.low:+.1f}, {p.high:+.1f}]"
            lines.append(f"| {p.task} | {p.leg} | {p.n} | {p.full:.1f} | {p.sparse:.1f} | {p.diff:+.1f} | {ci} | "
                         f"{100 * p.identical:.0f}% |")
        lines.append("")
        cells = [c for c in res.cells if c.context == context]
        lines += ["| task | leg | seconds | prompt tokens | from stored pages |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {c.task} | {c.leg} | {c.seconds:.0f} | {c.prompt_tokens} | {c.cached_tokens} |" for c in cells]
        lines.append("")
    total = sum(c.seconds for c in res.cells)
    lines.append(f"Total: {total / 60:.0f} minutes over {len(res.cells)} cells.")
    return "\n".join(lines) + "\n"


def plot(res: RulerResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = paired(res)
    contexts = list(res.setup.contexts)
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        tasks = list(res.setup.tasks)
        legs = list(res.setup.legs)
        width = 0.8 / len(legs)
        for i, leg in enumerate(legs):
            scores = []
            for task in tasks:
                cell = next((c for c in res.cells if (c.context, c.task, c.leg) == (context, task, leg)), None)
                scores.append(cell.score if cell else float("nan"))
            ax.bar(np.arange(len(tasks)) + i * width, scores, width, label=leg)
        for p in pairs:
            if p.context == context and p.task in tasks and p.diff < -5:
                ax.annotate(f"{p.diff:+.0f}", (tasks.index(p.task), p.sparse), color="red", fontsize=7)
        ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (points)")
        ax.set_title(f"{res.setup.model}, {context} tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_dict(res: RulerResult) -> dict[str, Any]:
    return {"setup": asdict(res.setup), "versions": res.versions, "cells": [asdict(c) for c in res.cells],
            "paired": [asdict(p) for p in paired(res)], "averages": [asdict(p) for p in averages(res)]}
