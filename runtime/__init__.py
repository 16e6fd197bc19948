"""KVDrive runtime (import name ``kvdrive.runtime``): model, tiered KV cache, engine and server."""

__version__ = "0.1.0"
