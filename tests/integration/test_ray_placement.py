"""`posttrain serve --ray local`: a resource's trainer worker and generator replicas as Ray
actors in a placement group of its own (engine/ray_placement.py). Through the SDK against a
real server: an SDK loop on a resource with two replicas gets exactly what the in-thread engine
gives; the actors and the group live as long as the resource, and neither they nor the Ray
instance outlive the server. One Ray start for the module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import API_KEY, BASE_MODEL, open_session
from test_worker_processes import LORA, alive, loop
from together.post_training import ModelResourcesClient

pytest.importorskip("ray")

REPLICAS = 2


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


def test_a_loop_on_ray_actors_equals_the_in_thread_engine(ray_server, tmp_path):
    resources = ModelResourcesClient.create(
        base_url=ray_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        compute_config={"num_generator_replicas": REPLICAS},
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

    # The server's Ray instance: its address is in the server's log.
    address = re.search(r"Ray placement on local \(address (\S+)\)", ray_server.log()).group(1)
    resource_id = resources.model_resources_id
    state = ray_state(address)
    roles = sorted(name.split("-")[-2] for name in state["actors"])
    assert roles == ["generator0", "generator1", "worker"]
    assert all(name.startswith(f"posttrain-{resource_id}-") for name in state["actors"])
    assert state["groups"] == [
        {
            "name": f"posttrain-{resource_id}",
            "state": "CREATED",
            "strategy": "PACK",
            "bundles": [{"CPU": 1.0}] * (1 + REPLICAS),
        }
    ]
    pids = list(state["actors"].values())
    assert all(alive(pid) for pid in pids)

    resources.stop(force=True)

    def gone() -> bool:
        state = ray_state(address)
        return not state["actors"] and [g["state"] for g in state["groups"]] == ["REMOVED"]

    until(gone, "the resource's actors and placement group to go")
    until(lambda: not any(alive(pid) for pid in pids), "its actor processes to end")

    ray_processes = descendants(ray_server.process.pid)  # the Ray instance it started
    assert ray_processes
    ray_server.stop()
    until(lambda: not any(alive(pid) for pid in ray_processes), "the Ray instance to stop")
