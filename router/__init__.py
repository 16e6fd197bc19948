"""The prefix-aware router (``kvdrive route``): an OpenAI-compatible proxy in front of KVDrive replicas that
sends each prompt to the replica whose tiers already hold its leading pages, weighted by load. It imports
no torch: it tokenizes with the replicas' own tokenizer spec and computes page digests with the runtime's
``kvdrive.runtime.prompt``."""
