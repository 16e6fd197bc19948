"""`--device auto` is the default: CUDA when torch sees a device, else the CPU, with the reason
logged; an explicit `cuda` where there is none is a clear error, never a silent CPU run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdrive.runtime.cli import build_parser, main
from kvdrive.runtime.model.device import resolve_device


def test_every_command_defaults_to_auto() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).device == "auto"
    assert parser.parse_args(["generate", "--prompt", "x"]).device == "auto"
    assert parser.parse_args(["bench", "model"]).device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_auto_is_the_cpu_where_torch_sees_no_gpu_and_says_why() -> None:
    choice = resolve_device("auto")
    assert choice.device == "cpu"
    assert "no CUDA device" in choice.reason and torch.__version__ in choice.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_without_a_device_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    rc = main(["generate", "--device", "cuda", "--prompt", "hi", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "kvdrive: error: --device cuda: torch sees no CUDA device" in err


def test_malformed_devices_are_refused() -> None:
    for bad in ("gpu", "cuda:x", "mps0"):
        with pytest.raises(ValueError, match="expected one of auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    assert resolve_device("cpu").device == "cpu"


def test_the_kvikio_ssd_backend_is_refused_with_its_reason_where_it_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """KvikIO is asked for by name (the POSIX backend is the default); where it cannot run, that is an error
    with the reason, not a silent fall back."""
    from kvdrive.runtime.kvcache.store.tiers.kvikio_backend import kvikio_unusable_reason

    reason = kvikio_unusable_reason()
    if reason is None:
        pytest.skip("KvikIO can run here (tests/kvcache/test_gpu_tiers.py covers it)")
    rc = main(["generate", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-backend", "kvikio", "--prompt", "hi",
               "--max-tokens", "1"])
    assert rc == 2 and f"kvdrive: error: --ssd-backend kvikio: {reason}" in capsys.readouterr().err
    assert build_parser().parse_args(["serve"]).ssd_backend == "posix"


@pytest.mark.gpu
def test_auto_picks_cuda_on_a_gpu_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert resolve_device("auto").device == "cuda"
    assert resolve_device("cuda:0").device == "cuda:0"
