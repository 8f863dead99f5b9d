"""The generator through the official SDK: logprobs against forward passes, seeds, stop strings,
the prefix cache, and the three weights-sync modes with their policy versions."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, open_session, sft_sample
from together import BadRequestError
from together.post_training import ModelResourcesClient
from transformers import AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR

TOKENIZER = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05  # poll interval (s) of the SDK's waits
# Greedy from this prompt runs hundreds of tokens without EOS on the built-in model.
LONG_PROMPT = "reverse reverse reverse"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def completion_logprobs(session, prompt: list[int], tokens: list[int]) -> list[float]:
    """forward_only logprobs of `tokens` after `prompt` under the trainer's weights."""
    scored = session.trainer.forward(
        samples=[sft_sample(prompt + tokens, len(prompt))], loss=CE, interval=FAST
    )
    return scored.loss_fn_outputs[0].tensors["logprobs"].data[len(prompt) - 1 :]


def train_one_step(session, tokens: list[int]) -> None:
    session.trainer.forward_backward(samples=[sft_sample(tokens, 1)], loss=CE, interval=FAST)
    session.trainer.optim_step(
        adam_params={"learning_rate": 5e-2, "weight_decay": 0.0}, interval=FAST
    )


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory):
    """These tests watch a sample while it runs (weights-sync modes land between or inside
    generations), so their server answers operation GETs at once instead of holding them."""
    directory = tmp_path_factory.mktemp("sampling")
    proc = ServerProcess.started(directory, "--poll-hold-seconds", "0")
    yield proc
    proc.stop()


def start_long_greedy_sample(base_url: str, session_id: str, prompt: list[int]):
    """Submit a long greedy sample and return once it is running on the worker."""
    ops = low_level(base_url).post_training.operations
    op = ops.sample(
        session_id,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[model_input(prompt)],
        num_samples=2,
        sampling_params={"max_tokens": 300, "temperature": 0},
    )
    while ops.retrieve_sample(op.id, session_id=session_id).status == (
        "TRAINING_OPERATION_STATUS_PENDING"
    ):
        time.sleep(0.01)
    return op


def wait_for_sample(base_url: str, session_id: str, op_id: str):
    ops = low_level(base_url).post_training.operations
    while (op := ops.retrieve_sample(op_id, session_id=session_id)).status in (
        "TRAINING_OPERATION_STATUS_PENDING",
        "TRAINING_OPERATION_STATUS_RUNNING",
    ):
        time.sleep(0.02)
    assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
    return op.output.results[0]


def policy(session) -> tuple[int, int, int, bool]:
    state = session.retrieve().policy_state
    return (
        state.trainer_step,
        state.target_weights_version,
        state.applied_weights_version,
        state.pending_publish,
    )


# ---------------------------------------------------------------- outputs


def test_sampler_logprobs_equal_forward_only_logprobs_for_any_sampling_settings(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 11})
    prompt = encode("<|im_start|>7+8=")
    for params in (
        {"max_tokens": 10, "temperature": 1.0, "seed": 1},
        {"max_tokens": 10, "temperature": 0.6, "top_k": 8, "top_p": 0.9, "seed": 2},
        {"max_tokens": 10, "temperature": 0},
    ):
        result = session.generator.sample(
            model_input(prompt), num_samples=3, sampling_params=params, interval=FAST
        )
        for sequence in result.sequences:
            assert len(sequence.tokens) == len(sequence.logprobs) >= 1
            forward = completion_logprobs(session, prompt, sequence.tokens)
            diffs = [abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)]
            assert max(diffs) <= 1e-4, (params, diffs)
    session.stop()
    resources.stop()


def test_prompt_logprobs_and_sorted_topk_alternatives_match_a_forward_pass(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 12})
    prompt = encode("<|im_start|>12+34=46")
    result = session.generator.sample(
        model_input(prompt),
        sampling_params={"max_tokens": 1},
        prompt_logprobs=True,
        topk_prompt_logprobs=20,
        interval=FAST,
    )
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] == 0.0
    forward = completion_logprobs(session, prompt[:1], prompt[1:])
    diffs = [abs(a - b) for a, b in zip(forward, result.prompt_logprobs[1:], strict=True)]
    assert max(diffs) <= 1e-4
    topk = result.topk_prompt_logprobs
    assert len(topk) == len(prompt)
    assert not topk[0].token_ids and not topk[0].logprobs
    within = 0
    for position in range(1, len(prompt)):
        entry = topk[position]
        assert len(entry.token_ids) == len(entry.logprobs) == 20
        assert entry.logprobs == sorted(entry.logprobs, reverse=True)
        true_logprob = result.prompt_logprobs[position]
        if true_logprob >= entry.logprobs[-1] + 1e-6:  # the true token ranks within k
            within += 1
            index = entry.token_ids.index(prompt[position])
            assert entry.logprobs[index] == pytest.approx(true_logprob, abs=1e-5)
    assert within > 0
    session.stop()
    resources.stop()


