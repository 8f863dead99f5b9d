"""What the sections of bench/gpu_check.py share: the model shapes, building the random model,
timing on a device (synchronised), training samples and prompts, and the FLOPs and peak of a
forward-backward. Owns no measurement itself."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LossConfig,
    LossType,
    TrainingSample,
)

# isort: split
from sampling import RANDOM_CONFIGS  # bench/ is the running script's folder

CE = LossConfig(LossType.CROSS_ENTROPY)
QWEN3_0_6B = {**RANDOM_CONFIGS["qwen3-0.5b"], "rope_theta": 1e6}  # Qwen3-0.6B's shape
SMALL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=True,
)
# Dense bfloat16 peak TFLOP/s by device-name fragment (vendor data sheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def build_model(directory: Path, config: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A random Qwen3 saved in HF format with the built-in tokenizer (EOS 0)."""
    torch.manual_seed(0)
    with device:  # initialise on the device: a 0.6B model initialises slowly on a CPU
        model = Qwen3ForCausalLM(
            Qwen3Config(**config, max_position_embeddings=4096, eos_token_id=0, pad_token_id=0)
        ).to(dtype)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(directory)


@contextmanager
def switched(module: object, **values: object) -> Iterator[None]:
    """A module's switches (the sampler's STATIC_DECODE, CUDA_GRAPHS, block steps, ...) set
    inside the block and restored after it, however it ends."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """(seconds, result) of one synchronised call."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `repeats` calls (after the caller's warm-up)."""
    return statistics.median(seconds(fn, device)[0] for _ in range(repeats))


def peak_memory_gib(device: torch.device) -> float | None:
    """The device's allocation peak since the last reset_peak(), GiB (None off CUDA)."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def random_tokens(generator: torch.Generator, length: int, vocab: int) -> tuple[int, ...]:
    """Random ids past the special ones (EOS and pad are 0)."""
    return tuple(torch.randint(3, vocab, (length,), generator=generator).tolist())


def ce_sample(generator: torch.Generator, length: int, vocab: int) -> TrainingSample:
    tokens = random_tokens(generator, length + 1, vocab)
    return TrainingSample(
        tokens[:-1],
        {"target_tokens": tuple(float(t) for t in tokens[1:]), "weights": (1.0,) * length},
    )


def one_pass(
    engine: LocalEngine, request: ForwardBackwardRequest, resource: str = "r", session: str = "s0"
) -> ForwardBackwardResult:
    (outcome,) = engine.forward_backward_batch(resource, [(session, request)])
    assert not isinstance(outcome, Exception), outcome
    return outcome


def rl_prompts(args, vocab: int, generator: torch.Generator) -> list[tuple[int, ...]]:
    return [random_tokens(generator, args.prompt_tokens, vocab) for _ in range(args.prompts)]


def count_generated(rows: list[list[int]], eos: int) -> int:
    """Tokens each row generated, up to and including its first EOS."""
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def device_peak_tflops(args, device: torch.device) -> float | None:
    """--peak-tflops, else the table's value for the CUDA device's name (None off CUDA)."""
    if args.peak_tflops is not None or device.type != "cuda":
        return args.peak_tflops
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def fb_flops(
    config: dict, base: int, lora: int, rows: int, length: int, *, full_weight: bool
) -> tuple[float, float]:
    """(FLOPs of the work a forward-backward does, FLOPs by the 6N convention) on rows x length
    tokens. Matmul parameters: forward 2 per token, input gradients 2, weight gradients 2 (only
    for what trains: all of `base` for a full-weight step, the `lora` adapter's otherwise);
    causal attention 6 x layers x rows x length^2 x heads x head_dim (half of 12)."""
    tokens = rows * length
    attention = 6 * config["num_hidden_layers"] * rows * length * length
    attention *= config["num_attention_heads"] * config["head_dim"]
    work = (6 if full_weight else 4) * base * tokens + 6 * lora * tokens + attention
    return float(work), float(6 * base * tokens + attention)


def matmul_parameters(model: torch.nn.Module) -> int:
    """Base weights that enter a matrix product per token, the (tied) head included once;
    works on a plain Hugging Face model and on one wrapped by model/lora.py (or PEFT)."""
    base = 0
    for name, parameter in model.named_parameters():
        if "lora_" not in name and parameter.dim() == 2 and "embed_tokens" not in name:
            base += parameter.numel()
    head = model.get_output_embeddings()
    head = getattr(head, "base", getattr(head, "base_layer", head))  # posttrain / PEFT wrappers
    if head.weight is model.get_input_embeddings().weight:  # tied: the head still multiplies
        base += head.weight.numel()
    return base
