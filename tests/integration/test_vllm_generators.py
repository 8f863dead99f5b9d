"""`posttrain serve --generators vllm`: each generator replica is a vLLM server process
(engine/hosts/vllm/engine.py), run from the venv scripts/build_vllm_env.sh builds
(tests/vllm_env.py; these tests skip, saying why, only where it cannot be built).

Through the SDK against a real server, one vLLM server per resource shared by the module (a
start costs tens of seconds): a LoRA session's samples score within 1e-4 of the trainer's
forward on the same tokens (CPU float32), before and after training, and follow each
weights-sync; two sessions' adapters stay apart; a PIPELINE weights-sync switches a running
sample at a token boundary and policy_segments say where; a full-weight session does the same
through vLLM's weight reload; what vLLM cannot do is a 400 naming the field; a killed vLLM
server fails its sample with INTERNAL_ERROR naming it, and the next sample is served."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, low_level, sft_sample
from together.post_training import ModelResourcesClient
from vllm_env import vllm_python  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
ADAM = {"learning_rate": 5e-2, "weight_decay": 0.0}
PROMPT = [1, 40, 41, 42, 50]
TRAIN = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36]
SYNC = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
PIPELINE = "WEIGHT_SYNC_TYPE_PIPELINE"
LONG_PROMPT = [1] + [(7 * i) % 97 + 2 for i in range(255)]  # whole KV blocks to cache


def model_input(tokens: list[int]) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, vllm_python: Path):  # noqa: F811
    directory = tmp_path_factory.mktemp("vllm")
    proc = ServerProcess.started(
        directory,
        "--poll-hold-seconds", "0", "--generators", "vllm", "--vllm-python", str(vllm_python),
        "--vllm-mismatch-rate", "1",
    )  # fmt: skip
    yield proc
    started = vllm_servers(proc.process.pid)
    proc.stop()
    assert [pid for pid in started if Path(f"/proc/{pid}").exists()] == []  # stopped with it


def vllm_servers(parent: int | None) -> list[int]:
    """Pids of vLLM API servers started by `parent` (any parent: None)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline and parent in (None, ppid):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def lora_resource(vllm_server):
    resources = ModelResourcesClient.create(
        base_url=vllm_server.base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    yield resources
    resources.stop()


def scored(session, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's forward logprobs of `tokens` after `prompt`."""
    result = session.trainer.forward(
        samples=[sft_sample(prompt + tokens, len(prompt))], loss=CE, interval=FAST
    )
    return result.loss_fn_outputs[0].tensors["logprobs"].data[len(prompt) - 1 :]


def train(session, steps: int = 2) -> None:
    for _ in range(steps):
        session.trainer.forward_backward(samples=[sft_sample(TRAIN, 1)], loss=CE, interval=FAST)
        session.trainer.optim_step(adam_params=ADAM, interval=FAST)


def sample(session, seed: int = 3, **params):
    sampling = {"max_tokens": 8, "seed": seed, **params}
    return session.generator.sample(
        model_input(PROMPT), num_samples=2, sampling_params=sampling, interval=FAST
    )


def mismatch(session, result) -> float:
    """The largest |sampled logprob - trainer logprob| over every sampled token."""
    worst = 0.0
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) >= 1
        forward = scored(session, PROMPT, list(sequence.tokens))
        worst = max(worst, *(abs(a - b) for a, b in zip(forward, sequence.logprobs, strict=True)))
    return worst


def segments(result) -> list[tuple[int, int]]:
    return [(p.start_token, p.version) for p in result.policy_segments]


def test_a_lora_session_trains_syncs_and_samples_through_vllm(lora_resource):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 8, "seed": 5})
    before = sample(session)
    assert mismatch(session, before) <= 1e-4
    assert segments(before) == [(0, 0)]
    assert [list(s.tokens) for s in sample(session).sequences] == [
        list(s.tokens) for s in before.sequences
    ]  # a seed repeats within the engine
    base_logprobs = scored(session, PROMPT, list(before.sequences[0].tokens))

    train(session)
    synced = session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    assert synced.weights_version == 2
    after = sample(session)
    assert segments(after) == [(0, 2)]
    assert mismatch(session, after) <= 1e-4  # the samples follow the new weights
    moved = scored(session, PROMPT, list(before.sequences[0].tokens))
    assert max(abs(a - b) for a, b in zip(moved, base_logprobs, strict=True)) > 1e-2
    session.stop()