def test_a_seed_reproduces_across_batch_mates_and_num_samples(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 13})
    prompt = encode("<|im_start|>reverse abc:")
    params = {"max_tokens": 12, "temperature": 1.0, "seed": 77}
    alone = session.generator.sample(
        model_input(prompt), num_samples=2, sampling_params=params, interval=FAST
    )
    batch = session.generator.sample_batch(
        [model_input(encode("hello")), model_input(prompt)],
        num_samples=4,
        sampling_params=params,
        interval=FAST,
    )
    assert [s.tokens for s in alone.sequences] == [s.tokens for s in batch[1].sequences[:2]]
    for ours, theirs in zip(alone.sequences, batch[1].sequences, strict=False):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    session.stop()
    resources.stop()


def test_a_stop_string_spanning_two_tokens_stops_after_completing_it(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 14})
    prompt = encode(LONG_PROMPT)
    greedy = {"max_tokens": 16, "temperature": 0}
    free = session.generator.sample(model_input(prompt), sampling_params=greedy, interval=FAST)
    text = TOKENIZER.decode(free.sequences[0].tokens)
    stop = text[5:7]  # two characters: two tokens of the char-level tokenizer
    end = text.index(stop) + 2
    stopped = session.generator.sample(
        model_input(prompt), sampling_params={**greedy, "stop": [stop]}, interval=FAST
    ).sequences[0]
    assert stopped.stop_reason == "STOP_REASON_STOP"
    assert stopped.tokens == free.sequences[0].tokens[:end]
    assert TOKENIZER.decode(stopped.tokens).endswith(stop)
    session.stop()
    resources.stop()


def test_the_prefix_cache_serves_the_second_operation_until_the_weights_change(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 15})
    prompt = encode("<|im_start|>reverse abcdefgh:")
    greedy = {"max_tokens": 8, "temperature": 0}

    def sample():
        return session.generator.sample(
            model_input(prompt), num_samples=2, sampling_params=greedy, interval=FAST
        )

    cold, warm = sample(), sample()
    assert [s.prompt_cache_hit_tokens for s in cold.sequences] == [0, 0]
    assert [s.prompt_cache_hit_tokens for s in warm.sequences] == [len(prompt) - 1] * 2
    for hot, fresh in zip(warm.sequences, cold.sequences, strict=True):
        assert hot.tokens == fresh.tokens
        assert hot.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    train_one_step(session, prompt + encode("hgfedcba"))
    session.trainer.weights_sync(interval=FAST)
    after = sample()
    assert [s.prompt_cache_hit_tokens for s in after.sequences] == [0, 0]
    assert [(p.start_token, p.version) for p in after.policy_segments] == [(0, 1)]
    session.stop()
    resources.stop()


# ---------------------------------------------------------------- weights-sync modes


def test_background_publish_completes_at_once_and_lands_between_requests(shared_server):
    url = shared_server.base_url
    resources, session = open_session(url, lora_config={"rank": 8, "seed": 16})
    prompt = encode(LONG_PROMPT)
    train_one_step(session, prompt + encode(" esrever"))
    assert policy(session) == (1, 0, 0, False)
    running = start_long_greedy_sample(url, session.session_id, prompt)
    synced = session.trainer.weights_sync(
        weight_sync_type="WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH", interval=FAST
    )
    state = policy(session)
    ops = low_level(url).post_training.operations
    still_running = ops.retrieve_sample(running.id, session_id=session.session_id).status
    assert synced.weights_version == 1
    # Read while the long sample still held the generator: queued, not applied yet.
    assert still_running == "TRAINING_OPERATION_STATUS_RUNNING"
    assert state == (1, 1, 0, True)
    after = session.generator.sample(
        model_input(prompt), sampling_params={"max_tokens": 4, "temperature": 0}, interval=FAST
    )
    assert [(p.start_token, p.version) for p in after.policy_segments] == [(0, 1)]
    long_result = wait_for_sample(url, session.session_id, running.id)
    # BACKGROUND_PUBLISH never switches a running generation.
    assert [(p.start_token, p.version) for p in long_result.policy_segments] == [(0, 0)]
    assert policy(session) == (1, 1, 1, False)
    session.stop()
    resources.stop()


