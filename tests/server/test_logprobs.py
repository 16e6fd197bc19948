"""Log-probabilities over HTTP, in-process on the tiny model, checked against Hugging Face transformers in
float32 on the same weights: for greedy answers to 10 prompts (16 tokens each), every reported token's
log-probability and its top alternatives equal the reference's within 1e-3; the chat and completions shapes
and the streamed chunks carry the same values."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch

from kvdrive.runtime.server.app import ServerState, create_app

TOKENS = 16
TOP = 5


@pytest.fixture()
async def client(tiny_state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tiny_state)), base_url="http://t") as c:
        yield c


def _reference(model_dir: Path, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' float32 greedy answer of ``n`` tokens, and the log_softmax of its logits at each answer
    position: [n, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    answer = out.sequences[0, len(prompt) :].tolist()
    return answer, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)


async def test_completion_logprobs_equal_a_transformers_fp32_reference(client: httpx.AsyncClient,
                                                                      tiny_state: ServerState,
                                                                      tiny_model: Path) -> None:
    tok = tiny_state.tokenizer
    for seed in range(10):
        prompt = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": TOP})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == TOKENS
        ids, ref = _reference(tiny_model, prompt, TOKENS)  # ref [16, V]
        assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]  # the same answer
        got = torch.tensor(lp["token_logprobs"])
        assert torch.allclose(got, ref[torch.arange(TOKENS), torch.tensor(ids)], atol=1e-3), (got, ref.max(-1))
        for pos, top in enumerate(lp["top_logprobs"]):
            want: dict[str, float] = {}  # keyed by text, the likelier of two same-text tokens first
            best = torch.topk(ref[pos], TOP)
            for i, v in zip(best.indices, best.values, strict=True):
                want.setdefault(tok.decode([int(i)], skip_special_tokens=False), float(v))
            assert top.keys() == want.keys()
            assert all(abs(top[k] - want[k]) < 1e-3 for k in want), (top, want)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(TOKENS)]


async def test_chat_logprobs_streamed_and_whole_agree(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]["content"]
    assert len(whole) == 6 and all(len(t["top_logprobs"]) == 3 for t in whole)
    assert all(t["logprob"] <= 0 and t["bytes"] == list(t["token"].encode()) for t in whole)
    assert all(t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][-1]["logprob"] for t in whole)
    assert all(abs(t["logprob"] - t["top_logprobs"][0]["logprob"]) < 1e-6 for t in whole)  # greedy: the best
    text = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
    chunks = [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: {")]
    streamed = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["content"]]
    assert streamed == whole
    plain = (await client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 0})).json()
    assert plain["choices"][0]["logprobs"] is None
