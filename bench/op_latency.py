"""Submit-to-result latency of one-token operations, against the HTTP floor of the same server.

One client (httpx, one connection) POSTs an operation and GETs it until it is terminal, as the
SDK does (first GET at once), for: a forward-backward of one 1-token sample, a sample of one
token, and an optim-step. The floor is a GET /healthz round trip on the same connection; the
engine's own time per operation is the server's posttrain_worker_busy_seconds_total over the
operations run. Prints medians over --reps operations of each kind, OMP threads stated, and
latency / floor ratios. With held polls (the default) the first GET carries the result; with
--poll-hold-seconds 0 (`--no-hold`) the client polls every --interval seconds instead.

    OMP_NUM_THREADS=1 python bench/op_latency.py [--reps 50] [--no-hold]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import ServerProcess  # noqa: E402

HEADERS = {"Authorization": "Bearer bench", "Content-Type": "application/json"}
TERMINAL = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")


def busy_seconds(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return sum(
        float(v) for v in re.findall(r"^posttrain_worker_busy_seconds_total\S* (\S+)$", text, re.M)
    )


def bodies() -> dict[str, dict]:
    one = {"chunks": [{"encoded_text": {"tokens": [5]}}]}
    return {
        "forward-backward": {
            "samples": [
                {
                    "model_input": one,
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [6], "dtype": "int64"},
                        "weights": {"data": [1.0], "dtype": "float32"},
                    },
                }
            ],
            "loss": {"type": "LOSS_TYPE_CROSS_ENTROPY"},
        },
        "sample": {
            "model_inputs": [one],
            "num_samples": 1,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "seed": 0},
        },
        "optim-step": {"adam_params": {"learning_rate": 1e-4}},
    }


def run_one(client: httpx.Client, ops: str, kind: str, body: dict, interval: float) -> float:
    start = time.perf_counter()
    op = client.post(f"{ops}/{kind}", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
    if op.is_error:
        raise RuntimeError(f"{kind}: {op.status_code} {op.text}")
    op_id = op.json()["id"]
    while True:
        status = client.get(f"{ops}/{kind}/{op_id}").json()["status"]
        if status in TERMINAL:
            break
        time.sleep(interval)
    assert status.endswith("COMPLETED"), status
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-hold", action="store_true", help="serve with --poll-hold-seconds 0")
    parser.add_argument("--interval", type=float, default=0.5, help="client poll interval (s)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    extra = ("--poll-hold-seconds", "0") if args.no_hold else ()
    server = ServerProcess(directory / "data", directory / "server.log", extra_args=extra)
    server.start()
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, held polls:"
        f" {'off' if args.no_hold else 'on'}, client poll interval {args.interval}s"
    )
    try:
        client = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)
        rid = client.post(
            "/v1/rl/model-resources", json={"base_model": "posttrain/tiny-qwen3"}
        ).json()["id"]
        sid = client.post("/v1/rl/training-sessions", json={"model_resources_id": rid}).json()["id"]
        ops = f"/v1/rl/training-sessions/{sid}/operations"
        floor = []
        for _ in range(args.reps):
            start = time.perf_counter()
            client.get("/healthz").raise_for_status()
            floor.append(time.perf_counter() - start)
        floor_ms = statistics.median(floor) * 1e3
        print(f"{'HTTP floor (GET /healthz)':<28} {floor_ms:8.2f} ms", flush=True)
        for kind, body in bodies().items():
            run_one(client, ops, kind, body, args.interval)  # warm-up
            before = busy_seconds(client)
            times = [run_one(client, ops, kind, body, args.interval) for _ in range(args.reps)]
            engine_ms = (busy_seconds(client) - before) / args.reps * 1e3
            latency_ms = statistics.median(times) * 1e3
            print(
                f"{kind:<28} {latency_ms:8.2f} ms submit-to-result (median of {args.reps});"
                f" engine {engine_ms:.2f} ms per op; {latency_ms / floor_ms:.1f}x the floor"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
