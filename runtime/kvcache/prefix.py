"""Which stored pages the running sequences reference, and the reuse of a prompt's stored prefix.

Split from ``cache`` (which owns sequences, rows and page tables). Sealed pages are content
addressed (a digest chains the model fingerprint and every token up to the page's end), so two sequences
with the same leading tokens share pages: ``ref`` / ``unref`` count the sequences that reference each one,
and a referenced page's blocks are ``needed`` in the store (demoted, never dropped).

Reusing a prompt's stored prefix has two halves, so that the scheduler does no I/O:
- ``stored_prefix`` (the lookup): the longest run of the prompt's leading pages whose every layer is held
  in some tier (a hybrid model: up to a boundary whose sliding window was kept). It reads nothing;
- ``load`` (the step's load phase): read those pages once, page-major, summarise their keys and give them
  copies where placement puts a prefill's pages (a hybrid model's window is restored from its snapshot).
  A page that cannot be read (corrupt, or lost since the lookup) ends the prefix there.
"""

from __future__ import annotations

import logging

from kvdrive.runtime.attention import SummaryTable
from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import Placer
from kvdrive.runtime.kvcache.sequence import SeqKV
from kvdrive.runtime.kvcache.store import BlockKey, BlockStore, KVLayout
from kvdrive.runtime.kvcache.windows.snapshots import WindowKeeper
from kvdrive.runtime.prompt.digests import chain_digest

log = logging.getLogger(__name__)

READ_CHUNK_PAGES = 32  # a stored prefix is read this many pages at a time, every layer of them


class PrefixPages:
    def __init__(self, layout: KVLayout, store: BlockStore, mover: Mover, placer: Placer,
                 summaries: SummaryTable, keeper: WindowKeeper | None) -> None:
        self.layout, self.store, self.mover, self.placer = layout, store, mover, placer
        self.summaries, self.keeper = summaries, keeper
        self._refs: dict[bytes, list[int]] = {}  # digest -> [sequences referencing it, page id]
        self.hit_pages = 0  # pages reused from the tiers instead of recomputed

    @property
    def referenced(self) -> int:
        """Distinct pages the sequences reference."""
        return len(self._refs)

    def keys(self, digest: bytes) -> list[BlockKey]:
        return [BlockKey(digest, layer) for layer in range(self.layout.num_layers)]

    def ref(self, digest: bytes) -> int:
        """One more sequence references page ``digest``; returns its page id."""
        ref = self._refs.get(digest)
        if ref is None:
            ref = self._refs[digest] = [0, self.store.ref_page(digest)]
            self.store.set_needed(self.keys(digest), True)
        ref[0] += 1
        return ref[1]

    def unref(self, digest: bytes) -> None:
        ref = self._refs[digest]
        ref[0] -= 1
        if ref[0]:
            return
        del self._refs[digest]
        self.store.set_needed(self.keys(digest), False)  # stays cached (and persisted) until evicted
        self.store.unref_page(ref[1])

    def stored_prefix(self, prompt: list[int], root: bytes) -> list[bytes]:
        """Digests of the longest run of ``prompt``'s leading pages stored in the tiers (all layers), leaving
        at least one token to compute, on the chain that starts at ``root`` (a salted request's own). Reads
        nothing."""
        s, L = self.layout.page_size, self.layout.num_layers
        digests, prev = [], root
        for p in range((len(prompt) - 1) // s):
            prev = chain_digest(prev, prompt[p * s : (p + 1) * s])
            keys = [BlockKey(prev, layer) for layer in range(L)]
            if prev not in self._refs and any(t is None for t in self.store.where_many(keys)):
                break
            digests.append(prev)
        if self.keeper is not None:  # a hybrid model: only up to a boundary whose window was kept
            while digests and not self.keeper.has(digests[-1]):
                digests.pop()
        return digests

    def load(self, seq: SeqKV) -> bool:
        """Read the ``seq.unloaded`` leading pages that were matched and referenced at open. False when some
        could not be read: ``seq`` is then cut back to the pages before the first of them (their tokens are
        not computed), which are dereferenced."""
        matched = seq.unloaded
        if not matched:
            return True
        seq.unloaded = 0
        kept = self._read(seq)
        if kept and self.keeper is not None and not self.keeper.restore(seq, kept):
            kept = 0
        self.hit_pages += kept
        if kept == matched:
            log.info("prefix reuse: %d prompt tokens already stored", seq.length)
            return True
        self.placer.release(seq.pids[kept:])
        for d in seq.digests[kept:]:
            self.unref(d)
        del seq.digests[kept:], seq.pids[kept:]
        del seq.tokens[kept * self.layout.page_size :]
        seq.length = len(seq.tokens)
        log.warning("prefix reuse: %d of %d matched pages readable; the rest is recomputed", kept, matched)
        return False

    def _read(self, seq: SeqKV) -> int:
        """Read the stored prefix pages once, page-major in chunks: summarise their keys and place them as
        a prefill of these tokens would have left them. Returns how many leading pages were readable."""
        lay, chunk = self.layout, READ_CHUNK_PAGES
        for p0 in range(0, len(seq.digests), chunk):
            part = seq.digests[p0 : p0 + chunk]
            for layer in range(lay.num_layers):
                keys = [BlockKey(d, layer) for d in part]
                raw, served = self.mover.fetch(keys)  # needed reads: counted per tier
                good = served.index(None) if None in served else len(part)
                if good:
                    kv = lay.typed(raw[:good])  # [good, 2, Hkv, S, D]
                    self.summaries.set(layer, seq.row, p0, kv[:, 0], kv[:, 1])
                    self.mover.admit(keys[:good], raw[:good], self.placer.initial_tier, served[:good])
                if good < len(part):
                    log.warning("stored prefix page %d unreadable; recomputing from there", p0 + good)
                    return p0 + good
        return len(seq.digests)