def test_the_trainer_scores_what_vllm_sampled_per_operation_and_in_metrics(
    vllm_server, lora_resource
):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 12})
    train(session, steps=1)
    session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    base = f"{vllm_server.base_url}/v1/rl/training-sessions/{session.session_id}/operations"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "model_inputs": [model_input(PROMPT), model_input(PROMPT[:3])],
        "num_samples": 2,
        "sampling_params": {"max_tokens": 6, "seed": 1},
    }
    key = {"Idempotency-Key": str(uuid.uuid4())}
    op = httpx.post(f"{base}/sample", headers=headers | key, json=body).json()
    while (done := httpx.get(f"{base}/sample/{op['id']}", headers=headers).json())["status"] in (
        "TRAINING_OPERATION_STATUS_PENDING",
        "TRAINING_OPERATION_STATUS_RUNNING",
    ):
        time.sleep(0.02)
    results = done["output"]["results"]
    for result in results:  # --vllm-mismatch-rate 1: every operation is scored
        found = result["logprob_mismatch"]
        assert found["tokens"] == sum(len(s["tokens"]) for s in result["sequences"])
        assert 0 <= found["mean"] <= found["max"] <= 1e-4
    metrics = httpx.get(f"{vllm_server.base_url}/metrics").text
    stats = dict(
        re.findall(r'^posttrain_generator_logprob_mismatch\{stat="(\w+)"\} (\S+)$', metrics, re.M)
    )
    assert float(stats["tokens"]) >= sum(r["logprob_mismatch"]["tokens"] for r in results)
    assert 0 <= float(stats["mean"]) <= float(stats["max"]) <= 1e-4
    session.stop()


def test_two_sessions_adapters_stay_isolated(lora_resource):
    trained = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 6})
    fresh = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 7})
    train(trained, steps=3)
    trained.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    fresh.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    one, other = sample(trained, seed=11), sample(fresh, seed=11)
    assert segments(one) == [(0, 3)] and segments(other) == [(0, 0)]
    assert mismatch(trained, one) <= 1e-4
    assert mismatch(fresh, other) <= 1e-4
    # The same tokens score differently on the two sessions: each sample used its own adapter.
    tokens = list(other.sequences[0].tokens)
    gap = zip(scored(trained, PROMPT, tokens), other.sequences[0].logprobs, strict=True)
    assert max(abs(a - b) for a, b in gap) > 1e-2
    trained.stop()
    fresh.stop()


def start_long_sample(url: str, session, prompts: int = 16) -> object:
    """Submit a sample that runs for a while (`prompts` prompts x 4 sequences of up to 400
    tokens: the longest decides) and return once it is running."""
    ops = low_level(url).post_training.operations
    op = ops.sample(
        session.session_id,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[model_input(PROMPT)] * prompts,
        num_samples=4,
        sampling_params={"max_tokens": 400, "temperature": 1.0, "seed": 2},
    )
    while ops.retrieve_sample(op.id, session_id=session.session_id).status == (
        "TRAINING_OPERATION_STATUS_PENDING"
    ):
        time.sleep(0.01)
    return op


