"""Poll latency while a step runs: GET of an operation during a long sample vs on an idle server.

Compute runs on the resource's worker thread, never on the asyncio loop, so polls should stay
fast while the engine is busy. The server runs with `--poll-hold-seconds 0`: a held GET
(the default) would wait for the sample to finish instead of answering its status. Prints
medians over repetitions and their ratio (busy / idle).

    python bench/poll_latency.py [--polls 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ServerProcess  # noqa: E402

HEADERS = {"Authorization": "Bearer bench", "Content-Type": "application/json"}


def poll_times(client: httpx.Client, url: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        client.get(url).raise_for_status()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--polls", type=int, default=40)
    args = parser.parse_args()
    import tempfile

    directory = Path(tempfile.mkdtemp())
    server = ServerProcess(
        directory / "data", directory / "server.log", extra_args=("--poll-hold-seconds", "0")
    )
    server.start()
    try:
        client = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)
        resource = client.post(
            "/v1/rl/model-resources", json={"base_model": "posttrain/tiny-qwen3"}
        )
        rid = resource.json()["id"]
        sid = client.post("/v1/rl/training-sessions", json={"model_resources_id": rid}).json()["id"]
        ops = f"/v1/rl/training-sessions/{sid}/operations"
        body = {
            "model_inputs": [{"chunks": [{"encoded_text": {"tokens": [1, 5, 6]}}]}],
            "num_samples": 64,
            "sampling_params": {"max_tokens": 400, "temperature": 1.0},
        }
        idle = poll_times(client, f"/v1/rl/training-sessions/{sid}", args.polls)
        op = client.post(
            f"{ops}/sample", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
        ).json()
        busy = poll_times(client, f"{ops}/sample/{op['id']}", args.polls)
        still_running = client.get(f"{ops}/sample/{op['id']}").json()["status"]
        idle_ms, busy_ms = statistics.median(idle) * 1e3, statistics.median(busy) * 1e3
        print(f"idle poll median  {idle_ms:.2f} ms over {len(idle)} polls")
        print(f"busy poll median  {busy_ms:.2f} ms over {len(busy)} polls (op {still_running})")
        print(f"ratio busy/idle   {busy_ms / idle_ms:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
