"""Evaluating through the OpenAI surface while the same session trains, from other threads at
the same time: the session trains exactly as it does with no eval beside it, and its inference
checkpoint answers the same logprobs throughout."""

from __future__ import annotations

import threading

import openai
from helpers import API_KEY, open_session, sft_sample
from together.post_training import SessionClient
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
LORA = {"rank": 4, "seed": 11}
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
STEPS = 6
EVALUATORS = 2
PROMPT = "<|im_start|>12+34=46"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


SAMPLES = [
    sft_sample(encode(f"<|im_start|>{a}+{b}={a + b}\n"), len(encode(f"<|im_start|>{a}+{b}=")))
    for a, b in ((12, 30), (45, 17), (71, 28))
]


def train(session: SessionClient, steps: int) -> list[float]:
    """`steps` cross-entropy steps, each published (weights-sync); the losses."""
    losses = []
    for _ in range(steps):
        result = session.trainer.forward_backward(samples=SAMPLES, loss=CE, interval=0.05)
        losses.append(result.loss)
        session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=0.05)
        session.trainer.weights_sync(interval=0.05)
    return losses


def echoed(base_url: str, model: str) -> list[float]:
    """The prompt's logprobs under `model` (echo, nothing drawn)."""
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    reply = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    return reply.choices[0].logprobs.token_logprobs[1:]


def test_evaluating_while_the_session_trains_changes_neither_its_losses_nor_its_checkpoint(
    shared_server,
):
    base_url = shared_server.base_url
    resources, session = open_session(base_url, lora_config=LORA)
    losses = train(session, 1)
    checkpoint = session.create_inference_checkpoint()
    fixed = echoed(base_url, checkpoint.id)
    done = threading.Event()
    at_checkpoint: list[list[float]] = []
    of_session: list[list[float]] = []
    errors: list[BaseException] = []

    def evaluate() -> None:
        try:
            while not done.is_set():  # the checkpoint, then the session's latest weights
                at_checkpoint.append(echoed(base_url, checkpoint.id))
                of_session.append(echoed(base_url, session.session_id))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    evaluators = [threading.Thread(target=evaluate) for _ in range(EVALUATORS)]
    for thread in evaluators:
        thread.start()
    try:
        losses += train(session, STEPS)
    finally:
        done.set()
        for thread in evaluators:
            thread.join()
    assert not errors, errors
    assert len(at_checkpoint) > EVALUATORS  # evaluations ran while it trained, not only after
    assert all(logprobs == fixed for logprobs in at_checkpoint)
    assert of_session[-1] != fixed  # the session's own weights moved on meanwhile

    alone = resources.create_session(interval=0.2, lora_config=LORA)
    expected = train(alone, 1)
    alone.create_inference_checkpoint()
    expected += train(alone, STEPS)
    assert losses == expected
    assert losses[-1] < losses[0]
    for each in (session, alone):
        each.stop()
    resources.stop()
