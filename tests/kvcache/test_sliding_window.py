"""Hybrid attention through the engine: sliding-window layers keep a ring of their window, global layers
use the tiers, and the logits are those of attending over the whole KV with the window mask.

A tiny random Llama is made hybrid by its config (layer 0 slides with a 6-token window, layer 1 is
global), so the engine's sliding path is checked against a dense reference that keeps every token's K/V
and masks by position: prompts in chunks that straddle the window, batched decodes past it, and a row
reused by a second sequence (stale ring slots must never be attended to).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.model import LoadedModel, load_model

WINDOW = 6


class DenseWindowReference:
    """Every token's K/V in full; sliding layers mask keys outside (p - window, p]."""

    def __init__(self, sliding: tuple[int, ...], window: int) -> None:
        self.sliding, self.window = sliding, window
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.positions = torch.zeros(0, dtype=torch.int64)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # one sequence: q [N, Hq, D], k, v [N, Hkv, D] appended after what it holds -> [N, Hq, D]
        self.k[layer] = torch.cat([self.k.get(layer, k[:0]), k])
        self.v[layer] = torch.cat([self.v.get(layer, v[:0]), v])
        t, n = self.k[layer].shape[0], q.shape[0]
        kp, qp = torch.arange(t), torch.arange(t - n, t)
        mask = kp[None, :] <= qp[:, None]
        if layer in self.sliding:
            mask &= kp[None, :] > qp[:, None] - self.window
        out = F.scaled_dot_product_attention(q.transpose(0, 1), self.k[layer].transpose(0, 1),
                                             self.v[layer].transpose(0, 1), attn_mask=mask,
                                             scale=1 / math.sqrt(q.shape[-1]), enable_gqa=True)
        return out.transpose(0, 1)


def _hybrid(loaded: LoadedModel) -> LoadedModel:
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sliding_window=WINDOW,
                                                                   sliding_layers=(0,)))


