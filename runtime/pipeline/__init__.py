"""Moving bytes between tiers: the ``Mover`` (the only caller of a tier's read, write, discard and resize) and
the async transfer engine that runs its prefetch and write-back jobs (priorities, completion, CUDA streams)."""

from kvdrive.runtime.pipeline.mover import Mover
from kvdrive.runtime.pipeline.transfer import Priority, TransferEngine, TransferHandle

__all__ = ["Mover", "Priority", "TransferEngine", "TransferHandle"]
