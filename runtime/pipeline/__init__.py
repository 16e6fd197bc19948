"""Moving bytes between tiers: the async transfer engine (priorities, completion, CUDA streams)."""

from kvdrive.runtime.pipeline.transfer import Priority, TransferEngine, TransferHandle

__all__ = ["Priority", "TransferEngine", "TransferHandle"]