def vllm_metric(pid: int, name: str) -> float:
    """A value of the vLLM server `pid`'s own /metrics (0 before it reports one)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    port = int(argv[argv.index(b"--port") + 1])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    match = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_decoding(url: str, session, op, pid: int, sequences: int) -> bool:
    """True once the vLLM server `pid` decodes at least `sequences` sequences; False if the
    sample finished before its /metrics showed them (its gauges lag its steps)."""
    ops = low_level(url).post_training.operations
    while vllm_metric(pid, "num_requests_running") < sequences:
        status = ops.retrieve_sample(op.id, session_id=session.session_id).status
        if status != "TRAINING_OPERATION_STATUS_RUNNING":
            assert status == "TRAINING_OPERATION_STATUS_COMPLETED", status
            return False
        time.sleep(0.01)
    return True


def decoding_sample(url: str, session, pid: int, sequences: int, prompts: int = 16) -> object:
    """A long sample seen decoding at least `sequences` sequences on the server `pid`: the
    precondition of a switch mid-generation, so a sample that ended before it was seen (a CI
    run once missed the gauge) is replaced by another, up to three."""
    for _ in range(3):
        running = start_long_sample(url, session, prompts)
        if wait_decoding(url, session, running, pid, sequences):
            return running
    raise AssertionError(f"three long samples ended before {sequences} sequences were seen")


def finished(url: str, session, op):
    ops = low_level(url).post_training.operations
    while (done := ops.retrieve_sample(op.id, session_id=session.session_id)).status in (
        "TRAINING_OPERATION_STATUS_PENDING",
        "TRAINING_OPERATION_STATUS_RUNNING",
    ):
        time.sleep(0.02)
    return done


def switched_sample(url: str, session, pid: int) -> tuple[object, int, int]:
    """A long sample with a PIPELINE sync landing while it decodes, and the versions it
    switched between. Two timing preconditions, each missed once in CI: the sample is seen
    decoding (vLLM's gauges lag its steps), and the sync reaches the vLLM server before the
    sample ends (every sequence then wholly on the old weights; that attempt is checked). A
    missed attempt runs again after one more training step: a sync's version counts trained
    versions, not syncs."""
    synced = trained = 0
    for _ in range(5):
        train(session, steps=1)
        trained += 1
        running = start_long_sample(url, session)
        if not wait_decoding(url, session, running, pid, sequences=16):
            continue
        time.sleep(0.2)  # a few tokens each before the switch
        result = session.trainer.weights_sync(weight_sync_type=PIPELINE, interval=FAST)
        assert result.weights_version == trained
        done = finished(url, session, running)
        assert done.status == "TRAINING_OPERATION_STATUS_COMPLETED", done.error
        found = [segments(result) for result in done.output.results]
        if any(len(f) == 2 for f in found):
            return done, synced, trained
        assert all(f == [(0, synced)] for f in found), found  # the sync landed after it ended
        synced = trained
    raise AssertionError("five long samples ended before a PIPELINE sync landed in one")


def test_a_pipeline_sync_switches_a_running_sample_at_a_token_boundary(vllm_server, lora_resource):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 8, "seed": 8})
    (pid,) = vllm_servers(vllm_server.process.pid)
    done, old, new = switched_sample(vllm_server.base_url, session, pid)
    for result in done.output.results:  # a prompt decoded after the pause is wholly `new`
        each = segments(result)
        assert each in ([(0, old)], [(0, new)]) or (each[0] == (0, old) and each[1][1] == new), each
        if len(each) == 2:  # switched at a token boundary inside the longest sequence
            assert 0 < each[1][0] <= max(len(s.tokens) for s in result.sequences)
    # The next sample runs wholly on the new weights.
    assert segments(sample(session)) == [(0, new)]
    session.stop()


def session_link(session_id: str) -> Path:
    """The link through which the vLLM server loads the session's adapter (Replica._link):
    under the engine's install root, in shared memory where the system has it."""
    roots = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    (link,) = [p for r in roots for p in r.glob(f"posttrain-vllm-*/*/served-*/{session_id}")]
    return link


def test_after_a_pipeline_switch_the_sessions_adapter_is_loaded_once_again(
    vllm_server, lora_resource
):
    """A PIPELINE sync loads the decoding session's adapter in place. vLLM keeps that flag on
    every later request naming the adapter and loads it from its path at every step of each:
    correct, through the link, but a disk read a step long after the switch. The session's
    next sample, none of its requests running, loads it afresh first; so a sample after that
    reads the adapter from memory only, and is served with the link gone (with the flag it
    read the missing path at its first step and the server's engine died)."""
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 8, "seed": 21})
    (pid,) = vllm_servers(vllm_server.process.pid)
    _, _, new = switched_sample(vllm_server.base_url, session, pid)
    assert segments(sample(session)) == [(0, new)]  # its admit loads the adapter afresh
    link = session_link(session.session_id)
    moved = link.with_name(f".{session.session_id}.moved")
    link.rename(moved)
    try:
        again = sample(session, seed=4)
    finally:
        moved.rename(link)
    assert segments(again) == [(0, new)]
    assert mismatch(session, again) <= 1e-4
    session.stop()


