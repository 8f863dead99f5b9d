"""What durable sessions cost: one RL-style step (forward-backward, optim-step, weights-sync)
with and without writing the state each operation changed, as the server does before it
reports the operation COMPLETED (service/durability/durable_sessions.py,
engine/checkpoint/durable.py); and for a full-weight session, with a snapshot of its whole state
every N steps (service/durability/full_weight.py; the journal between snapshots costs no write: the
request bodies are in the store already), and how long a restart's snapshot load takes.

Runs at engine level in one process, so the ratio is the persistence alone (no HTTP, no
polling): the step's engine time, then the same step plus persist_session of the parts each
operation changed (gradients; adapter, moments and gradients; the generator's adapter) into a
directory on the same disk as --data-dir would be. Variants alternate, medians of --steps.

    OMP_NUM_THREADS=1 python bench/durability.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_backward import MODEL_ID, make_samples, write_model  # noqa: E402

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
EVERYTHING = ("trainer", "generator", "optimizer", "gradients")
PARTS = {
    "forward-backward": ("gradients",),
    "optim-step": ("trainer", "optimizer", "gradients"),
    "weights-sync": ("generator",),
}


def step(engine: LocalEngine, samples, state_dir: Path | None, version: int) -> dict[str, float]:
    """One step; seconds per operation, persistence included when `state_dir` is set."""
    times = {}
    record = {"step": version}
    start = time.perf_counter()
    (outcome,) = engine.forward_backward_batch("r", [("s", ForwardBackwardRequest(samples, CE))])
    assert not isinstance(outcome, Exception), outcome
    if state_dir is not None:
        engine.persist_session("r", "s", state_dir, PARTS["forward-backward"], record)
    times["forward-backward"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-4)))
    if state_dir is not None:
        engine.persist_session("r", "s", state_dir, PARTS["optim-step"], record)
    times["optim-step"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.publish("r", "s", version=version)
    if state_dir is not None:
        engine.persist_session("r", "s", state_dir, PARTS["weights-sync"], record)
    times["weights-sync"] = time.perf_counter() - start
    return times


def measure(name: str, model_id: str, model_dir: Path, rank: int, lengths, steps: int) -> None:
    engine = LocalEngine(EngineConfig(device="cpu"), {model_id: model_dir})
    engine.load_resource("r", model_id, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=rank, alpha=2 * rank))
    vocab = engine.model_info(model_id).vocab_size
    samples = make_samples(lengths, seed=0, vocab=vocab)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:
        state_dir = Path(root) / "state"
        engine.persist_session("r", "s", state_dir, EVERYTHING, {})
        step(engine, samples, None, 0)  # warm-up
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for index in range(steps):
            for on in (False, True) if index % 2 == 0 else (True, False):
                runs[on].append(step(engine, samples, state_dir if on else None, index))
        size = sum(p.stat().st_size for p in state_dir.iterdir())
    tokens = sum(lengths)
    print(
        f"\n{name}: LoRA rank {rank}, {len(lengths)} samples, {tokens} tokens; state on disk"
        f" {size / 2**20:.1f} MiB"
    )
    print(f"{'operation':<18}{'off (ms)':>10}{'on (ms)':>10}{'ratio':>8}")
    totals = {on: [sum(r.values()) for r in runs[on]] for on in (False, True)}
    for op in PARTS:
        off = statistics.median(r[op] for r in runs[False]) * 1e3
        on = statistics.median(r[op] for r in runs[True]) * 1e3
        print(f"{op:<18}{off:>10.1f}{on:>10.1f}{on / off:>8.2f}")
    off, on = (statistics.median(totals[d]) * 1e3 for d in (False, True))
    print(f"{'whole step':<18}{off:>10.1f}{on:>10.1f}{on / off:>8.2f}")


def full_weight_step(
    engine: LocalEngine, samples, snapshot_dir: Path | None, version: int
) -> tuple[float, float]:
    """One full-weight step: (seconds, of which the snapshot's) with a snapshot of every part
    when `snapshot_dir` is set (the generator is dirty too: the previous step synced)."""
    start = time.perf_counter()
    (outcome,) = engine.forward_backward_batch("f", [("s", ForwardBackwardRequest(samples, CE))])
    assert not isinstance(outcome, Exception), outcome
    engine.optim_step("f", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-4)))
    snapshot = 0.0
    if snapshot_dir is not None:
        began = time.perf_counter()
        engine.persist_session("f", "s", snapshot_dir, EVERYTHING, {"step": version})
        snapshot = time.perf_counter() - began
    engine.publish("f", "s", version=version)
    return time.perf_counter() - start, snapshot


def measure_full_weight(
    name: str, model_id: str, model_dir: Path, lengths, steps: int, every: tuple[int, ...]
) -> None:
    """Steps without a snapshot and with one (alternating, medians): N = 1 as measured; a
    snapshot every N steps costs the snapshot's median over N steps (the journal writes
    nothing: the request bodies are in the store already)."""
    engine = LocalEngine(EngineConfig(device="cpu"), {model_id: model_dir})
    engine.load_resource("f", model_id, muon_scaling=None)
    engine.create_session("f", "s", None)
    vocab = engine.model_info(model_id).vocab_size
    samples = make_samples(lengths, seed=0, vocab=vocab)
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:
        snapshot_dir = Path(root) / "state"
        full_weight_step(engine, samples, snapshot_dir, 0)  # warm-up, and the first snapshot
        size = sum(p.stat().st_size for p in snapshot_dir.iterdir())
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for index in range(steps):
            for on in (False, True) if index % 2 == 0 else (True, False):
                runs[on].append(full_weight_step(engine, samples, snapshot_dir if on else None, 0))
        loads = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.restore_session("f", "s", snapshot_dir, version=0)
            loads.append(time.perf_counter() - start)
    off = statistics.median(t for t, _ in runs[False]) * 1e3
    on = statistics.median(t for t, _ in runs[True]) * 1e3
    snapshot = statistics.median(s for _, s in runs[True]) * 1e3
    print(
        f"\n{name}: full weight, {len(lengths)} samples, {sum(lengths)} tokens; snapshot on disk"
        f" {size / 2**20:.1f} MiB, written in {snapshot:.1f} ms, loaded in"
        f" {statistics.median(loads) * 1e3:.1f} ms"
    )
    print(f"{'snapshot every':<18}{'off (ms)':>10}{'on (ms)':>10}{'ratio':>8}")
    print(f"{'1 step':<18}{off:>10.1f}{on:>10.1f}{on / off:>8.2f}")
    for n in every:
        amortized = off + snapshot / n
        print(f"{f'{n} steps':<18}{off:>10.1f}{amortized:>10.1f}{amortized / off:>8.2f}")


def restart_to_serving(sessions: int) -> None:
    """`kill -9` of a server with `sessions` live LoRA sessions (each one step trained), then
    seconds from the restart command until every session answers a forward again."""
    import socket
    import subprocess

    import httpx
    from together.post_training import ModelResourcesClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    sample = {
        "model_input": {"chunks": [{"encoded_text": {"tokens": [1, 40, 41, 42, 50]}}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [40, 41, 42, 50, 60], "dtype": "int64"},
            "weights": {"data": [1.0] * 5, "dtype": "float32"},
        },
    }
    ce = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
    with tempfile.TemporaryDirectory() as data:
        command = [sys.executable, "-m", "posttrain", "serve", "--port", str(port)]
        command += ["--data-dir", data, "--device", "cpu", "--poll-hold-seconds", "0"]

        def start() -> subprocess.Popen:
            process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        return process
                except httpx.HTTPError:
                    time.sleep(0.05)

        process = start()
        resources = ModelResourcesClient.create(
            base_url=base, api_key="k", base_model=BUILTIN_MODEL_ID, interval=0.1
        )
        clients = [
            resources.create_session(interval=0.1, lora_config={"rank": 32})
            for _ in range(sessions)
        ]
        for client in clients:
            client.trainer.forward_backward(samples=[sample], loss=ce, interval=0.05)
            client.trainer.optim_step(interval=0.05)
        process.kill()
        process.wait()
        began = time.perf_counter()
        process = start()
        listening = time.perf_counter() - began
        for client in clients:
            client.trainer.forward(samples=[sample], loss=ce, interval=0.05)
        serving = time.perf_counter() - began
        process.terminate()
        process.wait()
    print(
        f"\nrestart after kill -9 with {sessions} live LoRA sessions (rank 32, built-in model):"
        f" listening after {listening:.1f} s, every session served a forward after {serving:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, the built-in only")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 7)
    print(f"torch threads: {torch.get_num_threads()}; medians of {steps} steps per variant")
    measure("built-in tiny-qwen3", BUILTIN_MODEL_ID, BUILTIN_MODEL_DIR, 32, [64] * 8, steps)
    every = (10,) if args.quick else (5, 10, 20)
    measure_full_weight(
        "built-in tiny-qwen3", BUILTIN_MODEL_ID, BUILTIN_MODEL_DIR, [64] * 8, steps, every
    )
    if not args.quick:
        with tempfile.TemporaryDirectory() as directory:
            write_model(Path(directory))
            measure("qwen3-40m", MODEL_ID, Path(directory), 32, [256] * 8, steps)
        restart_to_serving(8)


if __name__ == "__main__":
    main()
