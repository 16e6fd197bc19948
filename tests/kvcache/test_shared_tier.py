"""The shared tier against a real 3-shard Valkey cluster the tests start and stop (``valkeykit``): pages one
replica publishes another fetches byte for byte; every bad value is a counted miss and is deleted; a dead or
hung shard costs a bounded wait and then nothing (its breaker), and is used again once it answers; namespaces
never meet; a working set twice the cluster's memory is evicted by the store without an error."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
import valkeykit

from kvdrive.runtime.kvcache import SharedTierConfig
from kvdrive.runtime.kvcache.store.shared import PageFormat, SharedTier, cache_identity
from kvdrive.runtime.kvcache.store.shared.breaker import COOLDOWN_S, FAILURES

LAYERS, BLOCK = 4, 16 << 10  # 64 KiB pages
FMT = PageFormat(cache_identity("test-model|bf16|16"), LAYERS, BLOCK)


def _pages(n: int, seed: int = 0) -> list[tuple[bytes, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (16,), generator=g, dtype=torch.uint8).numpy().tobytes(),
             torch.randint(0, 256, (LAYERS, BLOCK), generator=g, dtype=torch.uint8)) for _ in range(n)]


def _tier(url: str, namespace: str = "t", fmt: PageFormat = FMT, timeout_ms: int = 300) -> SharedTier:
    return SharedTier(SharedTierConfig.parse(url, namespace, timeout_ms=timeout_ms), fmt)


@pytest.fixture(scope="module")
def cluster() -> Iterator[valkeykit.ValkeyDeployment]:
    with valkeykit.start(3, "64mb") as dep:
        yield dep


def test_pages_published_by_one_replica_are_fetched_whole_by_another(cluster: valkeykit.ValkeyDeployment) -> None:
    a, b = _tier(cluster.url, "cross"), _tier(cluster.url, "cross")
    pages = _pages(60)
    assert a.shards.mode == "cluster" and len(a.shards.shards) == 3
    assert a.publish(pages) == 60
    got = b.fetch([d for d, _ in pages])
    assert all(g is not None and torch.equal(g, blk) for g, (_, blk) in zip(got, pages, strict=True))
    per_shard = [sum(1 for k in n.client().scan_iter(match="kvd:cross:*")) for n in cluster.nodes]
    assert sum(per_shard) == 60 and min(per_shard) > 0  # no hash tag: the pages spread over the shards
    c = b.counters()
    assert (c.hits, c.misses, c.read_bytes) == (60, 0, 60 * FMT.value_bytes)
    assert a.counters().written_bytes == 60 * FMT.value_bytes and a.counters().published == 60
    assert a.unpublished([d for d, _ in pages]) == []  # remembered: not written again
    a.close()
    b.close()


def test_every_kind_of_bad_value_is_a_counted_miss_and_is_deleted(cluster: valkeykit.ValkeyDeployment) -> None:
    tier = _tier(cluster.url, "bad")
    pages = _pages(6, seed=1)
    tier.publish(pages)
    rc = valkeykit.cluster_client(cluster)
    key = [tier.key(d) for d, _ in pages]
    flipped = bytearray(rc.get(key[0]))
    flipped[len(flipped) // 2] ^= 0x01
    rc.set(key[0], bytes(flipped))
    rc.set(key[1], rc.get(key[1])[:-100])  # truncated
    rc.set(key[2], rc.get(key[3]))  # another page's value under this key
    other = PageFormat(cache_identity("another-model|fp32|16"), LAYERS, BLOCK)
    rc.set(key[4], other.encode(pages[4][0], pages[4][1]))  # written by another model / dtype
    got = tier.fetch([d for d, _ in pages])
    assert [g is None for g in got] == [True, True, True, False, True, False]
    assert torch.equal(got[3], pages[3][1]) and torch.equal(got[5], pages[5][1])  # type: ignore[arg-type]
    failures = tier.counters().verify_failures
    assert (failures["checksum"], failures["truncated"], failures["digest"], failures["identity"]) == (1, 1, 1, 1)
    assert all(rc.get(k) is None for k in key[:3] + key[4:5])  # deleted: never served again
    assert tier.unpublished([d for d, _ in pages[:3]]) == [d for d, _ in pages[:3]]  # ... and published again
    assert tier.publish(pages[:3]) == 3
    assert all(g is not None for g in tier.fetch([d for d, _ in pages[:3]]))
    tier.close()


def test_namespaces_never_meet(cluster: valkeykit.ValkeyDeployment) -> None:
    a, b = _tier(cluster.url, "fleet-a"), _tier(cluster.url, "fleet-b")
    pages = _pages(5, seed=2)
    a.publish(pages)
    assert b.fetch([d for d, _ in pages]) == [None] * 5 and b.counters().misses == 5
    a.close()
    b.close()


def test_a_dead_shard_costs_one_timeout_then_nothing_and_is_used_again_when_back(
        cluster: valkeykit.ValkeyDeployment) -> None:
    tier = _tier(cluster.url, "dead", timeout_ms=300)
    pages = _pages(90, seed=3)
    assert tier.publish(pages) == 90
    victim = cluster.nodes[1]
    on_victim = {tier.key(d) for d, _ in pages} & set(victim.client().scan_iter(match="kvd:dead:*"))
    victim.kill()
    try:
        for _ in range(FAILURES + 2):
            t0 = time.monotonic()
            got = tier.fetch([d for d, _ in pages])
            assert time.monotonic() - t0 < 1.0
            hit = {tier.key(d) for (d, _), g in zip(pages, got, strict=True) if g is not None}
            assert hit == {tier.key(d) for d, _ in pages} - on_victim  # only the dead shard's pages miss
        c = tier.counters()
        assert c.errors.get("refused", 0) > 0 and c.failing_shards == 1  # its breaker answers for it now
        assert "1 shard(s) failing" in (tier.degraded() or "")
    finally:
        victim.start()  # an empty shard on the same port (its slots kept in nodes.conf)
    time.sleep(COOLDOWN_S * 2.5)
    tier.probe()
    assert tier.degraded() is None
    got = tier.fetch([d for d, _ in pages])
    assert sum(g is not None for g in got) == 90 - len(on_victim)  # its pages were lost with it: misses
    tier.close()


def test_a_hung_shard_is_a_timeout_not_a_stall(cluster: valkeykit.ValkeyDeployment) -> None:
    tier = _tier(cluster.url, "hung", timeout_ms=200)
    pages = _pages(30, seed=4)
    tier.publish(pages)
    proc = cluster.nodes[2].proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = tier.fetch([d for d, _ in pages])
        took = time.monotonic() - t0
        assert took < 1.0 and 0 < sum(g is None for g in got) < 30
        assert tier.counters().errors.get("timeout", 0) > 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    tier.close()


def test_a_working_set_twice_the_clusters_memory_is_evicted_without_errors() -> None:
    with valkeykit.start(3, "4mb") as small:
        tier = _tier(small.url, "cap")
        pages = _pages(3 * 2 * (4 << 20) // FMT.value_bytes, seed=5)  # twice the three shards' maxmemory
        for i in range(0, len(pages), 16):
            assert tier.publish(pages[i : i + 16]) == len(pages[i : i + 16])
        got = tier.fetch([d for d, _ in pages])
        c = tier.counters()
        assert c.errors == {} and sum(c.verify_failures.values()) == 0
        assert 0 < c.hits < len(pages) and c.hits + c.misses == len(pages)
        assert all(g is None or torch.equal(g, blk) for g, (_, blk) in zip(got, pages, strict=True))
        assert small.used_memory() <= 3 * (4 << 20) * 1.1
        tier.close()


def test_a_single_node_without_cluster_mode() -> None:
    with valkeykit.start(1, "64mb") as one:
        tier = _tier(one.url, "single")
        pages = _pages(8, seed=6)
        assert tier.shards.mode == "single" and tier.publish(pages) == 8
        assert all(g is not None for g in tier.fetch([d for d, _ in pages]))
        tier.close()


def test_no_endpoint_answering_is_degraded_not_an_error() -> None:
    tier = _tier(f"valkey://127.0.0.1:{valkeykit.free_port()}", "none")
    assert tier.shards.mode == "unknown" and "no endpoint" in (tier.degraded() or "")
    assert tier.fetch([b"x" * 16]) == [None] and tier.publish(_pages(1)) == 0
    tier.close()


def test_published_and_found_pages_are_announced_and_their_loss_too(cluster: valkeykit.ValkeyDeployment) -> None:
    from kvdrive.runtime.kvcache import PageEvents

    a, b = _tier(cluster.url, "events"), _tier(cluster.url, "events")
    ea, eb = PageEvents(), PageEvents()
    a.watch(ea)
    b.watch(eb)
    pages = _pages(4, seed=7)
    a.publish(pages)
    assert {(c.digest, c.tier, c.stored) for c in ea.take(0.1)} == {(d, "shared", True) for d, _ in pages}
    b.fetch([d for d, _ in pages])  # found by another replica: announced by it too
    assert {(c.digest, c.stored) for c in eb.take(0.1)} == {(d, True) for d, _ in pages}
    valkeykit.cluster_client(cluster).delete(a.key(pages[0][0]))  # evicted by the store
    assert b.fetch([pages[0][0]]) == [None]
    assert [(c.digest, c.tier, c.stored) for c in eb.take(0.1)] == [(pages[0][0], "shared", False)]
    assert a.unpublished([pages[0][0]]) == []  # A has not looked: it still remembers publishing it
    a.close()
    b.close()


def test_a_password_from_the_auth_file_is_used_and_a_wrong_one_degrades(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvdrive.runtime.protocol.secret_files import read_secret

    (tmp_path / "auth").write_text("s3cret-pass\n")
    (tmp_path / "auth").chmod(0o600)
    with valkeykit.start(1, "64mb", password="s3cret-pass") as guarded:
        cfg = SharedTierConfig.parse(guarded.url, "auth", password=read_secret(tmp_path / "auth"))
        tier = SharedTier(cfg, FMT)
        pages = _pages(3, seed=8)
        assert tier.publish(pages) == 3 and all(g is not None for g in tier.fetch([d for d, _ in pages]))
        tier.close()
        wrong = SharedTier(SharedTierConfig.parse(guarded.url, "auth", password="nope"), FMT)
        assert wrong.fetch([d for d, _ in pages]) == [None] * 3  # refused by the server: misses, not errors raised
        assert wrong.degraded() is not None
        wrong.close()


def test_tls_is_used_when_asked_and_the_server_is_verified_against_the_ca_file() -> None:
    with valkeykit.start(1, "64mb") as one:
        front = valkeykit.TlsFront(one.nodes[0], one.root)
        try:
            url = f"valkeys://127.0.0.1:{front.port}"
            tier = SharedTier(SharedTierConfig.parse(url, "tls", ca_file=str(front.cert)), FMT)
            pages = _pages(3, seed=9)
            assert tier.publish(pages) == 3 and all(g is not None for g in tier.fetch([d for d, _ in pages]))
            tier.close()
            unverified = SharedTier(SharedTierConfig.parse(url, "tls"), FMT)  # the system CAs do not know it
            assert unverified.fetch([d for d, _ in pages]) == [None] * 3 and unverified.degraded() is not None
            unverified.close()
        finally:
            front.close()
