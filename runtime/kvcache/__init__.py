"""The KV cache: one package for everything a page's life touches, with ``KVCache`` as its composition root.

Layers, top to bottom (each imports only those below it; ``lint-imports`` holds them):

- ``backend`` -- one forward step's attention over the cache (writes, selects, reads, attends);
- ``cache`` -- ``KVCache``: sequences, their rows and page tables, steps; builds every part below;
- ``step_reads``, ``prefix``, ``promotions``, ``envelope``, ``windows`` -- a step's page reads into its
  buffer, prefix reuse, the copies reads earn, the device envelope's split, sliding-window rings and snapshots;
- ``mover`` -- the only code that moves bytes (``Mover``: runner, reader, resizer; ``TransferQueue``);
- ``placement`` -- the only code that chooses a tier (``Placer``, its ``TierEviction``);
- ``store`` -- the tiers and the block table: what is stored where (``BlockStore``: table, reads, resize);
- ``contract``, ``config`` -- the store <-> mover contract (read it first) and plain configuration data.
"""

from kvdrive.runtime.kvcache.cache import KVCache
from kvdrive.runtime.kvcache.config import EngineConfig, EnvelopeSplit, PageLostError, StepSeq, TierConfig

__all__ = ["EngineConfig", "EnvelopeSplit", "KVCache", "PageLostError", "StepSeq", "TierConfig"]
