"""The KV cache: one package for everything a page's life touches, with ``KVCache`` as its composition root.

Layers, top to bottom (each imports only those below it; ``lint-imports`` holds them):

- ``backend`` -- one forward step's attention over the cache (writes, selects, reads, attends);
- ``cache`` -- ``KVCache``: sequences, their rows and page tables, steps; builds every part below;
- ``shared_prefix`` -- a prompt's prefix fetched from the shared tier ahead of its prefill; pages published;
- ``step_reads``, ``prefix``, ``promotions``, ``envelope``, ``windows`` -- a step's page reads into its
  buffer, prefix reuse, the copies reads earn, the device envelope's split, sliding-window rings and snapshots;
- ``mover`` -- the only code that moves bytes (``Mover``: runner, reader, resizer; ``TransferQueue``);
- ``placement`` -- the only code that chooses a tier (``Placer``, its ``TierEviction``);
- ``store`` -- the tiers and the block table: what is stored where (``BlockStore``: table, reads, writes, resize);
- ``contract``, ``config`` -- the store <-> mover contract (read it first) and plain configuration data.
"""

from kvdrive.runtime.kvcache.cache import KVCache
from kvdrive.runtime.kvcache.config import EngineConfig, EnvelopeSplit, SharedTierConfig, TierConfig
from kvdrive.runtime.kvcache.counters import CacheCounters
from kvdrive.runtime.kvcache.envelope import default_envelope_bytes, reserve_bytes
from kvdrive.runtime.kvcache.sequence import PageLostError, StepSeq
from kvdrive.runtime.kvcache.shared_prefix import PrefixWarmup
from kvdrive.runtime.kvcache.store import BudgetError, CacheFullError, KVLayout
from kvdrive.runtime.kvcache.store.faults import FaultLog
from kvdrive.runtime.kvcache.store.page_events import PageChange, PageEvents
from kvdrive.runtime.kvcache.windows import SlidingWindows

__all__ = [
    "BudgetError", "CacheCounters", "CacheFullError", "EngineConfig", "EnvelopeSplit", "FaultLog", "KVCache", "KVLayout",
    "PageChange", "PageEvents", "PageLostError", "PrefixWarmup", "SlidingWindows", "SharedTierConfig", "StepSeq", "TierConfig", "default_envelope_bytes",
    "reserve_bytes",
]
