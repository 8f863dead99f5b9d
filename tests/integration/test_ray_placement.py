"""`posttrain serve --ray local`: a resource's trainer worker (or trainer ranks) and generator
replicas as Ray actors in a placement group of its own (engine/hosts/ray/placement.py). Through the
SDK against a real server: an SDK loop on a resource with two replicas gets exactly what the
in-thread engine gives, and one on two trainer ranks and two replicas what it gives within
rounding; a killed trainer or replica actor fails its operation with INTERNAL_ERROR naming it
and the session carries on; the actors and the group live as long as the resource, and
neither they nor the Ray instance outlive the server. One Ray start at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, open_session, sft_sample
from test_trainer_ranks import LORA as RL_LORA
from test_trainer_ranks import assert_equal_across_ranks, rl_loop
from test_worker_processes import CE, FAST, LORA, PROMPT, TOKENS, alive, loop, scored, train
from together.post_training import ModelResourcesClient, SessionClient

pytest.importorskip("ray")


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for something Ray does asynchronously (an actor killed, a group removed)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found |= {int(child), *descendants(int(child))}
    return found


# Asks the server's Ray instance what lives there, from a driver of its own (this process
# stays out of Ray). The instance enabled Ray's token authentication: a client asks for it,
# and the token is in ~/.ray.
STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="posttrain", log_to_driver=False)
names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
print(json.dumps({
    "actors": {n: ray.get(ray.get_actor(n).pid.remote()) for n in names},
    "groups": [
        {k: g[k] for k in ("name", "state", "strategy")} | {"bundles": list(g["bundles"].values())}
        for g in ray.util.placement_group_table().values()
    ],
}))
"""


