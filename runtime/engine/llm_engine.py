"""The serving engine: continuous batching over the KV cache, one ``step()`` at a time.

``LLMEngine`` turns requests into sequences, asks the scheduler what to run, runs one forward
pass for the whole mixed batch (decodes + prompt chunks), samples, detokenizes and reports
per-request outputs. Not thread-safe: ``AsyncEngine`` drives it from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvdrive.runtime.engine.detokenize import TextStream
from kvdrive.runtime.engine.grammar import GrammarMasks
from kvdrive.runtime.engine.logit_controls import RowHistory, apply_controls, prompt_vocab
from kvdrive.runtime.engine.model_runner import ModelRunner
from kvdrive.runtime.engine.pacing import StepPacer
from kvdrive.runtime.engine.page_allocator import PageAllocator
from kvdrive.runtime.engine.prompt_logprobs import chunk_logprobs
from kvdrive.runtime.engine.request import Request, RequestOutput, SequenceState
from kvdrive.runtime.engine.sampling import SamplingParams, TokenLogprob, make_rng, sample, token_logprob
from kvdrive.runtime.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from kvdrive.runtime.kvcache import CacheFullError, FaultLog, KVCache, PageLostError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    """What the last step did, for a slow step's log line: scheduling (admission, prefix loads) and the
    forward pass, in seconds, and its prompt tokens and decodes."""

    schedule_s: float = 0.0
    forward_s: float = 0.0
    prompt_tokens: int = 0
    decodes: int = 0


MAX_LOST_PAGE_RESTARTS = 3  # recomputations of one request for unreadable pages before it fails
MAX_CACHE_FULL_STEPS = 3  # steps in a row undone because a tier had no slot before the newest request fails


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    generated_tokens_total: int
    prompt_tokens_total: int
    preemptions_total: int
    queue_wait_seconds: float = 0.0  # requests x seconds spent queued for a running slot, since start
    page_size: int = 0  # tokens a page
    gpu_pages: int = 0  # pages the device tier holds


WARMUP_POLL_S = 0.005  # an idle step waits this long for a shared-tier prefix fetch before turning again


class LLMEngine:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig | None = None) -> None:
        """``config``: None runs one request at a time as the runner's KV cache was configured (its running
        limit, its prefill chunk as the step's token budget): what ``generate_tokens`` callers get."""
        self.runner = runner
        self.cache: KVCache = runner.cache  # the KV accounting the scheduler asks (pages, room, the split)
        if config is None:
            config = SchedulerConfig(max_running=self.cache.max_running, step_token_budget=runner.config.prefill_chunk)
        self.tokenizer = runner.loaded.tokenizer
        self.scheduler = Scheduler(config)
        if self.scheduler.config.max_running > runner.config.max_sequences:
            raise ValueError(f"max_running={self.scheduler.config.max_running} exceeds the KV cache's open pages "
                             f"(max_sequences={runner.config.max_sequences})")
        self._seqs: dict[str, SequenceState] = {}
        self._generated_ids = itertools.count()  # generate_tokens' request ids
        self._eos = frozenset(self.tokenizer.eos_token_ids)
        self._generated = 0
        self._prompt_tokens = 0
        self._preemptions = 0
        self._cache_full_steps = 0  # steps in a row undone because a tier had no slot for their pages
        self.last_step = StepShape()
        self._masks = GrammarMasks(self.tokenizer.vocab_size)  # structured outputs: the step's grammar masks
        self._undone = FaultLog(log, "engine")  # undone steps: counted, logged at most once per kind per 10 s
        cfg = self.scheduler.config
        self.pages = PageAllocator(runner, lambda: [s for s in self.scheduler.running if s.prefill_left],
                                   lambda: self.scheduler.config.prompt_memory_share)
        self.pacer = StepPacer(cfg.step_seconds, cfg.step_token_budget)
        self._queued_seconds = 0.0  # the integral of the queue's length over time, up to _queue_tick
        self._queue_tick = time.monotonic()
        if self.cache.max_running != cfg.max_running:
            self.cache.set_max_running(cfg.max_running, 0)

    def set_max_running(self, n: int) -> bool:
        """Move the device envelope's split live (BudgetError, nothing changed, when impossible): the
        scheduler admits at most ``n`` from now on; a smaller limit gives its bytes to the hot tier once at
        most ``n`` sequences run (returns False until then), never by ending one."""
        applied = self.cache.set_max_running(n, len(self.scheduler.running))
        self.scheduler.config = dataclasses.replace(self.scheduler.config, max_running=n)
        return applied

    def _tick_queue(self) -> None:
        now = time.monotonic()
        self._queued_seconds += len(self.scheduler.waiting) * (now - self._queue_tick)
        self._queue_tick = now

    def add_request(self, request: Request) -> None:
        if len(self.scheduler.waiting) >= self.scheduler.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        self.runner.check_prompt(len(request.prompt_ids))
        if request.request_id in self._seqs:
            raise ValueError(f"duplicate request id {request.request_id}")
        seq = SequenceState(
            request=request,
            stream=TextStream(self.tokenizer, request.params.stop),
            rng=make_rng(request.params),
            tokens=list(request.prompt_ids),
            matcher=request.params.grammar.matcher() if request.params.grammar is not None else None,
        )
        if request.params.prompt_logprobs is None:  # (a request asking for them computes its whole prompt)
            seq.warmup = self.cache.warm_prefix(list(request.prompt_ids), request.cache_salt)
        self._seqs[request.request_id] = seq
        self._tick_queue()
        self.scheduler.waiting.append(seq)
        self._prompt_tokens += len(request.prompt_ids)

    def close(self) -> None:
        """Finish queued write-backs (prefix pages reach the SSD tier), flush the SSD index, close the tiers."""
        self.runner.close()

    @property
    def kv_pages(self) -> int:
        """Sealed pages all tiers can hold (the most one request may use)."""
        return self.cache.num_pages

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams,
                        cache_salt: str | None = None) -> Iterator[int]:
        """One request to its end, stepping the engine in the calling thread: its token ids as they are sampled
        (``kvdrive generate``, the benchmarks; the server's ``AsyncEngine`` steps the same ``step``). An error
        that ends the request (``RequestOutput.error``) is raised as RuntimeError; a generator closed early
        aborts the request."""
        request_id = f"generate-{next(self._generated_ids)}"
        self.add_request(Request(request_id, tuple(prompt), params, time.monotonic(), cache_salt))
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.request_id != request_id:
                        continue
                    yield from out.new_token_ids
                    if out.finished:
                        done = True
                        if out.error is not None:
                            raise RuntimeError(out.error)
        finally:
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort", new_tokens=(), delta="")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def idle(self) -> None:
        """No work now (the serving loop waits for some): the runner gives back what the last steps freed."""
        self.runner.idle()

    def stats(self) -> EngineStats:
        cache = self.cache
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            generated_tokens_total=self._generated, prompt_tokens_total=self._prompt_tokens,
            preemptions_total=self._preemptions,
            queue_wait_seconds=self._queued_seconds + len(self.scheduler.waiting) * (time.monotonic() - self._queue_tick),
            page_size=cache.layout.page_size,
            gpu_pages=cache.device_pages,
        )

    # --- the step -----------------------------------------------------------------------------
    def _preempt(self, seq: SequenceState) -> None:
        log.info("preempting %s (%d tokens) to free KV pages", seq.request.request_id, len(seq.tokens))
        self._release_pages(seq)
        seq.num_computed = 0
        self.scheduler.requeue(seq)
        self._preemptions += 1

    def _release_pages(self, seq: SequenceState) -> None:
        if seq.seq_id is not None:
            seq_id, seq.seq_id = seq.seq_id, None  # cleared first: a release that raises never leaves a dangling id
            self.runner.release(seq_id)

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule (allocating), run the forward pass, postprocess (sample, emit)."""
        outputs = self._fail_unservable()
        self._tick_queue()
        self.cache.settle_running(len(self.scheduler.running))  # a pending smaller limit, once it can
        t0 = time.perf_counter()
        decodes = sum(1 for q in self.scheduler.running if q.num_generated and not q.prefill_left)
        chunks = self.scheduler.plan(self.pages, self._preempt, self.pacer.budget(decodes))
        t1 = time.perf_counter()
        self.last_step = StepShape(t1 - t0, 0.0, sum(c.num_tokens for c in chunks if not c.decode),
                                   sum(c.decode for c in chunks))
        chunks = self._load(chunks)
        if not chunks:
            self._await_warmup()
            return outputs
        hidden = self._run(chunks, outputs)
        self.last_step = dataclasses.replace(self.last_step, forward_s=time.perf_counter() - t1)
        if hidden is None:
            return outputs
        self.pacer.observe(self.last_step.forward_s, self.last_step.prompt_tokens)
        return outputs + self._postprocess(chunks, hidden)

    def _await_warmup(self, timeout: float = WARMUP_POLL_S) -> None:
        """Nothing could run: when a waiting request's prefix is still being fetched from the shared tier,
        wait a little for it rather than turn again at once."""
        for seq in self.scheduler.waiting:
            if seq.warmup is not None and not seq.warmup.done():
                seq.warmup.wait(timeout)
                return

    def _load(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The step's load phase: read the stored prefix pages that the plan's newly opened sequences matched
        (the scheduler only looked them up). When some could not be read (corrupt, lost, or not stored yet:
        a page another running sequence is still computing counts as stored at lookup), the sequence keeps
        what was read and its chunk starts there instead, so those tokens are computed in this step."""
        out = []
        for c in chunks:
            seq = c.seq
            if seq.seq_id is None or self.runner.load_prefix(seq.seq_id):
                out.append(c)
                continue
            stored = self.cache.length(seq.seq_id)
            log.info("%s: %d of %d matched prompt tokens readable; computing the rest", seq.request.request_id,
                     stored, seq.num_computed)
            seq.num_computed = stored
            if seq.cached_tokens is not None:
                seq.cached_tokens = min(seq.cached_tokens, stored)
            out.append(ScheduledChunk.of(seq, min(c.num_tokens, len(seq.pending))))
        return out

    def _run(self, chunks: list[ScheduledChunk], outputs: list[RequestOutput]) -> torch.Tensor | None:
        """The forward pass of the step's chunks: hidden states [N, H], or None when a needed page was lost.
        A lost page is never served: the step is undone by preempting its sequences, which come back
        through prefix reuse (their readable pages are read, not recomputed; the lost page and those after
        it are recomputed). The request whose page was lost may need that at most MAX_LOST_PAGE_RESTARTS
        times; then it ends with an error rather than loop (the SSD tier is failing under it)."""
        batch = [(c.seq.seq_id, c.seq.pending[: c.num_tokens]) for c in chunks]
        decoding = {c.seq.seq_id for c in chunks if c.decode}
        try:
            hidden = self.runner.forward_tokens(batch, decoding)  # type: ignore[arg-type]
        except CacheFullError as exc:
            self._cache_full(chunks, outputs, exc)
            return None
        except PageLostError as exc:
            self._undone.record("page-lost", "%s; recomputing the step's sequences", exc, level=logging.WARNING)
            for c in chunks:
                if c.seq not in self.scheduler.running:
                    continue
                if c.seq.seq_id == exc.seq_id:
                    c.seq.lost_page_restarts += 1
                    if c.seq.lost_page_restarts > MAX_LOST_PAGE_RESTARTS:
                        outputs.append(self._give_up(c.seq))
                        continue
                self._preempt(c.seq)
            return None
        self._cache_full_steps = 0
        return hidden

    def _cache_full(self, chunks: list[ScheduledChunk], outputs: list[RequestOutput], exc: CacheFullError) -> None:
        """The tiers could not take a page this step wrote although the scheduler had room for it: a live
        budget change shrinking a tier, or write-backs still in flight, can leave every slot of a tier pinned
        or needed for a moment. The step is undone as for a lost page (its sequences are preempted and come
        back through prefix reuse, with the same tokens); it never ends the batch with an error. Should it
        happen MAX_CACHE_FULL_STEPS steps in a row, or to the same request more than MAX_CACHE_FULL_STEPS
        times (undone, recomputed, undone again: a livelock the soak found), the newest request of the step
        ends with an error, so that the others make progress."""
        self._cache_full_steps += 1
        self._undone.record("no-slot", "%s; undoing the step (%d in a row): its %d sequences are recomputed", exc,
                            self._cache_full_steps, len(chunks), level=logging.WARNING)
        live = [c.seq for c in chunks if c.seq in self.scheduler.running]
        for seq in live:
            seq.undone_steps += 1
        again = max((q.undone_steps for q in live), default=0) > MAX_CACHE_FULL_STEPS
        if (self._cache_full_steps > MAX_CACHE_FULL_STEPS or again) and live:
            newest = max(live, key=lambda q: q.request.arrival)
            live.remove(newest)
            outputs.append(self._fail(newest, f"the KV tiers had no room for this request's pages ({exc})"))
            self._cache_full_steps = 0
        for seq in live:
            self._preempt(seq)

    def _give_up(self, seq: SequenceState) -> RequestOutput:
        n = seq.lost_page_restarts - 1
        log.error("%s: KV pages unreadable again after %d recomputations; ending it", seq.request.request_id, n)
        return self._fail(seq, f"KV pages of this request could not be read after {n} recomputations "
                               "(the SSD tier is failing: see kvdrive_tier_faults_total)")

    def _postprocess(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> list[RequestOutput]:
        ends = torch.tensor([c.num_tokens for c in chunks]).cumsum(0) - 1  # last row of each chunk
        completing = [i for i, c in enumerate(chunks) if c.completes]
        logits = self.runner.loaded.model.logits(hidden[ends[completing]]) if completing else None  # [B, V]
        for c, end in zip(chunks, ends.tolist(), strict=True):
            k, seq = c.seq.request.params.prompt_logprobs, c.seq
            if k is not None and not c.decode:  # the prompt tokens this chunk's rows predict
                rows = hidden[end + 1 - c.num_tokens : end + 1]  # [num_tokens, H]
                seq.prompt_lps += chunk_logprobs(self.runner.loaded.model.logits, rows, seq.num_computed,
                                                 seq.request.prompt_ids, 1 + len(seq.prompt_lps), k)
            c.seq.num_computed += c.num_tokens
        logprobs: dict[int, torch.Tensor] = {}  # row -> [V] log-probabilities of the model's logits
        if logits is not None:
            want = [row for row, i in enumerate(completing) if chunks[i].seq.request.params.logprobs is not None]
            if want:
                lp = torch.log_softmax(logits[want].float(), dim=-1)  # [w, V], before any sampling control
                logprobs = {row: lp[j] for j, row in enumerate(want)}
            constrained = [(row, chunks[i].seq.matcher) for row, i in enumerate(completing) if chunks[i].seq.matcher]
            masked = self._masks.apply(logits, [r for r, _ in constrained], [m for _, m in constrained])  # type: ignore[misc]
            logits = apply_controls(masked, [self._history(chunks[i].seq) for i in completing], self._eos)
            if constrained:  # the controls forbid every token the grammar allows (e.g. end-of-sequence of a
                dead = ~(logits > float("-inf")).any(dim=-1)  # complete document before min_tokens): the grammar wins
                if bool(dead.any()):
                    logits[dead] = masked[dead]
        outputs: list[RequestOutput] = []
        for row, i in enumerate(completing):
            assert logits is not None
            try:
                outputs.append(self._with_prompt_logprobs(chunks[i].seq, self._emit(chunks[i], logits[row],
                                                                                    logprobs.get(row))))
            except Exception as exc:  # one request's failure (e.g. sampling) never ends the others
                log.exception("request %s failed", chunks[i].seq.request.request_id)
                outputs.append(self._fail(chunks[i].seq, f"sampling failed: {exc}"))
        return outputs

    @staticmethod
    def _with_prompt_logprobs(seq: SequenceState, out: RequestOutput) -> RequestOutput:
        """The request's first output carries its prompt's log-probabilities, when it asked for them."""
        if seq.request.params.prompt_logprobs is None or seq.prompt_lps_sent:
            return out
        seq.prompt_lps_sent = True
        return dataclasses.replace(out, prompt_logprobs=tuple(seq.prompt_lps))

    @staticmethod
    def _history(seq: SequenceState) -> RowHistory:
        """What the logit controls of ``seq`` read: its completion so far and its prompt's distinct tokens."""
        params, prompt = seq.request.params, seq.request.prompt_ids
        if seq.prompt_vocab is None:
            seq.prompt_vocab = prompt_vocab(params, prompt)
        return RowHistory(params, seq.tokens[len(prompt) :], seq.prompt_vocab)

    def _fail_unservable(self) -> list[RequestOutput]:
        """A preempted sequence that outgrew the whole cache can never run again: end it."""
        waiting = self.scheduler.waiting
        cache = self.cache
        if waiting and not self.scheduler.running:
            head = waiting[0]
            if cache.pages_needed(None, len(head.tokens) + 1) > cache.num_pages:
                log.warning("%s outgrew the KV cache (%d tokens); ending it", head.request.request_id,
                            len(head.tokens))
                return [self._finish(head, "length", new_tokens=(), delta=head.stream.flush())]
        return []

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (after an unexpected failure in a step). Every request ends, even
        when releasing one's pages raises too (logged): a request left behind would wedge every later step."""
        outs = []
        for seq in list(self._seqs.values()):
            try:
                outs.append(self._fail(seq, message))
            except Exception:  # _release_pages cleared its id before raising: ending it again releases nothing
                log.exception("%s: releasing its pages failed; ending it anyway", seq.request.request_id)
                outs.append(self._fail(seq, message))
        return outs

    def _emit(self, chunk: ScheduledChunk, logits: torch.Tensor, logprobs: torch.Tensor | None) -> RequestOutput:
        """Sample ``chunk``'s next token from logits [V] (controls applied); ``logprobs`` [V]: the model's
        log-probabilities there, when the request asked for them."""
        seq = chunk.seq
        params = seq.request.params
        if seq.matcher is not None and not bool(torch.isfinite(logits).any()):
            return self._fail(seq, f"the output's grammar allows no token here ({seq.matcher.get_error() or 'dead end'})")
        token = sample(logits, params, seq.rng)
        lps = (token_logprob(logprobs, token, params.logprobs or 0),) if logprobs is not None else ()
        now = time.perf_counter()
        seq.first_token_at = seq.first_token_at or now
        if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
            # not emitted; its log-probability is reported (as vLLM does: an echo's last entry is the sampled token)
            return self._finish(seq, "stop", new_tokens=(), delta=seq.stream.flush(), logprobs=lps)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            return self._fail(seq, f"token {token} does not continue the output's grammar: {seq.matcher.get_error()}")
        seq.tokens.append(token)
        seq.num_generated += 1
        self._generated += 1
        delta = seq.stream.push(token)
        if seq.stream.stopped:
            return self._finish(seq, "stop", new_tokens=(token,), delta=delta, logprobs=lps)
        if seq.matcher is not None and seq.matcher.is_stopped():  # the document is whole: nothing can follow
            return self._finish(seq, "stop", new_tokens=(token,), delta=delta + seq.stream.flush(), logprobs=lps)
        if seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.runner.max_context:
            return self._finish(seq, "length", new_tokens=(token,), delta=delta + seq.stream.flush(), logprobs=lps)
        return RequestOutput(seq.request.request_id, (token,), delta, len(seq.request.prompt_ids),
                             seq.num_generated, cached_tokens=seq.cached_tokens or 0, logprobs=lps)

    def _finish(self, seq: SequenceState, reason: str, new_tokens: tuple[int, ...], delta: str,
                error: str | None = None, logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
        self._release_pages(seq)
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request.request_id, None)
        return RequestOutput(seq.request.request_id, new_tokens, delta, len(seq.request.prompt_ids),
                             seq.num_generated, finished=True, finish_reason=reason, error=error,
                             cached_tokens=seq.cached_tokens or 0, logprobs=logprobs)

    def _fail(self, seq: SequenceState, error: str) -> RequestOutput:
        """End ``seq`` with finish reason "error" and ``error`` for its client."""
        return self._finish(seq, "error", new_tokens=(), delta="", error=error)