def status(url: str, session, op) -> str:
    ops = low_level(url).post_training.operations
    return ops.retrieve_sample(op.id, session_id=session.session_id).status


def joined_while_running(url: str, pid: int, decoding, then) -> tuple[object, object]:
    """`then()` (a sample of some session) run while a long sample of `decoding` decodes on
    the one vLLM server `pid`: its result, once the long one was still running when it came
    back, and the long one. Up to three tries: the long one's length is drawn (EOS)."""
    for _ in range(3):
        running = decoding_sample(url, decoding, pid, sequences=32, prompts=32)
        result = then()
        if status(url, decoding, running) == "TRAINING_OPERATION_STATUS_RUNNING":
            return result, running
        finished(url, decoding, running)
    raise AssertionError("three samples came back after the long one ended")


def test_a_sample_handed_to_a_busy_vllm_lane_joins_its_generation(vllm_server, lora_resource):
    """One server, so one lane: a sample handed to it while a long one decodes goes to the
    server at once (vLLM batches it in) and comes back while the long one still runs; before
    lanes streamed it waited for the whole running generation. Another session's SYNCHRONOUS
    sync staged meanwhile lets its sample join on the new weights (its fence changes no
    decoding session), and the long one keeps its own."""
    decoding = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 12})
    other = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 13})
    train(other, steps=1)
    (pid,) = vllm_servers(vllm_server.process.pid)

    def synced_then_sampled():
        other.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
        return sample(other, seed=11)

    joined, running = joined_while_running(vllm_server.base_url, pid, decoding, synced_then_sampled)
    assert segments(joined) == [(0, 1)]
    assert mismatch(other, joined) <= 1e-4  # sampled on the synced adapter
    done = finished(vllm_server.base_url, decoding, running)
    assert done.status == "TRAINING_OPERATION_STATUS_COMPLETED", done.error
    assert all(segments(result) == [(0, 0)] for result in done.output.results)
    decoding.stop()
    other.stop()


def test_a_decoding_sessions_sync_keeps_its_next_sample_for_the_next_generation(
    vllm_server, lora_resource
):
    """A SYNCHRONOUS sync of a session whose long sample decodes on the lane: its next sample
    may not join (its fence would change the running rows' weights); it runs after the long
    one, wholly on the synced weights, and the long one wholly on the old."""
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 14})
    (pid,) = vllm_servers(vllm_server.process.pid)
    url = vllm_server.base_url
    for _ in range(3):
        train(session, steps=1)
        synced = session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
        train(session, steps=1)
        running = decoding_sample(url, session, pid, sequences=32, prompts=32)
        session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
        if status(url, session, running) == "TRAINING_OPERATION_STATUS_RUNNING":
            break  # the sync was staged while the long one decoded
        finished(url, session, running)
    else:
        raise AssertionError("three long samples ended before the sync")
    after = sample(session)
    assert status(url, session, running) == "TRAINING_OPERATION_STATUS_COMPLETED"  # it waited
    done = finished(url, session, running)
    old, new = synced.weights_version, synced.weights_version + 1
    assert all(segments(result) == [(0, old)] for result in done.output.results)
    assert segments(after) == [(0, new)]
    assert mismatch(session, after) <= 1e-4
    session.stop()


