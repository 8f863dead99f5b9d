"""The paper answer for one GPU (issue 44): what posttrain holds per token of one long training
sample for an 8B model, and therefore the longest sample whose forward-backward fits one 80 GB
GPU, from the engine's own memory estimate (engine/memory/estimate.py, the numbers admission
refuses by), not a measurement.

Model: Qwen3-8B's shapes (36 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN 12288,
vocabulary 151,936, untied head), built on the meta device, bfloat16 as the loader puts it on
CUDA. Per pass: `estimate.forward_backward_bytes` of one sample of T tokens (cross-entropy,
chunked log-softmax of --chunk-tokens), decoder layers checkpointed or not. Beside it, what
stays resident: the base weights, and per session (engine/memory/footprint.py) a LoRA
session's adapter, its generator copy and AdamW's two moments (the adapters made exactly as
the engine makes them, in their own dtype); a full-weight session's generator copy of the model
and two moments per weight (bfloat16, the parameters' dtype); the gradients are the pass's (in
the estimate). With `--ranks N`, full weights sharded by FSDP2 over N trainer ranks: weights,
generator copy, moments and gradients each 1/N per rank, the sample's activations on one rank.

The longest T is the largest multiple of 1024 whose resident + pass bytes fit the device
(--device-gib, 80 GB = 74.5 GiB, less --reserve-gib for the CUDA context and the allocator's
slack). Per-token bytes are the pass's slope between 16k and 32k tokens.

    python bench/context_budget.py [--device-gib 74.5] [--reserve-gib 2] [--lora-rank 32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from posttrain.engine.memory import estimate
from posttrain.model.kv_shape import KVShape
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import ForwardBackwardRequest, LossConfig, LossType, TrainingSample

GIB = 1 << 30
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
BF16 = 2


def request(tokens: int) -> ForwardBackwardRequest:
    """One cross-entropy sample of `tokens` tokens (the estimate reads only its lengths)."""
    sample = TrainingSample((0,) * tokens, {"target_tokens": (0.0,) * tokens})
    return ForwardBackwardRequest((sample,), LossConfig(LossType.CROSS_ENTROPY))


def pass_bytes(
    shape: estimate.ModelShape, tokens: int, trainable: int, chunk: int, checkpointed: bool
) -> int:
    return estimate.forward_backward_bytes(
        shape,
        [request(tokens)],
        chunk_tokens=chunk,
        trainable_bytes=[trainable],
        checkpointed=checkpointed,
    )


def longest(fits: int, cost: Callable[[int], int]) -> int:
    """The largest multiple of 1024 tokens whose cost fits `fits` bytes (0: not even 1024)."""
    low, high = 0, 1 << 10
    while cost(high * 1024) <= fits:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if cost(middle * 1024) <= fits else (low, middle)
    return low * 1024


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device-gib", type=float, default=80e9 / GIB)
    parser.add_argument("--reserve-gib", type=float, default=2.0)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=8, help="FSDP2 ranks for full weights")
    args = parser.parse_args()
    config = Qwen3Config(**QWEN3_8B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    base = parameters * BF16
    spec = AdapterSpec(args.lora_rank, 2 * args.lora_rank, 0.0, 0, False)
    adapter = sum(p.numel() * p.element_size() for _, p in LoraModel(model).add_adapter("a", spec))
    kv = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    shape = estimate.model_shape(config, kv, BF16)
    device = int((args.device_gib - args.reserve_gib) * GIB)
    print(
        f"Qwen3-8B shapes: {parameters / 1e9:.2f}B parameters, bfloat16 base {base / GIB:.2f} GiB;"
        f" device budget {device / GIB:.1f} GiB ({args.device_gib:.1f} less"
        f" {args.reserve_gib:.1f} reserved)"
    )
    setups = {
        f"LoRA rank {args.lora_rank}": (base + 4 * adapter, adapter),
        "full weights, 1 GPU": (4 * base, base),  # weights, generator copy, two moments
        f"full weights, FSDP2 / {args.ranks}": (4 * base // args.ranks, base // args.ranks),
    }
    print(f"{'setup':<24}{'resident GiB':>13}{'checkpointed':>14}{'KiB/token':>11}{'longest':>10}")
    for name, (resident, trainable) in setups.items():
        for checkpointed in (True, False):

            def cost(
                tokens: int,
                held: int = resident,
                trainable: int = trainable,
                c: bool = checkpointed,
            ) -> int:
                return held + pass_bytes(shape, tokens, trainable, args.chunk_tokens, c)

            slope = (cost(32768) - cost(16384)) / 16384
            fits = longest(device, cost)
            print(
                f"{name:<24}{resident / GIB:>13.2f}{'yes' if checkpointed else 'no':>14}"
                f"{slope / 1024:>11.0f}{fits:>10}"
            )


if __name__ == "__main__":
    main()