def test_pipeline_publish_switches_a_running_sample_at_a_token_boundary(shared_server):
    url = shared_server.base_url
    resources, session = open_session(url, lora_config={"rank": 8, "seed": 17})
    prompt = encode(LONG_PROMPT)
    greedy = {"max_tokens": 24, "temperature": 0}
    old = session.generator.sample(model_input(prompt), sampling_params=greedy, interval=FAST)
    old_tokens = old.sequences[0].tokens
    train_one_step(session, prompt + encode(" esrever esrever"))
    running = start_long_greedy_sample(url, session.session_id, prompt)
    synced = session.trainer.weights_sync(
        weight_sync_type="WEIGHT_SYNC_TYPE_PIPELINE", interval=FAST
    )
    assert synced.weights_version == 1
    result = wait_for_sample(url, session.session_id, running.id)
    segments = [(p.start_token, p.version) for p in result.policy_segments]
    assert len(segments) == 2 and segments[0] == (0, 0) and segments[1][1] == 1, segments
    switch = segments[1][0]
    tokens = result.sequences[0].tokens
    assert 0 < switch < len(tokens)
    assert all(s.tokens == tokens for s in result.sequences)  # greedy rows switch together
    checked = min(switch, len(old_tokens))
    assert tokens[:checked] == old_tokens[:checked]  # before the switch: version 0
    # After it: exactly what version 1 generates from the prefix, and its logprobs.
    continued = session.generator.sample(
        model_input(prompt + tokens[:switch]),
        sampling_params={"max_tokens": len(tokens) - switch, "temperature": 0},
        interval=FAST,
    )
    assert continued.policy_segments[0].version == 1
    assert continued.sequences[0].tokens == tokens[switch:]
    forward = completion_logprobs(session, prompt + tokens[:switch], tokens[switch:])
    diffs = [
        abs(a - b) for a, b in zip(forward, result.sequences[0].logprobs[switch:], strict=True)
    ]
    assert max(diffs) <= 1e-4
    assert policy(session) == (1, 1, 1, False)
    session.stop()
    resources.stop()


def test_pipeline_and_background_publish_on_an_idle_generator_land_before_the_next_sample(
    shared_server,
):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 18})
    prompt = encode("<|im_start|>1 2 3")
    for step, mode in enumerate(
        ("WEIGHT_SYNC_TYPE_PIPELINE", "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"), start=1
    ):
        train_one_step(session, prompt + encode(" 4 5"))
        synced = session.trainer.weights_sync(weight_sync_type=mode, interval=FAST)
        assert synced.weights_version == step
        result = session.generator.sample(
            model_input(prompt), sampling_params={"max_tokens": 3}, interval=FAST
        )
        assert [(p.start_token, p.version) for p in result.policy_segments] == [(0, step)]
        assert policy(session) == (step, step, step, False)
    session.stop()
    resources.stop()


# ---------------------------------------------------------------- operations joining a generation


