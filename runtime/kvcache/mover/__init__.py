"""Moving bytes between tiers: the ``Mover`` (the only caller of a tier's read, write, discard and resize; its
parts run moves, reads and resizes) and the ``TransferQueue`` that runs its prefetch and write-back jobs off
the engine thread (priorities, completion, CUDA streams)."""

from kvdrive.runtime.kvcache.mover.mover import Mover
from kvdrive.runtime.kvcache.mover.transfer import Priority, TransferHandle, TransferQueue

__all__ = ["Mover", "Priority", "TransferHandle", "TransferQueue"]
