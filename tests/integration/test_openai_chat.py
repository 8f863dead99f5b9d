"""POST /v1/chat/completions through the `openai` SDK: messages through the model's chat
template (the built-in models' own `<|im_start|>` format), logprobs, n with seeds, usage, and
a model without a template refused."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL
from test_openai_completions import latest_sample
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.statuses import OperationStatus

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
NO_TEMPLATE = "my-org/tiny-without-template"
# The built-in model with a template of bare contents: on "reverse reverse reverse" it runs on
# for hundreds of tokens (in its own ChatML turn it answers in one or two).
PLAIN = "my-org/tiny-plain-chat"
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MESSAGES = [
    {"role": "system", "content": "add"},
    {"role": "user", "content": "12+34="},
]
RENDERED = "<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
RENDERED += "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openai-chat")
    directory = root / "models" / "tiny"
    shutil.copytree(BUILTIN_MODEL_DIR, directory)  # its tokenizer carries no chat template
    plain = root / "models" / "plain"
    shutil.copytree(BUILTIN_MODEL_DIR, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_TEMPLATE
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    proc = ServerProcess.started(
        root, "--model", f"{NO_TEMPLATE}={directory}", "--model", f"{PLAIN}={plain}"
    )
    yield proc
    proc.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_chat_equals_a_completion_of_the_prompt_its_template_renders(server):
    oai = client(server)
    chat = oai.chat.completions.create(
        model=BASE_MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    plain = oai.completions.create(
        model=BASE_MODEL, prompt=RENDERED, max_tokens=6, temperature=0, logprobs=3
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(TOKENIZER.encode(RENDERED, add_special_tokens=False))
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    entries = choice.logprobs.content
    assert [e.logprob for e in entries] == plain.choices[0].logprobs.token_logprobs
    for entry in entries:
        ranked = [t.logprob for t in entry.top_logprobs]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True)
        assert entry.logprob == ranked[0]  # greedy: the drawn token is the most likely


def test_n_chat_samples_repeat_with_a_seed(server):
    oai = client(server)
    replies = [
        oai.chat.completions.create(
            model=BASE_MODEL, messages=MESSAGES, n=3, max_tokens=5, temperature=1.0, seed=4
        )
        for _ in range(2)
    ]
    texts = [[c.message.content for c in r.choices] for r in replies]
    assert texts[0] == texts[1]
    assert [c.index for c in replies[0].choices] == [0, 1, 2]
    assert replies[0].choices[0].logprobs is None


def test_a_model_without_a_chat_template_is_a_400_saying_so(server):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model=NO_TEMPLATE, messages=MESSAGES, max_tokens=2)
    assert "chat template" in info.value.body["message"]
    assert info.value.body["param"] == "messages"
    # Its completions are served: only the chat format is unknown.
    reply = client(server).completions.create(model=NO_TEMPLATE, prompt="1+1=", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_unserved_chat_fields_are_400_naming_them(server):
    for extra, field in (
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"extra_body": {"tools": [{"type": "function"}]}}, "tools"),
    ):
        kwargs = {"extra_body": extra["extra_body"]} if "extra_body" in extra else extra
        with pytest.raises(openai.BadRequestError) as info:
            client(server).chat.completions.create(
                model=BASE_MODEL, messages=MESSAGES, max_tokens=2, **kwargs
            )
        assert info.value.body["param"] == field


def test_a_streamed_chat_carries_the_message_of_a_whole_one(server):
    oai = client(server)
    args = {"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    whole = oai.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    chunks = list(oai.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in whole.choices[0].logprobs.content]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_streamed_chat_shows_its_message_while_its_operation_runs(server):
    """Content deltas of n = 2 choices come while the operation is still RUNNING, and
    concatenate per choice to the message of the same request answered whole."""
    oai = client(server)
    messages = [{"role": "user", "content": "reverse reverse reverse"}]
    args = {"model": PLAIN, "messages": messages, "max_tokens": 300, "n": 2}
    args |= {"temperature": 1.0, "seed": 11}
    whole = oai.chat.completions.create(**args)
    assert whole.usage.completion_tokens > 200  # long enough to stream in many blocks
    whole_op, _ = latest_sample(server)
    contents: dict[int, list[str]] = {0: [], 1: []}
    statuses = []
    for chunk in oai.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                contents[choice.index].append(choice.delta.content)
                op_id, status = latest_sample(server)
                assert op_id != whole_op
                statuses.append(status)
    assert statuses[:2] == [OperationStatus.RUNNING] * 2, statuses[:3]
    for index in (0, 1):
        assert "".join(contents[index]) == whole.choices[index].message.content