def _reference_greedy(loaded: LoadedModel, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of every prompt position and then of each greedy token fed back [T + n - 1, V], and the ``n``
    greedy tokens, from the dense reference."""
    ref = DenseWindowReference(loaded.config.sliding_layers, WINDOW)
    model = loaded.model
    logits = [model.logits(model(torch.tensor(prompt), torch.arange(len(prompt)), ref))]
    out, tok, pos = [], int(logits[0][-1].argmax()), len(prompt)
    for i in range(n):
        out.append(tok)
        if i + 1 < n:
            logits.append(model.logits(model(torch.tensor([tok]), torch.tensor([pos]), ref)))
            tok, pos = int(logits[-1][-1].argmax()), pos + 1
    return torch.cat(logits), out


def test_sliding_layers_match_attention_over_the_whole_kv_with_the_window_mask(hf_model_factory,
                                                                                tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = _hybrid(load_model(str(path), progress=False))
    prompts = [list(range(5, 45)), list(range(60, 83))]  # 40 and 23 tokens: several windows each
    gen = ModelRunner(loaded, EngineConfig(page_size=4, prefill_chunk=7, max_sequences=2,
                                         tiers=TierConfig()))
    assert gen.cache.layout.num_layers == 1  # the tiers hold the one global layer
    assert gen.cache.windows is not None and gen.cache.windows.ring.shape[2] == WINDOW + 4  # the window and a page
    expected = [_reference_greedy(loaded, p, 12) for p in prompts]

    seqs = [gen.new_sequence() for _ in prompts]
    for seq, p, (ref_logits, _) in zip(seqs, prompts, expected, strict=True):
        ours = gen.prefill(seq, p, all_logits=True)  # chunks of 7 tokens straddle the 6-token window
        torch.testing.assert_close(ours, ref_logits[: len(p)], atol=2e-4, rtol=1e-4)
    cache = gen.cache
    held = cache.bytes_by_layer_kind()  # 10 + 5 sealed pages and 2 open ones of the global layer; 2 rings
    assert held == {"global": (15 + 2) * cache.layout.page_bytes, "sliding": 2 * cache.windows.bytes_per_sequence()}
    # batched decodes past the window, both sequences in one step
    last = [int(_reference_greedy(loaded, p, 1)[1][0]) for p in prompts]
    got: list[list[int]] = [[t] for t in last]
    for _ in range(11):
        logits = gen.decode([(seq, g[-1]) for seq, g in zip(seqs, got, strict=True)])
        for g, row in zip(got, logits, strict=True):
            g.append(int(row.argmax()))
    assert got == [e[1] for e in expected]

    # the first sequence's row is reused by a shorter one: its old ring slots must not leak in
    gen.release(seqs[0])
    short = list(range(100, 104))  # shorter than the window: slots past it still hold the old sequence's KV
    seq = gen.new_sequence()
    ref_logits, ref_tokens = _reference_greedy(loaded, short, 4)
    ours = [gen.prefill(seq, short, all_logits=True)]
    for tok in ref_tokens[:3]:  # decodes at positions 4-6: the window fills over the old sequence's slots
        ours.append(gen.decode([(seq, tok)]))
    torch.testing.assert_close(torch.cat(ours), ref_logits, atol=2e-4, rtol=1e-4)


def test_a_reused_prefix_restores_the_window_its_prompt_left(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A prompt that is in keeps its sliding window at its last page boundary (a snapshot on the SSD
    tier's disk). After a restart, a prompt with that prefix reuses the global pages and restores the
    window, and its logits are those of computing everything; a snapshot that fails its checksum means
    recomputing."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = _hybrid(load_model(str(path), progress=False))
    ssd = tmp_path / "ssd"
    config = EngineConfig(page_size=4, prefill_chunk=7, max_sequences=2, tiers=TierConfig(
        ssd_dir=str(ssd), ssd_bytes=16 << 20))
    gen = ModelRunner(loaded, config)
    doc = list(range(5, 45))  # 40 tokens: 10 pages
    first, reused = gen.open_sequence(doc)
    assert reused == 0
    logits = gen.prefill(first, doc)
    gen.decode([(first, int(logits.argmax()))])  # the prompt is in: its window is kept, at 9 pages (for
    # the same prompt again: reuse stops at the last page before its final token) and at 10 (a continuation)
    assert gen.cache.snapshots is not None and gen.cache.snapshots.saved == 2
    gen.release(first)
    gen.close()
    gen = ModelRunner(loaded, config)  # a restart: the pages and the snapshot come from the SSD tier's disk

    follow = doc + list(range(150, 161))  # the same document, another question
    ref_logits, _ = _reference_greedy(loaded, follow, 1)
    seq, reused = gen.open_sequence(follow)
    assert reused == 40  # the 10 pages and the window before them
    torch.testing.assert_close(gen.prefill(seq, follow[reused:], all_logits=True), ref_logits[reused:],
                               atol=2e-4, rtol=1e-4)
    gen.release(seq)

    for snap in (ssd / "windows").glob("*.win"):
        raw = bytearray(snap.read_bytes())
        raw[-5] ^= 0xFF
        snap.write_bytes(bytes(raw))
    seq, reused = gen.open_sequence(follow)
    assert reused == 0 and gen.cache.snapshots.failed == 1  # recomputed, never a corrupt window served
    torch.testing.assert_close(gen.prefill(seq, follow, all_logits=True), ref_logits, atol=2e-4, rtol=1e-4)


def test_without_write_through_the_disk_snapshots_are_read_and_none_added(
        hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``persist=False`` (the accuracy bench's reference and candidate runs) reuses what a persisting run
    left on disk, and adds nothing (new snapshots would only displace the ones it reads)."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = _hybrid(load_model(str(path), progress=False))
    tiers = TierConfig(ssd_dir=str(tmp_path / "ssd"), ssd_bytes=16 << 20)
    doc = list(range(5, 45))
    gen = ModelRunner(loaded, EngineConfig(page_size=4, max_sequences=2, tiers=tiers))
    seq, _ = gen.open_sequence(doc)
    gen.prefill(seq, doc)
    gen.release(seq)  # a clean release keeps the window too
    gen.close()
    on_disk = sorted(p.name for p in (tmp_path / "ssd" / "windows").iterdir())
    assert len(on_disk) == 2

    reader = ModelRunner(loaded, EngineConfig(page_size=4, max_sequences=2,
                                            tiers=dataclasses.replace(tiers, persist=False)))
    seq, reused = reader.open_sequence(doc)
    assert reused == 36  # the last page before the final token, restored from the disk's snapshot
    torch.testing.assert_close(reader.prefill(seq, doc[reused:], all_logits=True),
                               _reference_greedy(loaded, doc, 1)[0][reused:], atol=2e-4, rtol=1e-4)
    other = list(range(60, 100))
    seq2, _ = reader.open_sequence(other)
    reader.prefill(seq2, other)
    reader.release(seq2)
    assert reader.cache.snapshots is not None and reader.cache.snapshots.saved == 0
    assert sorted(p.name for p in (tmp_path / "ssd" / "windows").iterdir()) == on_disk
    reader.close()


def test_a_ring_restored_at_one_boundary_is_never_kept_for_an_earlier_one(hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A reused prefix restores the window before its last page boundary only. Freed at once (no step), its
    ring does not hold the window before the page boundary just below (those positions were never given
    back), so no snapshot is kept there, and a shorter prompt ending at that boundary is recomputed, exact."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = _hybrid(load_model(str(path), progress=False))
    config = EngineConfig(page_size=4, max_sequences=2, tiers=TierConfig(
        ssd_dir=str(tmp_path / "ssd"), ssd_bytes=16 << 20))
    doc = list(range(5, 45))
    gen = ModelRunner(loaded, config)
    seq, _ = gen.open_sequence(doc)
    gen.prefill(seq, doc)
    gen.release(seq)  # windows kept at 36 and 40 tokens
    gen.close()
    gen = ModelRunner(loaded, config)  # restarted: memory tiers empty, rings blank
    seq, reused = gen.open_sequence(doc)
    assert reused == 36
    gen.release(seq)  # no step ran: the ring holds positions 30-35 only
    assert gen.cache.snapshots is not None and gen.cache.snapshots.saved == 0
    short = doc[:33]  # its reusable boundary is 32 tokens: the window before it needs positions 26-31
    seq, reused = gen.open_sequence(short)
    assert reused == 0
    torch.testing.assert_close(gen.prefill(seq, short, all_logits=True), _reference_greedy(loaded, short, 1)[0],
                               atol=2e-4, rtol=1e-4)


def test_a_long_prompt_leaves_checkpoints_that_a_prompt_sharing_its_beginning_reuses(
        hf_model_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same document with another question shares only the document's pages. Snapshots kept at the
    prompt's ends do not cover that boundary; the checkpoints a long prompt leaves every
    ``window_checkpoint`` tokens do, so the second prompt reuses all but the tokens after the last
    checkpoint before the two differ, and its logits are those of computing everything."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = _hybrid(load_model(str(path), progress=False))
    config = EngineConfig(page_size=4, prefill_chunk=7, max_sequences=2, window_checkpoint=12, tiers=TierConfig(
        ssd_dir=str(tmp_path / "ssd"), ssd_bytes=16 << 20))
    doc = list(range(5, 35))  # 30 tokens of document
    gen = ModelRunner(loaded, config)
    seq, _ = gen.open_sequence(doc + [200, 201, 202, 203, 204, 205, 206, 207, 208, 209])
    gen.prefill(seq, doc + [200, 201, 202, 203, 204, 205, 206, 207, 208, 209])
    gen.release(seq)
    assert gen.cache.snapshots is not None
    assert gen.cache.snapshots.saved == 4  # chunk ends 14, 28, 40 checkpoint 12, 28, 40; the release adds 36
    other = doc + [150, 151, 152, 153, 154, 155]  # diverges at token 30: its last shared checkpoint is 28
    seq, reused = gen.open_sequence(other)
    assert reused == 28
    torch.testing.assert_close(gen.prefill(seq, other[reused:], all_logits=True),
                               _reference_greedy(loaded, other, 1)[0][reused:], atol=2e-4, rtol=1e-4)
    gen.release(seq)
    gen.close()


def test_the_default_gpu_budget_holds_the_windows_of_every_row_and_a_full_context_sequence(
        hf_model_factory) -> None:  # type: ignore[no-untyped-def]
    """Tried as a new user would (`kvdrive serve --model gemma3-270m --full-attention`, no budget flags):
    16 rows' sliding windows outweigh one full-context sequence's pages, and the default envelope must
    still leave that sequence room beside them."""
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    base = load_model(str(path), progress=False)
    loaded = dataclasses.replace(base, config=dataclasses.replace(base.config, sliding_window=128, sliding_layers=(0,)))
    for full in (True, False):
        gen = ModelRunner(loaded, EngineConfig(page_size=4, max_sequences=16, full_attention=full, tiers=TierConfig()))
        try:
            assert gen.cache.windows is not None
            windows = 16 * gen.cache.windows.bytes_per_sequence()
            assert windows > gen.cache.layout.pages_for(256) * gen.cache.layout.page_bytes  # the case that refused
            assert gen.request_limit() == 256  # a whole-context request fits the hot tier
            gen.check_prompt(255)
        finally:
            gen.close()


@pytest.mark.gpu
def test_on_a_gpu_the_default_gpu_budget_is_sized_from_its_free_memory(hf_model_factory) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, _ = hf_model_factory(arch="llama", max_position_embeddings=256)
    loaded = load_model(str(path), device="cuda", progress=False)
    free = torch.cuda.mem_get_info()[0]
    gen = ModelRunner(loaded, EngineConfig(page_size=4, max_sequences=4, tiers=TierConfig()))
    try:
        budget = gen.config.tiers.envelope_bytes
        assert budget is not None and budget <= 0.8 * free
        assert gen.request_limit() == 256
    finally:
        gen.close()
