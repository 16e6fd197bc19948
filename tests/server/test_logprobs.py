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

from kvdrive.runtime.server.app import create_app
from kvdrive.runtime.server.state import ServerState

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


def _prompt_reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax at every prompt position: [T, V] (row t predicts token t + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.fixture()
async def chunked_client(tiny_model: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The tiny model served with 48-token steps: a prompt takes several prefill chunks."""
    from kvdrive.runtime.engine import SchedulerConfig
    from kvdrive.runtime.server.serve import ServeOptions, build_state

    state = build_state(ServeOptions(model=str(tiny_model), served_model_name="tiny", progress=False,
                                     scheduler=SchedulerConfig(max_waiting=8, step_token_budget=48)))
    state.engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t") as c:
            yield c
    finally:
        state.engine.shutdown()


async def test_echoed_prompt_logprobs_equal_the_reference_across_prefill_chunks_and_stored_prefixes(
        chunked_client: httpx.AsyncClient, tiny_state: ServerState, tiny_model: Path) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1) on a prompt of several
    prefill chunks: every prompt token after the first has the reference's log-probability; asked again, with
    the prompt's pages now stored, the values are the same (the prompt is computed again, not read)."""
    client, tok = chunked_client, tiny_state.tokenizer
    prompt = torch.randint(3, 200, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    body = {"model": "tiny", "prompt": [prompt], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "ignore_eos": True}
    ref = _prompt_reference(tiny_model, prompt)  # [200, V]
    first = None
    for attempt in range(2):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        choice = answer["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 201
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:200] == [tok.decode([t], skip_special_tokens=False) for t in prompt]
        got = torch.tensor(lp["token_logprobs"][1:200])
        want = ref[torch.arange(199), torch.tensor(prompt[1:])]
        assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
        best = ref[:-1].max(-1).values  # [199]: the top alternative of each position
        tops = torch.tensor([max(t.values()) for t in lp["top_logprobs"][1:200]])
        assert torch.allclose(tops, best, atol=1e-3)
        assert abs(lp["token_logprobs"][200] - float(ref[-1].max())) < 1e-3  # the sampled token: greedy
        assert choice["text"].startswith(tok.decode(prompt, skip_special_tokens=False))
        assert answer["usage"]["prompt_tokens"] == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if attempt == 0:
            first = lp
    assert first is not None and lp["token_logprobs"] == first["token_logprobs"]


async def test_a_batch_of_prompts_answers_n_choices_each_in_order_streamed_and_whole(client: httpx.AsyncClient,
                                                                                     tiny_state: ServerState) -> None:
    tok = tiny_state.tokenizer
    a, b = [5, 17, 33, 61, 90], [7, 8, 9]
    body = {"model": "tiny", "prompt": [a, b], "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 11,
            "ignore_eos": True, "echo": True, "logprobs": 2}
    whole = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["prompt_tokens"] == len(a) + len(b)
    assert whole["usage"]["completion_tokens"] == 4 * 3
    for c in whole["choices"]:
        prompt = a if c["index"] < 2 else b
        assert c["text"].startswith(tok.decode(prompt, skip_special_tokens=False))
        assert len(c["logprobs"]["tokens"]) == len(prompt) + 3 and c["logprobs"]["token_logprobs"][0] is None
    # sample 1 of a prompt echoes the same prompt log-probabilities as its sample 0
    assert whole["choices"][0]["logprobs"]["token_logprobs"][:5] == whole["choices"][1]["logprobs"]["token_logprobs"][:5]
    text = (await client.post("/v1/completions", json={**body, "stream": True})).text
    chunks = [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: {")]
    per: dict[int, list[dict[str, object]]] = {}
    for c in chunks:
        for ch in c["choices"]:
            per.setdefault(ch["index"], []).append(ch)
    assert sorted(per) == [0, 1, 2, 3]
    for i, parts in per.items():
        assert "".join(str(p["text"]) for p in parts) == whole["choices"][i]["text"]  # seeded: the same samples
        streamed = [v for p in parts if p["logprobs"] for v in p["logprobs"]["token_logprobs"]]  # type: ignore[index]
        want = whole["choices"][i]["logprobs"]["token_logprobs"]  # equal up to the batch's float order
        assert [v is None for v in streamed] == [v is None for v in want]
        assert all(abs(x - y) < 1e-4 for x, y in zip(streamed, want, strict=True) if x is not None)


async def test_an_end_of_sequence_answer_still_lists_its_token_last(client: httpx.AsyncClient,
                                                                   tiny_state: ServerState) -> None:
    """lm-eval reads an echo's entries [ctxlen:-1], counting on the sampled token being last: when the model
    ends at once (here forced by logit_bias), its end-of-sequence token is listed (its text is not answered),
    so the prompt's last token is never cut off; a chat answer's content leaves it out."""
    eos = tiny_state.tokenizer.eos_token_ids[0]
    prompt = [5, 17, 33, 61]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "logit_bias": {str(eos): 100}}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    assert choice["logprobs"]["tokens"][-1] == tiny_state.tokenizer.decode([eos], skip_special_tokens=False)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0,
            "logprobs": True, "logit_bias": {str(eos): 100}}
    answer = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
    assert answer["message"]["content"] == "" and answer["logprobs"]["content"] == []
