"""GGUF loading: every supported quantization, llama.cpp's q/k row order, clear errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_builder import load_into, write_gguf

from kvdrive.runtime.engine import EngineConfig, ModelRunner, TierConfig
from kvdrive.runtime.model import ModelLoadError, load_model

KVDRIVE = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvdrive")


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    loaded = load_model(str(path), progress=False)
    gen = ModelRunner(loaded, EngineConfig(page_size=4, tiers=TierConfig()))
    return gen.prefill(gen.new_sequence(), ids, all_logits=True)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("tie", [False, True])
def test_quantized_gguf_matches_reference(qtype: str, tie: bool, hf_model_factory, tmp_path: Path) -> None:
    """The loaded model computes what transformers computes with the weights the file really holds."""
    _, ref = hf_model_factory(arch="llama", tie=tie)
    held = write_gguf(tmp_path / "tiny.gguf", ref, qtype=qtype)
    load_into(ref, held)  # the reference gets the same (quantization-rounded) weights
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(tmp_path / "tiny.gguf", ids), expected, atol=3e-4, rtol=1e-3)


def test_gguf_metadata_tokenizer_and_template(hf_model_factory, tmp_path: Path) -> None:
    _, ref = hf_model_factory(arch="llama")
    write_gguf(tmp_path / "tiny.gguf", ref)
    loaded = load_model(str(tmp_path / "tiny.gguf"), progress=False)
    cfg = loaded.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert loaded.model_id == "tiny"
    tok = loaded.tokenizer
    assert tok.decode(tok.encode("naïve café 42")) == "naïve café 42"
    assert tok.eos_token_ids == (257,)
    from kvdrive.runtime.prompt import ChatMessage

    assert tok.encode_chat([ChatMessage("user", "ab")]) == [256, *tok.encode("ab")]


def test_unsupported_quantization_is_a_clear_error(hf_model_factory, tmp_path: Path) -> None:
    _, ref = hf_model_factory(arch="llama")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    shape = (96, 64)  # ffn_up of the tiny model: [intermediate, hidden]
    raw = np.random.default_rng(0).integers(0, 255, shape[0] * shape[1] // block * size, dtype=np.uint8)
    write_gguf(tmp_path / "iq.gguf", ref, tensor_override={"blk.0.ffn_up.weight": (raw.tobytes(), "IQ4_NL", shape)})
    with pytest.raises(ModelLoadError, match="unsupported quantization IQ4_NL"):
        load_model(str(tmp_path / "iq.gguf"), progress=False)


def test_unsupported_architecture_is_a_clear_error(hf_model_factory, tmp_path: Path) -> None:
    _, ref = hf_model_factory(arch="llama")
    write_gguf(tmp_path / "gpt2.gguf", ref, arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path / "gpt2.gguf"), progress=False)


def test_truncated_file_is_a_clear_error(hf_model_factory, tmp_path: Path) -> None:
    _, ref = hf_model_factory(arch="llama")
    write_gguf(tmp_path / "ok.gguf", ref)
    data = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "cut.gguf"), progress=False)


@pytest.mark.parametrize(
    "model, message",
    [
        ("/does/not/exist.gguf", "model not found: /does/not/exist.gguf"),
        ("{tmp}/empty_dir", "without config.json"),
        ("{tmp}/weights.bin", "expected a .gguf file"),
    ],
)
def test_cli_reports_bad_models_in_one_line(model: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    proc = subprocess.run(
        [KVDRIVE, "generate", "--model", model.format(tmp=tmp_path), "--prompt", "hi"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("kvdrive: error:") and message in proc.stderr