def test_a_sample_submitted_while_another_generates_joins_it_and_equals_alone(shared_server):
    """The in-process engine decodes sample operations as a stream: one submitted while a long
    generation runs joins it at a block boundary, finishes while the long one goes on, and gets
    exactly what it gets alone; another session's forward-backward runs between blocks."""
    url = shared_server.base_url
    resources, session = open_session(url, lora_config={"rank": 4, "seed": 21})
    other = resources.create_session(interval=0.2, lora_config={"rank": 4, "seed": 22})
    ops = low_level(url).post_training.operations
    params = {"max_tokens": 8, "temperature": 0.9, "top_k": 40, "seed": 5}
    short = model_input(encode("<|im_start|>1 2 3"))

    running = start_long_greedy_sample(url, session.session_id, encode(LONG_PROMPT))
    joined = other.generator.sample(short, num_samples=2, sampling_params=params, interval=FAST)
    still = ops.retrieve_sample(running.id, session_id=session.session_id).status
    assert still == "TRAINING_OPERATION_STATUS_RUNNING"
    other.trainer.forward_backward(
        samples=[sft_sample(encode("1 2 3 4 5"), 1)], loss=CE, interval=FAST
    )
    still = ops.retrieve_sample(running.id, session_id=session.session_id).status
    assert still == "TRAINING_OPERATION_STATUS_RUNNING"
    wait_for_sample(url, session.session_id, running.id)

    alone = other.generator.sample(short, num_samples=2, sampling_params=params, interval=FAST)
    assert [s.tokens for s in joined.sequences] == [s.tokens for s in alone.sequences]
    for ours, theirs in zip(joined.sequences, alone.sequences, strict=True):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    other.stop()
    session.stop()
    resources.stop()


# ---------------------------------------------------------------- requests the generator refuses


def test_a_trainer_only_resource_rejects_sample_with_400(shared_server):
    resources = ModelResourcesClient.create(
        base_url=shared_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        compute_config={"num_generator_replicas": 0},
        interval=0.2,
    )
    session = resources.create_session(interval=0.2)
    ops = low_level(shared_server.base_url).post_training.operations
    with pytest.raises(BadRequestError) as info:
        ops.sample(
            session.session_id,
            idempotency_key=str(uuid.uuid4()),
            model_inputs=[model_input([5, 6])],
        )
    assert info.value.body["error"]["param"] == "compute_config.num_generator_replicas"
    with pytest.raises(BadRequestError) as info:
        ops.sample(
            session.session_id,
            idempotency_key=str(uuid.uuid4()),
            model_inputs=[model_input([5, 6])],
            topk_prompt_logprobs=21,
        )
    assert info.value.body["error"]["param"] == "topk_prompt_logprobs"
    session.stop()
    resources.stop()


def test_the_seed_era_sample_route_and_prompts_alias_work(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 19})
    prompt = encode("<|im_start|>7+8=")
    response = httpx.post(
        f"{shared_server.base_url}/v1/rl/training-sessions/{session.session_id}:sample",
        headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": str(uuid.uuid4())},
        json={
            "prompts": [model_input(prompt)],
            "num_samples": 2,
            "sampling_params": {"max_tokens": 5, "temperature": 0},
        },
    )
    assert response.status_code == 200, response.text
    legacy = wait_for_sample(shared_server.base_url, session.session_id, response.json()["id"])
    current = session.generator.sample(
        model_input(prompt),
        num_samples=2,
        sampling_params={"max_tokens": 5, "temperature": 0},
        interval=FAST,
    )
    assert [s.tokens for s in legacy.sequences] == [s.tokens for s in current.sequences]
    session.stop()
    resources.stop()


def test_the_seed_era_sample_route_runs_a_request_without_an_idempotency_key(shared_server):
    """Its clients never sent the header: each such request is its own operation, and a bad
    body is still refused naming the field."""
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 19})
    url = f"{shared_server.base_url}/v1/rl/training-sessions/{session.session_id}:sample"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "prompts": [model_input(encode("<|im_start|>2+2="))],
        "num_samples": 1,
        "sampling_params": {"max_tokens": 4, "temperature": 0},
    }
    first = httpx.post(url, headers=headers, json=body)
    second = httpx.post(url, headers=headers, json=body)
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert first.json()["id"] != second.json()["id"]  # without a key, nothing is deduplicated
    results = [
        wait_for_sample(shared_server.base_url, session.session_id, r.json()["id"])
        for r in (first, second)
    ]
    assert all(1 <= len(r.sequences[0].tokens) <= 4 for r in results)  # it ran
    assert results[0].sequences[0].tokens == results[1].sequences[0].tokens  # greedy
    refused = httpx.post(url, headers=headers, json={**body, "num_samples": "many"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "num_samples"
    # The 3.1.1 route still requires the header.
    current = httpx.post(
        f"{shared_server.base_url}/v1/rl/training-sessions/{session.session_id}/operations/sample",
        headers=headers,
        json={"model_inputs": body["prompts"], "num_samples": 1},
    )
    assert current.status_code == 400 and current.json()["error"]["param"] == "Idempotency-Key"
    session.stop()
    resources.stop()
