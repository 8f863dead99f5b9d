"""The OpenAI-compatible completions and models routes through the official `openai` SDK:
logprobs against a forward pass, echo against forward_only, seeds, stops, auth and errors."""

from __future__ import annotations

import re
import sqlite3
from contextlib import closing

import httpx
import openai
import pytest
import torch
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, open_session, sft_sample
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.statuses import OperationStatus

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
PROMPT = "<|im_start|>7+8="
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def client(base_url: str, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + prefix, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def base_logprobs():
    """logprob(token i | tokens before i) under the base model, by a float32 forward pass."""
    model = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    model.eval()

    def logprobs(tokens: list[int]) -> list[float]:
        with torch.no_grad():
            logits_TV = model(torch.tensor([tokens])).logits[0].float()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        return [float(logprobs_TV[i - 1, tokens[i]]) for i in range(1, len(tokens))]

    return logprobs


def test_models_lists_the_served_base_model_under_both_prefixes(shared_server):
    for prefix in ("/v1", "/oai/api/v1"):
        ids = [m.id for m in client(shared_server.base_url, prefix).models.list()]
        assert BASE_MODEL in ids


def test_completion_logprobs_equal_a_forward_pass(shared_server, base_logprobs):
    prompt = encode(PROMPT)
    reply = client(shared_server.base_url).completions.create(
        model=BASE_MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=3
    )
    choice = reply.choices[0]
    sampled = encode(choice.text)
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens).startswith(choice.text)
    assert logprobs.text_offset[0] == 0
    tokens = prompt + [TOKENIZER.convert_tokens_to_ids(t) for t in logprobs.tokens]
    forward = base_logprobs(tokens)[len(prompt) - 1 :]
    assert max(abs(a - b) for a, b in zip(forward, logprobs.token_logprobs, strict=True)) <= 1e-5
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == logprob
        assert 3 <= len(top) <= 4  # the top 3 and the sampled token
    assert sampled == tokens[len(prompt) : len(prompt) + len(sampled)]
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(logprobs.tokens)


def test_echo_prompt_logprobs_equal_forward_only_of_a_together_session(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 5})
    # One step so the session's weights differ from the base model's.
    tokens = encode("<|im_start|>1+2=3<|im_end|>")
    session.trainer.forward_backward(samples=[sft_sample(tokens, 1)], loss=CE, interval=0.05)
    session.trainer.optim_step(adam_params={"learning_rate": 5e-2}, interval=0.05)
    session.trainer.weights_sync(interval=0.05)
    prompt = encode("<|im_start|>12+34=46")
    reply = client(shared_server.base_url, "/oai/api/v1").completions.create(
        model=session.session_id, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == "12+34=46" or reply.choices[0].text.endswith("12+34=46")
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = (
        session.trainer.forward(samples=[sft_sample(prompt, 1)], loss=CE, interval=0.05)
        .loss_fn_outputs[0]
        .tensors["logprobs"]
        .data
    )
    diffs = [abs(a - b) for a, b in zip(scored, logprobs.token_logprobs[1:], strict=True)]
    assert max(diffs) <= 1e-5
    session.stop()
    resources.stop()


def test_n_samples_with_a_seed_repeat_and_prompts_keep_their_order(shared_server):
    oai = client(shared_server.base_url)
    prompts = [encode("<|im_start|>3+4="), encode("<|im_start|>5+6=")]
    first, again = (
        oai.completions.create(
            model=BASE_MODEL, prompt=prompts, n=3, max_tokens=6, temperature=1.0, seed=7
        )
        for _ in range(2)
    )
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices[:3]}) > 1  # n samples differ from each other


def test_a_stop_string_is_cut_from_the_text(shared_server):
    oai = client(shared_server.base_url)
    prompt = "reverse reverse reverse"  # greedy runs long without EOS on the built-in model
    free = oai.completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=12, temperature=0)
    stop = free.choices[0].text[3:5]
    assert len(stop) == 2 and free.choices[0].finish_reason == "length"
    cut = oai.completions.create(
        model=BASE_MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_unsupported_and_unknown_fields_are_400_naming_them(shared_server):
    oai = client(shared_server.base_url)
    for extra, field in (
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"best_of": 3}, "best_of"),
        ({"extra_body": {"mystery": 1}}, "mystery"),
    ):
        kwargs = {"extra_body": extra["extra_body"]} if "extra_body" in extra else extra
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=BASE_MODEL, prompt="1+1=", max_tokens=2, **kwargs)
        assert info.value.body["param"] == field
        assert field in info.value.body["message"]
    for kwargs, field in (
        ({"prompt": "1+1=", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "1+1=", "max_tokens": 100_000}, "max_tokens"),  # past the context
        ({"prompt": [1, 2, 10_000], "max_tokens": 2}, "prompt"),  # not in the vocabulary
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=BASE_MODEL, **kwargs)
        assert info.value.body["param"] == field, info.value.body
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-model", prompt="1+1=", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_no_key_is_401_in_openai_error_shape(shared_server):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
        reply = httpx.request(
            method, shared_server.base_url + path, json={"model": BASE_MODEL, "prompt": "1"}
        )
        assert reply.status_code == 401
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error"


