"""The shared tier's pieces that need no server: a value proves it is the page asked for (every way it can
be wrong is refused with its cause), a shard's breaker opens, waits and closes, and the tier's URL and
options are refused clearly when wrong."""

from __future__ import annotations

import pytest
import torch

from kvdrive.runtime.kvcache import SharedTierConfig
from kvdrive.runtime.kvcache.store.shared import CAUSES, BadValue, PageFormat, cache_identity
from kvdrive.runtime.kvcache.store.shared.breaker import COOLDOWN_S, FAILURES, Breaker
from kvdrive.runtime.kvcache.store.shared.values import HEADER

FMT = PageFormat(cache_identity("model-a|bf16|16|layout"), 3, 64)
D1, D2 = bytes(range(16)), bytes(range(1, 17))


def _blocks(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _cause(value: bytes, digest: bytes = D1, fmt: PageFormat = FMT) -> str:
    with pytest.raises(BadValue) as err:
        fmt.decode(digest, value)
    assert err.value.cause in CAUSES
    return err.value.cause


def test_a_value_round_trips_only_for_its_own_page_and_cache() -> None:
    blocks = _blocks()
    value = FMT.encode(D1, blocks)
    assert len(value) == FMT.value_bytes == HEADER.size + 3 * 64
    assert torch.equal(FMT.decode(D1, value), blocks)
    assert _cause(value, D2) == "digest"  # stored under another page's key (swapped)
    other_model = PageFormat(cache_identity("model-b|bf16|16|layout"), 3, 64)
    assert _cause(other_model.encode(D1, blocks)) == "identity"  # another model (or dtype) wrote it
    assert _cause(PageFormat(FMT.identity, 3, 32).encode(D1, blocks[:, :32])) == "layout"


@pytest.mark.parametrize("where", [HEADER.size, HEADER.size + 100, len(FMT.encode(D1, _blocks())) - 1])
def test_a_flipped_payload_byte_is_a_checksum_failure(where: int) -> None:
    value = bytearray(FMT.encode(D1, _blocks()))
    value[where] ^= 0x10
    assert _cause(bytes(value)) == "checksum"


def test_truncated_magic_and_version_are_refused() -> None:
    value = FMT.encode(D1, _blocks())
    assert _cause(value[:-1]) == "truncated"
    assert _cause(value[: HEADER.size - 1]) == "truncated"
    assert _cause(value + b"x") == "truncated"
    assert _cause(b"XXXX" + value[4:]) == "magic"
    assert _cause(value[:4] + (9).to_bytes(2, "little") + value[6:]) == "version"


def test_encode_refuses_blocks_of_another_shape() -> None:
    with pytest.raises(ValueError, match="expected"):
        FMT.encode(D1, torch.zeros(2, 64, dtype=torch.uint8))


def test_the_breaker_opens_after_failures_probes_after_its_cooldown_and_closes_on_success() -> None:
    now = [0.0]
    br = Breaker(clock=lambda: now[0])
    for _ in range(FAILURES - 1):
        br.failure("refused")
    assert br.allow() and not br.is_open
    br.failure("refused")
    assert br.is_open and not br.allow()  # open: calls refused at once
    now[0] += COOLDOWN_S
    assert br.probe_due() and br.allow()  # one probe goes through ...
    assert not br.allow()  # ... and only one
    br.failure("still refused")  # the probe failed: open again, for longer
    now[0] += COOLDOWN_S
    assert not br.allow()
    now[0] += COOLDOWN_S
    assert br.allow()
    br.success()
    assert not br.is_open and br.allow()


def test_the_url_and_options_are_parsed_or_refused_naming_what_is_wrong() -> None:
    cfg = SharedTierConfig.parse("valkeys://a.example:6380,10.0.0.2:7000", "fleet-1", timeout_ms=250)
    assert cfg.endpoints == (("a.example", 6380), ("10.0.0.2", 7000)) and cfg.tls and cfg.timeout_s == 0.25
    assert not SharedTierConfig.parse("redis://h:1").tls
    for url, match in [("http://h:1", "expected valkey://"), ("valkey://h", "not HOST:PORT"),
                       ("valkey://h:0", "not HOST:PORT"), ("valkey://h:1,:2", "not HOST:PORT"), ("h:1", "expected")]:
        with pytest.raises(ValueError, match=match):
            SharedTierConfig.parse(url)
    with pytest.raises(ValueError, match="namespace"):
        SharedTierConfig.parse("valkey://h:1", "a:b")
    with pytest.raises(ValueError, match="timeout"):
        SharedTierConfig.parse("valkey://h:1", timeout_ms=5)
    with pytest.raises(ValueError, match="needs TLS"):
        SharedTierConfig.parse("valkey://h:1", ca_file="/ca.pem")
