"""The attention backend of one engine step over the tiered KV cache.

Per layer: the step's new K/V go into each sequence's open tail page; pages that fill up are sealed
into the store (one block per layer) and summarised. Prompt chunks attend exactly to all earlier
pages (read from whichever tier holds them). Decode queries attend to the pages the selector picks
under the token budget (all pages with ``--full-attention`` or ``fullfetch``), batched across
sequences; blocks not in the device tier are read on demand (waiting for an in-flight prefetch when
there is one) and, under the promoting policies, get a device-tier copy. The attention mass each page
received feeds placement's hotness.
"""

from __future__ import annotations

import time

import torch

from kvdrive.runtime.attention import causal_attention, decode_attention, select_with_runners_up
from kvdrive.runtime.engine.tiered_cache import PageLostError, StepSeq, TieredKVCache
from kvdrive.runtime.kvcache import BlockKey
from kvdrive.runtime.kvcache.tiers.rows import gather_rows


class TieredAttentionBackend:
    """Implements ``kvdrive.runtime.model.AttentionBackend`` over a ``TieredKVCache``."""

    def __init__(self, cache: TieredKVCache, steps: list[StepSeq]) -> None:
        self.cache = cache
        self.steps = steps
        self.sealed: list[BlockKey] = []  # blocks stored this step (for write-back)
        self.decoded = [s.seq_id for s in steps if s.decode]

    # --- writing -----------------------------------------------------------------------------
    def _append(self, layer: int, st: StepSeq, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [n, Hkv, D]; returns K/V of the tokens from the start of the tail page on: [o+n, Hkv, D]."""
        cache = self.cache
        seq = cache.seq(st.seq_id)
        s = cache.layout.page_size
        o = st.start % s
        assert seq.tail_k is not None and seq.tail_v is not None and seq.summaries is not None
        dtype = cache.layout.dtype
        ck = torch.cat([seq.tail_k[layer, :o], k.to(dtype)]) if o else k.to(dtype)
        cv = torch.cat([seq.tail_v[layer, :o], v.to(dtype)]) if o else v.to(dtype)
        full = len(st.new_digests)
        if full:
            pk = ck[: full * s].view(full, s, *ck.shape[1:])
            pv = cv[: full * s].view(full, s, *cv.shape[1:])
            keys = [BlockKey(d, layer) for d in st.new_digests]
            cache.store.put(keys, cache.store.to_blocks(pk, pv), "gpu", needed=True, persistent=True)
            seq.summaries.set(layer, st.start // s, pk)
            self.sealed.extend(keys)
        rem = ck.shape[0] - full * s
        if rem:
            seq.tail_k[layer, :rem] = ck[full * s :]
            seq.tail_v[layer, :rem] = cv[full * s :]
        return ck, cv

    # --- reading -----------------------------------------------------------------------------
    def _read(self, seq_id: int, keys: list[BlockKey], promote: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n * S, Hkv, D] of ``keys`` in order, from the fastest tier holding each. The order is
        kept even where attention does not need it, so that results never depend on placement."""
        cache = self.cache
        lay = cache.layout
        if not keys:
            empty = torch.empty((0, lay.num_kv_heads, lay.head_dim), dtype=lay.dtype, device=cache.device)
            return empty, empty
        t0 = time.perf_counter()
        for late in cache.ledger.claim(keys):
            try:
                late.wait()  # type: ignore[attr-defined]
            except Exception:  # a failed prefetch only means the read below goes to a lower tier
                pass
        raw, served = cache.store.fetch(keys)
        cache.fetch_wait_seconds += time.perf_counter() - t0
        if None in served:
            cache.pages_lost += 1
            raise PageLostError(seq_id, f"{served.count(None)} KV pages of sequence {seq_id} could not be read")
        if promote:
            lower = [i for i, t in enumerate(served) if t != "gpu"]
            if cache.policy.hotness_eviction:  # kvdrive: admission by hotness, per destination
                dest: dict[str, list[int]] = {}
                movable = cache.promote_from
                for i in (i for i in lower if served[i] in movable):
                    dst = cache.target_tier(keys[i], str(served[i]))
                    if dst is not None and dst != served[i]:
                        dest.setdefault(dst, []).append(i)
            else:  # lru: everything read goes to the device tier
                dest = {"gpu": lower} if lower else {}
            for dst, rows in dest.items():
                cache.store.admit([keys[i] for i in rows], gather_rows(raw, rows), dst, [served[i] for i in rows])
        kv = raw.view(lay.dtype).view(len(keys), 2, lay.page_size, lay.num_kv_heads, lay.head_dim)
        return kv[:, 0].reshape(-1, lay.num_kv_heads, lay.head_dim), kv[:, 1].reshape(-1, lay.num_kv_heads, lay.head_dim)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]
        cache = self.cache
        s = cache.layout.page_size
        outs: list[torch.Tensor | None] = [None] * len(self.steps)
        dec_rows: list[int] = []  # positions in self.steps of the decoding sequences
        dec_q: list[int] = []  # their query row in q
        dec_k: list[torch.Tensor] = []
        dec_v: list[torch.Tensor] = []
        dec_keys: list[list[BlockKey]] = []
        start = 0
        for i, st in enumerate(self.steps):
            rows = slice(start, start + st.num_new)
            start += st.num_new
            ck, cv = self._append(layer, st, k[rows], v[rows])
            seq = cache.seq(st.seq_id)
            first = st.start // s  # the tail page at the step's start; pages before it are stored
            if not st.decode or not cache.policy.sparse:
                pages = range(first) if not st.decode else range(len(seq.digests))
                keys = [BlockKey(seq.digests[p], layer) for p in pages]
                ok, ov = self._read(st.seq_id, keys, promote=False)
                if not st.decode:  # prompt tokens: exact attention to every earlier page
                    outs[i] = causal_attention(q[rows], torch.cat([ok, ck]), torch.cat([ov, cv]), st.positions)
                    continue
                tail = ck[len(st.new_digests) * s :], cv[len(st.new_digests) * s :]
                dec_rows.append(i)
                dec_q.append(rows.start)
                dec_k.append(torch.cat([ok, tail[0]]))
                dec_v.append(torch.cat([ov, tail[1]]))
                dec_keys.append(keys)
                continue
            sealed = len(seq.digests)
            assert seq.summaries is not None
            kmin, kmax = seq.summaries.of(layer, sealed)
            idx, near = select_with_runners_up(q[rows][0], kmin, kmax, cache.selection, cache.runners_up) \
                if sealed else ([], [])
            keys = [BlockKey(seq.digests[p], layer) for p in (idx.tolist() if sealed else [])]
            seq.selected[layer] = keys
            seq.runners_up[layer] = [BlockKey(seq.digests[p], layer) for p in (near.tolist() if sealed else [])]
            sk, sv = self._read(st.seq_id, keys, promote=cache.policy.promote_on_read)
            nt = len(st.new_digests) * s
            dec_rows.append(i)
            dec_q.append(rows.start)
            dec_k.append(torch.cat([sk, ck[nt:]]))
            dec_v.append(torch.cat([sv, cv[nt:]]))
            dec_keys.append(keys)
        if dec_rows:
            qd = q[dec_q]  # [B, Hq, D]
            out, mass = decode_attention(qd, dec_k, dec_v)
            for j, i in enumerate(dec_rows):
                outs[i] = out[j : j + 1]
                if cache.policy.hotness_eviction and dec_keys[j]:
                    n = len(dec_keys[j])
                    cache.hotness.record(dec_keys[j], mass[j][: n * s].view(n, s).sum(dim=1).tolist())
        return torch.cat([o for o in outs if o is not None], dim=0)