def test_a_streamed_completion_carries_the_text_of_a_whole_one(shared_server):
    oai = client(shared_server.base_url)
    args = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2}
    whole = oai.completions.create(**args)
    chunks = list(
        oai.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    for index in (0, 1):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(texts) == whole.choices[index].text
        finishes = [
            c.choices[0].finish_reason
            for c in chunks
            if c.choices and c.choices[0].index == index and c.choices[0].finish_reason
        ]
        assert finishes == [whole.choices[index].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = httpx.post(
        f"{shared_server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={**args, "stream": True},
        timeout=60,
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def latest_sample(server: ServerProcess) -> tuple[str, str]:
    """(id, status) of the sample operation submitted last, read from the server's store."""
    path = server.data_dir / "posttrain.sqlite3"
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        query = "SELECT id, status FROM operations WHERE kind = 'sample' ORDER BY seq DESC"
        return db.execute(query).fetchone()


def test_a_streamed_completion_shows_its_text_while_its_operation_runs(shared_server):
    """Text deltas come after decode blocks, while the operation is still RUNNING, and
    concatenate to the text of the same request answered whole."""
    oai = client(shared_server.base_url)
    args = {"model": BASE_MODEL, "prompt": "reverse reverse reverse", "max_tokens": 300}
    args |= {"temperature": 1.0, "seed": 11}
    whole = oai.completions.create(**args)
    assert whole.usage.completion_tokens > 100  # long enough to stream in many blocks
    whole_op, _ = latest_sample(shared_server)
    texts, statuses = [], []
    for chunk in oai.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].text:
            texts.append(chunk.choices[0].text)
            op_id, status = latest_sample(shared_server)
            assert op_id != whole_op
            statuses.append(status)
    assert statuses[:2] == [OperationStatus.RUNNING] * 2, statuses[:3]
    assert len(texts) > 10
    assert "".join(texts) == whole.choices[0].text
    stop = whole.choices[0].text[60:63]  # nothing past a stop string is ever sent
    cut = oai.completions.create(**args, stop=[stop]).choices[0]
    streamed = oai.completions.create(**args, stop=[stop], stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == cut.text and stop not in cut.text
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]


def test_an_inference_checkpoint_keeps_its_logprobs_while_its_session_trains_on(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 6})
    tokens = encode("<|im_start|>1+2=3<|im_end|>")
    prompt = encode("<|im_start|>12+34=46")

    def train_and_sync() -> None:
        session.trainer.forward_backward(samples=[sft_sample(tokens, 1)], loss=CE, interval=0.05)
        session.trainer.optim_step(adam_params={"learning_rate": 5e-2}, interval=0.05)
        session.trainer.weights_sync(interval=0.05)

    def echoed(model: str) -> list[float]:
        reply = client(shared_server.base_url).completions.create(
            model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0
        )
        return reply.choices[0].logprobs.token_logprobs[1:]

    def forward_only() -> list[float]:
        scored = session.trainer.forward(samples=[sft_sample(prompt, 1)], loss=CE, interval=0.05)
        return scored.loss_fn_outputs[0].tensors["logprobs"].data

    train_and_sync()
    checkpoint = session.create_inference_checkpoint()
    at_checkpoint = forward_only()
    assert echoed(checkpoint.id) == pytest.approx(at_checkpoint, abs=1e-5)
    assert checkpoint.id in [m.id for m in client(shared_server.base_url).models.list()]
    train_and_sync()
    assert echoed(session.session_id) == pytest.approx(forward_only(), abs=1e-5)
    assert echoed(session.session_id) != pytest.approx(at_checkpoint, abs=1e-3)
    assert echoed(checkpoint.id) == pytest.approx(at_checkpoint, abs=1e-5)
    session.stop()
    resources.stop()


def finished_samples(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    pattern = r'^posttrain_operations_finished_total\{kind="sample",status="completed"\} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def test_each_request_is_sample_operations_of_the_scheduler_counted_in_metrics(shared_server):
    oai = client(shared_server.base_url)
    before = finished_samples(shared_server.base_url)
    oai.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3)
    assert finished_samples(shared_server.base_url) == before + 1
    # top-k logprobs: the draw, then a scoring operation over prompt + completion
    oai.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3, logprobs=2)
    assert finished_samples(shared_server.base_url) == before + 3


def test_an_lm_eval_loglikelihood_request_is_one_operation_with_the_scored_logprobs(
    shared_server,
):
    """echo, max_tokens 1, logprobs 1, temperature 0 (lm-eval's loglikelihood request): the
    draw scores its own prompt, and its token, the argmax, is its own top-1. The logprobs and
    top-1s equal those of the two-operation path (logprobs 2 asks for a scoring operation)."""
    oai = client(shared_server.base_url)
    prompt = encode("<|im_start|>12+34=46")
    args = {"model": BASE_MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "temperature": 0}
    before = finished_samples(shared_server.base_url)
    one = oai.completions.create(**args, logprobs=1).choices[0].logprobs
    assert finished_samples(shared_server.base_url) == before + 1
    two = oai.completions.create(**args, logprobs=2).choices[0].logprobs
    assert finished_samples(shared_server.base_url) == before + 3
    assert one.tokens == two.tokens and len(one.tokens) == len(prompt) + 1
    assert one.token_logprobs[0] is None and one.top_logprobs[0] is None
    assert one.token_logprobs[1:] == pytest.approx(two.token_logprobs[1:], abs=1e-5)
    for top_one, top_two in zip(one.top_logprobs[1:], two.top_logprobs[1:], strict=True):
        assert max(top_one.values()) == pytest.approx(max(top_two.values()), abs=1e-5)
    assert one.top_logprobs[-1] == {one.tokens[-1]: one.token_logprobs[-1]}