def test_a_join_after_a_pipeline_switch_keeps_the_running_requests_adapter(
    vllm_server, lora_resource
):
    """A PIPELINE sync loads a decoding session's adapter in place on the server; then another
    session's sample joins, and applying its fence collects unused adapter files. vLLM loads
    the long sample's adapter again at its steps from the path its requests were sent with;
    where that was the old install's directory, removing it killed the server's engine (every
    running request failed)."""
    decoding = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 17})
    other = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 18})
    train(decoding, steps=1)
    train(other, steps=1)
    (pid,) = vllm_servers(vllm_server.process.pid)

    def pipelined_then_joined():
        decoding.trainer.weights_sync(weight_sync_type=PIPELINE, interval=FAST)
        other.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
        return sample(other, seed=12)

    joined, running = joined_while_running(
        vllm_server.base_url, pid, decoding, pipelined_then_joined
    )
    assert segments(joined) == [(0, 1)]
    assert mismatch(other, joined) <= 1e-4
    done = finished(vllm_server.base_url, decoding, running)
    assert done.status == "TRAINING_OPERATION_STATUS_COMPLETED", done.error
    assert segments(sample(decoding)) == [(0, 1)]
    decoding.stop()
    other.stop()


def test_more_sequences_than_a_server_decodes_at_once_go_in_seeded_parts(lora_resource):
    """vLLM refuses a request of more sequences than its max_num_seqs (256 here): a prompt's
    300 go as two requests, the second seeded from sequence 256 on, and come back as one
    result, every sequence scored by the trainer as sampled."""
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 19})
    prompt = LONG_PROMPT[:40]
    result = session.generator.sample(
        model_input(prompt), num_samples=300, interval=FAST,
        sampling_params={"max_tokens": 6, "seed": 5, "temperature": 1.0},
    )  # fmt: skip
    sequences = result.sequences
    assert len(sequences) == 300 and segments(result) == [(0, 0)]
    assert len({tuple(s.tokens) for s in sequences}) > 200  # not one seed repeated
    for index in (0, 255, 256, 299):  # both parts score as sampled
        forward = scored(session, prompt, list(sequences[index].tokens))
        diffs = zip(forward, sequences[index].logprobs, strict=True)
        assert max(abs(a - b) for a, b in diffs) <= 1e-4
    session.stop()


def test_a_seeded_sample_past_a_steps_token_budget_is_served(vllm_server, lora_resource):
    """64 prompts x 2 sequences of 40 tokens: 5,120 prompt tokens, past a step's default
    budget (2,048). vLLM 0.32 on the CPU killed its engine when a step prefilled part of a
    seeded request's prompt (it cannot rewind a CPU generator); servers on the CPU take whole
    prompts per step."""
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 20})
    prompts = [LONG_PROMPT[i : i + 40] for i in range(64)]
    ops = low_level(vllm_server.base_url).post_training.operations
    op = ops.sample(
        session.session_id,
        idempotency_key=str(uuid.uuid4()),
        model_inputs=[model_input(p) for p in prompts],
        num_samples=2,
        sampling_params={"max_tokens": 4, "seed": 9},
    )
    done = finished(vllm_server.base_url, session, op)
    assert done.status == "TRAINING_OPERATION_STATUS_COMPLETED", done.error
    assert [len(r.sequences) for r in done.output.results] == [2] * 64
    session.stop()


def long_prompt_sample(session, prompt: list[int]):
    return session.generator.sample(
        model_input(prompt), num_samples=1, sampling_params={"max_tokens": 4, "seed": 1},
        interval=FAST,
    )  # fmt: skip


