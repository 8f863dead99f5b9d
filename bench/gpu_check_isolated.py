"""The sections of bench/gpu_check.py that run in a child process under a time limit: what
may compile for minutes, hang or claim most of the device (transformers `generate` with a
static cache, which on CUDA compiles its decode step with torch.compile "reduce-overhead";
the optional FSDP2 and vLLM sections that bench/gpu_fsdp2.py and bench/gpu_vllm.py provide).
A child that fails, runs out of time or is absent costs its own numbers only: the report says
`skipped: <reason>` and the other sections keep theirs. Its process group is killed on a
timeout, so no grandchild (a vLLM engine core) keeps the device.

    python bench/gpu_check_isolated.py MODULE:FUNCTION '[positional, arguments]'

prints the function's dict as JSON on a line starting with RESULT."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

RESULT = "GPU_CHECK_RESULT "
LOG_TAIL = 3000  # characters of a child's stderr echoed into the run's log


def run_child(target: str, arguments: list, timeout: float) -> dict:
    """`target` (MODULE:FUNCTION of bench/) called with `arguments` in a child process; its
    dict. Raises TimeoutError or RuntimeError (with the child's last words)."""
    child = subprocess.Popen(
        [sys.executable, __file__, target, json.dumps(arguments)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, err = child.communicate()
        sys.stderr.write(f"[{target}, killed at {timeout:.0f} s] {err[-LOG_TAIL:]}\n")
        raise TimeoutError(f"timed out after {timeout:.0f} s") from None
    finally:  # the child and whatever it left running in its group (a vLLM engine core)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    sys.stderr.write(f"[{target}] {err[-LOG_TAIL:]}\n")
    results = [line for line in out.splitlines() if line.startswith(RESULT)]
    if child.returncode != 0 or not results:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"exit {child.returncode}: {last[:300]}")
    return json.loads(results[-1][len(RESULT) :])


def optional_section(
    module: str, calls: list[tuple[str, list, dict]], timeout: float, needs: str | None = None
) -> dict | str:
    """In a child, the first of `calls` (function name, positional and keyword arguments) that
    bench/<module>.py defines: its dict, or `skipped: <reason>` when the module is absent,
    `needs` is not installed, time is short, or the call fails or returns no dict."""
    if importlib.util.find_spec(module) is None:
        return f"skipped: bench/{module}.py is absent"
    if needs is not None and importlib.util.find_spec(needs) is None:
        return f"skipped: {needs} is not installed"
    if timeout < 10:
        return f"skipped: {timeout:.0f} s of the time budget left"
    try:
        name, result = run_child("gpu_check_isolated:call_first", [module, calls], timeout)
    except Exception as exc:  # noqa: BLE001  (any failure is this section's own)
        return f"skipped: {type(exc).__name__}: {exc}"
    if not isinstance(result, dict):
        return f"skipped: {name}() returned {type(result).__name__}, not a dict"
    return result


def call_first(module_name: str, calls: list[tuple[str, list, dict]]) -> tuple[str, object]:
    """(name, result) of the first of `calls` that the module defines (in the child)."""
    module = importlib.import_module(module_name)
    for name, args, kwargs in calls:
        function = getattr(module, name, None)
        if callable(function):
            return name, function(*args, **kwargs)
    names = ", ".join(name for name, _, _ in calls)
    raise AttributeError(f"bench/{module_name}.py defines none of {names}")


def static_section(arguments: list, timeout: float) -> dict | str:
    """static_generate(*arguments) in a child within `timeout` seconds; where the compiled run
    fails at once (no compiler, a graph break that raises), the eager static-cache run in the
    time left, with the compile error in the result."""
    start = time.perf_counter()
    try:
        return run_child("gpu_check_isolated:static_generate", arguments, timeout)
    except TimeoutError as exc:
        return f"skipped: TimeoutError: {exc}"
    except Exception as exc:  # noqa: BLE001
        failure = f"{type(exc).__name__}: {exc}"
        left = timeout - (time.perf_counter() - start)
        if not arguments[-1] or left < 10:
            return f"skipped: {failure}"
    try:
        result = run_child("gpu_check_isolated:static_generate", [*arguments[:-1], False], left)
    except Exception as exc:  # noqa: BLE001
        return f"skipped: {failure}; eager: {type(exc).__name__}: {exc}"
    return result | {"generate_static_compile_error": failure[:300]}


def static_generate(
    directory: str,
    device_name: str,
    dtype_name: str,
    shape: list[int],
    repeats: int,
    compiled: bool,
) -> dict:
    """transformers `generate` with `cache_implementation="static"` on the plain
    Qwen3ForCausalLM (base weights: a merged adapter costs the same), sampling the RL shape
    (prompts, prompt tokens, samples, new tokens). On CUDA transformers compiles the decode
    step ("reduce-overhead": CUDA graphs) unless `compiled` is False; the first call, which
    compiles, is reported apart from the median of `repeats` calls after it."""
    import torch
    from gpu_check_common import count_generated, seconds
    from transformers import Qwen3ForCausalLM

    device = torch.device(device_name)
    prompts, prompt_tokens, samples, new_tokens = shape
    dtype = getattr(torch, dtype_name)
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=dtype, use_kernels=False)
    model = model.to(device).eval()
    generator = torch.Generator().manual_seed(17)
    vocab = model.config.vocab_size

    @torch.no_grad()
    def call() -> int:
        ids = torch.randint(3, vocab, (prompts, prompt_tokens), generator=generator)
        ids = ids.repeat_interleave(samples, 0).to(device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            eos_token_id=0,
            pad_token_id=0,
            cache_implementation="static",
            disable_compile=not compiled,
        )
        return count_generated(out[:, ids.shape[1] :].tolist(), 0)

    first_s, _ = seconds(call, device)
    rates = []
    for _ in range(repeats):
        elapsed, tokens = seconds(call, device)
        rates.append(tokens / elapsed)
    return {
        "generate_static_tokens_per_s": statistics.median(rates),
        "generate_static_first_call_s": first_s,
        "generate_static_compiled": compiled and device.type == "cuda",
    }


if __name__ == "__main__":
    module_name, function = sys.argv[1].split(":")
    result = getattr(importlib.import_module(module_name), function)(*json.loads(sys.argv[2]))
    print(RESULT + json.dumps(result), flush=True)
