"""The KV-event wire format: vLLM's ``kv_events`` messages, byte for byte, and how KVDrive's tiers map onto it.

A message is a ZMQ multipart ``(topic, sequence, payload)``: the topic as the publisher was told
(``--kv-events-topic``; llm-d expects ``kv@<pod>@<model>``), the batch's sequence number as 8 bytes big-endian,
and the payload, one msgpack ``EventBatch``. Structs are msgspec *tagged arrays*, as vLLM declares them
(``array_like``, ``tag=True``, ``omit_defaults``), which is what llm-d's KV-cache indexer and Dynamo's KV router
decode:

- ``EventBatch`` = ``[ts, [event, ...], data_parallel_rank]``
- ``BlockStored`` = ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``
- ``BlockRemoved`` = ``["BlockRemoved", block_hashes, medium]``
- ``AllBlocksCleared`` = ``["AllBlocksCleared"]``

A block is one KVDrive page (``page_size`` tokens, every layer), named by the page's 16-byte content digest
(``kvdrive.runtime.prompt.digests``). vLLM's ``ExternalBlockHash`` is an int or bytes: by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the digest's low 64 bits, its last 8 bytes read big-endian, as an
unsigned integer; otherwise the whole digest as msgpack bin. Both are sent here (``--kv-events-hashes``), int by
default, and consumers fold either to the same 64 bits (``fold``). The medium names the tier: ``GPU`` (the
device tier), ``CPU`` (host DRAM), ``DISK`` (the NVMe tier), and ``EXTERNAL`` (``SHARED_MEDIUM``) for the fleet's
shared tier, a store every replica can read: the name SGLang gives its shared L3 pool (Mooncake and the like) and
SGLang's router reads (vLLM names only ``GPU`` and ``CPU``). A page announced there is reachable from every
replica of the fleet, not only from the one that announced it (docs/kv-events.md).

The replay socket (ZMQ ROUTER) answers a request ``(identity, b"", start_seq 8 bytes big-endian)`` with every
buffered batch from ``start_seq`` on, each ``(identity, b"", seq, payload)``, then ``(identity, b"", -1, b"")``.
"""

from __future__ import annotations

from typing import Any

import msgspec

SHARED_MEDIUM = "EXTERNAL"  # the shared tier's medium: held in a store every replica of the fleet can read
MEDIUM: dict[str, str] = {"gpu": "GPU", "dram": "CPU", "ssd": "DISK", "shared": SHARED_MEDIUM}  # tier -> medium
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame
ExternalBlockHash = int | bytes
LOW_64 = (1 << 64) - 1


def fold(block_hash: ExternalBlockHash) -> int:
    """A block hash as the 64 bits vLLM sends by default: an int as it is, bytes as their last 8 read big-endian
    (what ``int.from_bytes(digest, "big")`` masked to 64 bits gives)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & LOW_64


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what a pod holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None  # the page before the first of block_hashes; None at a sequence's start
    token_ids: list[int]  # every token of the stored pages, in order (none for pages recovered from disk)
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


EVENT_TYPES: dict[str, type[Event]] = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


def as_map(batch: EventBatch) -> dict[str, Any]:
    """The batch in vLLM's newer map form (its structs without ``array_like``, since vLLM PR #42892): the
    batch and each event a map, an event's kind under ``"type"``."""
    return {"ts": batch.ts, "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events],
            "data_parallel_rank": batch.data_parallel_rank}


class BatchDecoder:
    """Reads a batch in either form (positional arrays, or maps with ``"type"``) into ``EventBatch``."""

    def __init__(self) -> None:
        self._arrays = msgspec.msgpack.Decoder(EventBatch)
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> EventBatch:
        try:
            return self._arrays.decode(payload)
        except msgspec.ValidationError:
            raw = self._any.decode(payload)
            if not isinstance(raw, dict) or not isinstance(raw.get("events"), list):
                raise
            events: list[Event] = []
            for e in raw["events"]:
                kind = EVENT_TYPES.get(e.get("type")) if isinstance(e, dict) else None
                if kind is None:
                    raise msgspec.ValidationError(f"an event of unknown type {e!r:.80}") from None
                events.append(msgspec.convert([kind.__name__, *(e.get(f) for f in kind.__struct_fields__)], kind))
            return EventBatch(ts=float(raw.get("ts", 0.0)), events=events,
                              data_parallel_rank=raw.get("data_parallel_rank"))


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> BatchDecoder:
    return BatchDecoder()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)

