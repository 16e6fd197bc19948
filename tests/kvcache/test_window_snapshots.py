"""Window snapshots on disk: written whole or not at all, read back only when they check out, dropped
oldest-first past their byte budget, found again after a restart."""

from __future__ import annotations

from pathlib import Path

import torch

from kvdrive.runtime.kvcache.mover import Mover
from kvdrive.runtime.kvcache.placement import TierEviction
from kvdrive.runtime.kvcache.store.tiers.window_files import HEADER, WindowFiles
from kvdrive.runtime.kvcache.windows.snapshots import WindowSnapshots


def _window(seed: int) -> torch.Tensor:
    return torch.randn((3, 8, 2, 1, 16), generator=torch.Generator().manual_seed(seed))  # [layers, n, 2, Hkv, D]


def _snapshots(folder: Path, max_bytes: int) -> WindowSnapshots:
    """Snapshots in ``folder`` under ``max_bytes``, their bytes moved by the Mover (its window I/O needs no store),
    dropped as placement chooses."""
    return WindowSnapshots(WindowFiles(folder), Mover, TierEviction.window_victims, max_bytes)


def test_snapshots_round_trip_survive_a_restart_and_drop_the_oldest_past_their_budget(tmp_path: Path) -> None:
    one = HEADER.size + _window(0).numel() * 4
    snaps = _snapshots(tmp_path, 2 * one)
    snaps.save(b"a" * 16, _window(1))
    snaps.save(b"b" * 16, _window(2))
    assert torch.equal(snaps.load(b"a" * 16, torch.empty(3, 8, 2, 1, 16)), _window(1))  # a is now the newest
    snaps.save(b"c" * 16, _window(3))  # over budget: the least recently used (b) goes
    assert (snaps.has(b"a" * 16), snaps.has(b"b" * 16), snaps.has(b"c" * 16)) == (True, False, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([(b"a" * 16).hex() + ".win", (b"c" * 16).hex() + ".win"])

    (tmp_path / "dead.tmp").write_bytes(b"half a write")  # a crash during a write leaves only a temporary file
    again = _snapshots(tmp_path, 2 * one)
    assert not (tmp_path / "dead.tmp").exists()
    assert again.has(b"a" * 16) and again.has(b"c" * 16) and again.nbytes == 2 * one
    assert torch.equal(again.load(b"c" * 16, torch.empty(3, 8, 2, 1, 16)), _window(3))
    # a snapshot of another shape (another model's layout under the same name cannot happen, but a truncated
    # file can) fails its checks and is deleted
    (tmp_path / ((b"c" * 16).hex() + ".win")).write_bytes(b"\0" * 10)
    assert again.load(b"c" * 16, torch.empty(3, 8, 2, 1, 16)) is None
    assert not again.has(b"c" * 16) and again.failed == 1
