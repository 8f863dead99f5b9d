"""Memory pressure: an operation within the API bounds that cannot fit in memory fails
RESOURCE_EXHAUSTED before it runs, the server keeps serving, and the session's state is
unchanged. Once under an address-space limit (RLIMIT_AS, so an allocation past it fails instead
of meeting the kernel's OOM killer) and once under --memory-limit with no rlimit, where the
estimate must refuse it (the message says the estimate and what was free).

The big operations: a sample of 4096 sequences x 500 tokens (the tiny model's KV cache alone is
8 GiB) and a forward-backward of 256 samples x 511 tokens (its activations about 12 GiB); both
are inside the API's bounds (max_sequences, max_operation_tokens, max_batch_size)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ServerProcess
from helpers import open_session, sft_sample
from together.post_training._operations import OperationFailedError

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
FAST = 0.05
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80]
PROMPT = {"chunks": [{"encoded_text": {"tokens": TOKENS[:4]}}]}
GREEDY = {"max_tokens": 6, "temperature": 0.0}
GIB = 1 << 30
# Room above what a server that imported everything reserves: the model, the worker and HTTP
# threads' stacks and malloc arenas, and the normal operations of the test.
ADDRESS_SPACE_ROOM = 3 * GIB

VM_PEAK = """
import resource
import posttrain.api.app, posttrain.engine.hosts.in_process, together  # a server imports these
for line in open("/proc/self/status"):
    if line.startswith("VmPeak:"):
        print(int(line.split()[1]) * 1024)
"""


def imported_vm_peak() -> int:
    """Address space a process reserves by importing torch, transformers and the server."""
    done = subprocess.run([sys.executable, "-c", VM_PEAK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def state_of(session) -> tuple[list[float], list[int]]:
    """What a forward scores and a greedy sample generates: the trainer's and the generator's
    weights, observed."""
    scored = session.trainer.forward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    sample = session.generator.sample(PROMPT, num_samples=1, sampling_params=GREEDY, interval=FAST)
    return scored.loss_fn_outputs[0].tensors["logprobs"].data, list(sample.sequences[0].tokens)


def refused(call) -> str:
    with pytest.raises(OperationFailedError) as info:
        call()
    message = str(info.value)
    assert "RESOURCE_EXHAUSTED" in message, message
    return message


def exhaust_and_carry_on(base_url: str) -> list[str]:
    """Train a step, send the two big operations, check nothing changed and the session
    carries on; returns the two refusals' messages."""
    _, session = open_session(base_url, lora_config={"rank": 4, "seed": 3})
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    session.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
    before = state_of(session)
    big_sample = refused(
        lambda: session.generator.sample(
            PROMPT,
            num_samples=4096,
            sampling_params={"max_tokens": 500, "temperature": 1.0},
            interval=FAST,
        )
    )
    long = [1 + t % 90 for t in range(512)]
    big_fb = refused(
        lambda: session.trainer.forward_backward(
            samples=[sft_sample(long, 2)] * 256, loss=CE, interval=FAST
        )
    )
    assert state_of(session) == before
    # The accumulated gradient survived: the step takes the session where a twin goes that
    # never saw the big operations.
    session.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    _, twin = open_session(base_url, lora_config={"rank": 4, "seed": 3})
    for _ in range(2):
        twin.trainer.forward_backward(samples=[sft_sample(TOKENS, 2)], loss=CE, interval=FAST)
        twin.trainer.optim_step(adam_params={"learning_rate": 1e-2}, interval=FAST)
    assert state_of(session) == state_of(twin)
    return [big_sample, big_fb]


def test_operations_past_an_address_space_limit_fail_resource_exhausted(tmp_path: Path):
    limit = imported_vm_peak() + ADDRESS_SPACE_ROOM
    proc = ServerProcess(
        tmp_path / "data", tmp_path / "server.log", ("--poll-hold-seconds", "0"), limit
    )
    proc.start()
    try:
        messages = exhaust_and_carry_on(proc.base_url)
        assert proc.process is not None and proc.process.poll() is None  # still serving
    finally:
        print(proc.log()[-4000:])
        proc.stop()
    for message in messages:  # refused by the estimate, or by the allocator at the limit
        assert "RLIMIT_AS" in message or "allocate" in message, message


def test_operations_over_the_memory_limit_are_refused_by_the_estimate(tmp_path: Path):
    proc = ServerProcess.started(tmp_path, "--poll-hold-seconds", "0", "--memory-limit", "2GiB")
    try:
        messages = exhaust_and_carry_on(proc.base_url)
    finally:
        proc.stop()
    for message in messages:
        assert "would need an estimated" in message, message
        assert f"free (memory_limit {2 * GIB})" in message, message