def ray_state(address: str) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    run = subprocess.run(
        [sys.executable, "-c", STATE, address], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ray")
    args = ("--poll-hold-seconds", "0", "--workers", "process", "--generators", "process")
    proc = ServerProcess.started(directory, *args, "--ray", "local")
    yield proc
    proc.stop()


def ray_address(server: ServerProcess) -> str:
    """The server's Ray instance: its address is in the server's log."""
    return re.search(r"Ray placement on local \(address (\S+)\)", server.log()).group(1)


def actor_pid(address: str, resource_id: str, place: str) -> int:
    (pid,) = [
        pid
        for name, pid in ray_state(address)["actors"].items()
        if name.startswith(f"posttrain-{resource_id}-{place}-")
    ]
    return pid


def sampled(session: SessionClient) -> list[list[int]]:
    sample = session.generator.sample(
        PROMPT, num_samples=2, sampling_params={"max_tokens": 6, "seed": 9}, interval=FAST
    )
    return [list(s.tokens) for s in sample.sequences]


def test_killed_actors_fail_their_operation_and_the_session_carries_on(ray_server):
    resources = ModelResourcesClient.create(
        base_url=ray_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        compute_config={"num_generator_replicas": 1},
        interval=0.2,
    )
    session = resources.create_session(interval=0.2, lora_config=LORA)
    resource_id = resources.model_resources_id
    address = ray_address(ray_server)
    train(session, 2)
    session.trainer.weights_sync(interval=FAST)
    first = sampled(session)

    replica = actor_pid(address, resource_id, "generator0")
    os.kill(replica, signal.SIGKILL)
    with pytest.raises(Exception) as info:
        sampled(session)
    message = str(info.value)
    assert "INTERNAL_ERROR" in message or "internal" in message.lower(), message
    assert f"generator replica 0 of model resource {resource_id} (pid {replica}) is gone" in message
    assert sampled(session) == first  # a new replica, rebuilt from the trainer
    assert actor_pid(address, resource_id, "generator0") != replica

    before = scored(session)
    worker = actor_pid(address, resource_id, "worker")
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(Exception) as info:
        session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    message = str(info.value)
    assert "INTERNAL_ERROR" in message or "internal" in message.lower(), message
    assert f"model resource {resource_id} (pid {worker}) is gone" in message
    assert ray_server.process.poll() is None  # the API process lives on
    assert session.retrieve().status == "TRAINING_SESSION_STATUS_RUNNING"
    assert scored(session) == before  # the state of the last completed operation
    assert actor_pid(address, resource_id, "worker") != worker
    train(session, 1)
    resources.stop(force=True)


def test_a_loop_on_ray_actors_equals_the_in_thread_engine(ray_server, tmp_path):
    """Last in the module: it stops the server."""
    resources = ModelResourcesClient.create(
        base_url=ray_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        compute_config={"num_generator_replicas": 2},
        interval=0.2,
    )
    session = resources.create_session(interval=0.2, lora_config=LORA)
    on_ray = loop(session)

    (tmp_path / "thread").mkdir()
    in_thread = ServerProcess.started(tmp_path / "thread", "--poll-hold-seconds", "0")
    try:
        _, twin = open_session(in_thread.base_url, lora_config=LORA)
        assert loop(twin) == on_ray
    finally:
        in_thread.stop()

    address = ray_address(ray_server)
    resource_id = resources.model_resources_id
    group = f"posttrain-{resource_id}"

    def ours() -> tuple[dict[str, int], list[dict]]:
        state = ray_state(address)
        actors = {n: pid for n, pid in state["actors"].items() if n.startswith(f"{group}-")}
        return actors, [g for g in state["groups"] if g["name"] == group]

    actors, groups = ours()
    assert sorted(name.split("-")[-2] for name in actors) == ["generator0", "generator1", "worker"]
    assert groups == [
        {"name": group, "state": "CREATED", "strategy": "PACK", "bundles": [{"CPU": 1.0}] * 3}
    ]
    pids = list(actors.values())
    assert all(alive(pid) for pid in pids)

    resources.stop(force=True)

    def gone() -> bool:
        actors, groups = ours()
        return not actors and [g["state"] for g in groups] == ["REMOVED"]

    until(gone, "the resource's actors and placement group to go")
    until(lambda: not any(alive(pid) for pid in pids), "its actor processes to end")

    ray_processes = descendants(ray_server.process.pid)  # the Ray instance it started
    assert ray_processes
    ray_server.stop()
    until(lambda: not any(alive(pid) for pid in ray_processes), "the Ray instance to stop")


def test_trainer_ranks_and_replicas_on_ray_equal_the_in_thread_engine(tmp_path):
    """`--ray local --trainer-ranks 2 --generators process`, two replicas: the ranks and the
    replicas are actors of the resource's placement group, and an RL loop gets what the
    in-thread engine gets (losses within 1e-5 relative across ranks, the same tokens). After
    the module's other server (one local Ray instance at a time)."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "thread").mkdir()
    args = ("--poll-hold-seconds", "0", "--trainer-ranks", "2", "--generators", "process")
    server = ServerProcess.started(tmp_path / "ray", *args, "--ray", "local")
    try:
        resources = ModelResourcesClient.create(
            base_url=server.base_url,
            api_key=API_KEY,
            base_model=BASE_MODEL,
            compute_config={"num_generator_replicas": 2},
            interval=0.2,
        )
        session = resources.create_session(interval=0.2, lora_config=RL_LORA)
        on_ray = rl_loop(session, 2)
        group = f"posttrain-{resources.model_resources_id}"
        state = ray_state(ray_address(server))
        names = [n for n in state["actors"] if n.startswith(f"{group}-")]
        roles = ["generator0", "generator1", "rank0", "rank1"]
        assert sorted(n.split("-")[-2] for n in names) == roles
        (placed,) = [g for g in state["groups"] if g["name"] == group]
        assert placed["bundles"] == [{"CPU": 1.0}] * 4
    finally:
        server.stop()

    thread = ServerProcess.started(tmp_path / "thread", "--poll-hold-seconds", "0")
    try:
        _, twin = open_session(thread.base_url, lora_config=RL_LORA)
        in_thread = rl_loop(twin, 2)
    finally:
        thread.stop()
    assert_equal_across_ranks(on_ray, in_thread)