def test_a_sync_renews_its_own_sessions_prefix_cache_only(vllm_server, lora_resource):
    """After a session's sync its cached prompt KV is not read again (a hit would score the
    old weights: vLLM keys the cache by adapter name and path, and each install has a path of
    its own, and a salt), while another session's prompts stay cached: nothing resets the
    whole cache (which vLLM refuses while any request runs, as one does in a lane's stream)."""
    one = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 15})
    two = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 16})
    prompt = LONG_PROMPT
    for session in (one, two):
        long_prompt_sample(session, prompt)
        assert long_prompt_sample(session, prompt).sequences[0].prompt_cache_hit_tokens > 0
    train(one, steps=1)
    one.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    assert long_prompt_sample(two, prompt).sequences[0].prompt_cache_hit_tokens > 0
    first = long_prompt_sample(one, prompt)
    assert first.sequences[0].prompt_cache_hit_tokens == 0
    assert segments(first) == [(0, 1)]
    tokens = list(first.sequences[0].tokens)
    forward = scored(one, prompt, tokens)
    assert (
        max(abs(a - b) for a, b in zip(forward, first.sequences[0].logprobs, strict=True)) <= 1e-4
    )
    assert long_prompt_sample(one, prompt).sequences[0].prompt_cache_hit_tokens > 0
    one.stop()
    two.stop()


def test_what_vllm_cannot_do_is_a_400_naming_the_field(vllm_server, lora_resource):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 9})
    url = f"{vllm_server.base_url}/v1/rl/training-sessions/{session.session_id}/operations/sample"
    for field in ("return_routed_experts", "prompt_logprobs"):
        response = httpx.post(
            url,
            headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": str(uuid.uuid4())},
            json={"model_inputs": [model_input(PROMPT)], field: True},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
    assert segments(sample(session)) == [(0, 0)]  # nothing else changed
    session.stop()


def test_a_killed_vllm_server_fails_its_sample_and_the_next_is_served(vllm_server, lora_resource):
    session = lora_resource.create_session(interval=0.2, lora_config={"rank": 4, "seed": 10})
    train(session, steps=1)
    session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    (pid,) = vllm_servers(vllm_server.process.pid)
    running = decoding_sample(vllm_server.base_url, session, pid, sequences=1)
    os.kill(pid, signal.SIGKILL)
    done = finished(vllm_server.base_url, session, running)
    assert done.status == "TRAINING_OPERATION_STATUS_FAILED"
    assert done.error.code == "TRAINING_OPERATION_ERROR_CODE_INTERNAL_ERROR"
    assert "generator replica 0 of model resource" in done.error.message
    assert f"pid {pid})" in done.error.message
    assert vllm_server.process.poll() is None  # the API server lives on
    after = sample(session)  # a new vLLM server, serving the synced weights
    assert segments(after) == [(0, 1)]
    assert mismatch(session, after) <= 1e-4
    (restarted,) = vllm_servers(vllm_server.process.pid)
    assert restarted != pid
    session.stop()


def test_a_full_weight_session_trains_syncs_and_samples_through_vllm(vllm_server):
    resources = ModelResourcesClient.create(
        base_url=vllm_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        lora_enabled=False,
        interval=0.2,
    )
    session = resources.create_session(interval=0.2)
    before = sample(session)
    assert segments(before) == [(0, 0)] and mismatch(session, before) <= 1e-4
    long_prompt_sample(session, LONG_PROMPT)
    assert long_prompt_sample(session, LONG_PROMPT).sequences[0].prompt_cache_hit_tokens > 0
    train(session)
    session.trainer.weights_sync(weight_sync_type=SYNC, interval=FAST)
    after = sample(session)
    assert segments(after) == [(0, 2)]
    assert mismatch(session, after) <= 1e-4  # vLLM reloaded the trained weights
    # The base model's name is the same before and after the reload: the prompt KV of the
    # old weights is not read again (the install's new cache salt).
    fresh = long_prompt_sample(session, LONG_PROMPT)
    assert fresh.sequences[0].prompt_cache_hit_tokens == 0
    forward = scored(session, LONG_PROMPT, list(fresh.sequences[0].tokens))
    assert (
        max(abs(a - b) for a, b in zip(forward, fresh.sequences[0].logprobs, strict=True)) <= 1e-4
    )
    assert [s.tokens for s in after.sequences] != [s.tokens for s in before.sequences]
    session.stop()
    resources.stop()
