"""The forward-backward section of bench/gpu_check.py: posttrain's cross-entropy
forward-backward of one batch (LoRA rank 32 on the shared resource, and a full-weight session on
a resource of its own) beside a plain transformers forward-backward of the same tokens
(`model(input_ids, labels).loss.backward()` on the model loaded with from_pretrained, and with
PEFT LoRA of the same rank, alpha and target layers when peft is installed), as tokens/s and
MFU. Both sides do the same matrix products on the same tokens, so one FLOP count serves both
(gpu_check_common.fb_flops)."""

from __future__ import annotations

from pathlib import Path

import torch
from gpu_check_common import (
    CE,
    ce_sample,
    device_peak_tflops,
    fb_flops,
    matmul_parameters,
    one_pass,
    peak_memory_gib,
    reset_peak,
    timed,
)
from transformers import Qwen3ForCausalLM

from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.types import ForwardBackwardRequest

# What posttrain's LoRA adapts on a Qwen3 (model/lora.py: every linear layer of the decoder
# layers, and the head for train_unembed, the API's default).
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rates(prefix: str, seconds: float, tokens: int, flops: float, peak, memory) -> dict:
    return {
        f"{prefix}_seconds": seconds,
        f"{prefix}_tokens_per_s": tokens / seconds,
        f"{prefix}_tflops_per_s": flops / seconds / 1e12,
        f"{prefix}_mfu": None if peak is None else flops / seconds / (peak * 1e12),
        f"{prefix}_max_memory_gib": memory,
    }


def _posttrain(engine: LocalEngine, resource: str, session: str, request, args, device) -> tuple:
    def step() -> None:
        one_pass(engine, request, resource, session)
        engine.discard_gradients(resource, session)

    step()  # warm-up
    reset_peak(device)
    return timed(step, args.repeats, device), peak_memory_gib(device)


def _transformers(model: torch.nn.Module, ids: torch.Tensor, args, device) -> tuple:
    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    reset_peak(device)
    return timed(step, args.repeats, device), peak_memory_gib(device)


def _peft(model: torch.nn.Module, rank: int, alpha: int) -> tuple[torch.nn.Module, str]:
    """PEFT LoRA on the same layers as posttrain's adapter, the tied head included where PEFT
    takes it; (model, what was adapted)."""
    import peft

    for targets, said in ((PEFT_TARGETS + ["lm_head"], "layers + head"), (PEFT_TARGETS, "layers")):
        try:
            config = peft.LoraConfig(
                r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets
            )
            return peft.get_peft_model(model, config), f"peft {peft.__version__} ({said})"
        except Exception:  # noqa: BLE001  (an older PEFT refuses a tied head: adapt the layers)
            if targets == PEFT_TARGETS:
                raise
    raise AssertionError("unreachable")


def measure_forward_backward(
    engine: LocalEngine, config: dict, args, device, dtype, generator, vocab, directory: Path
) -> dict:
    """posttrain LoRA (resource r, session s0) and full weight (resource f, session fw), and
    transformers full weight and LoRA, each on the same --fb-rows x --fb-tokens batch."""
    rows, length = args.fb_rows, args.fb_tokens
    samples = tuple(ce_sample(generator, length, vocab) for _ in range(rows))
    request = ForwardBackwardRequest(samples, CE)
    tokens = rows * length
    resource, session = engine._session("r", "s0")
    base = matmul_parameters(resource.loaded.model)
    lora = sum(p.numel() for _, p in resource.lora.adapter_parameters(session.trainer_key))
    lora_flops, lora_flops_6n = fb_flops(config, base, lora, rows, length, full_weight=False)
    full_flops, _ = fb_flops(config, base, 0, rows, length, full_weight=True)
    peak = device_peak_tflops(args, device)
    report: dict[str, object] = {
        "fb_tokens": tokens,
        "fb_shape": f"{rows} x {length} tokens",
        "fb_matmul_parameters": base,
        "fb_lora_parameters": lora,
        "peak_tflops": peak,
    }
    # posttrain LoRA: the keys without a variant in their name (as before the full-weight row)
    lora_s, memory = _posttrain(engine, "r", "s0", request, args, device)
    lora_rates = _rates("fb", lora_s, tokens, lora_flops, peak, memory)
    lora_rates["mfu"] = lora_rates.pop("fb_mfu")
    lora_rates["mfu_6n"] = None if peak is None else lora_flops_6n / lora_s / (peak * 1e12)
    report.update(lora_rates)
    full_s, memory = _posttrain(engine, "f", "fw", request, args, device)
    report.update(_rates("fb_full", full_s, tokens, full_flops, peak, memory))

    ids = torch.tensor([s.tokens for s in samples], device=device)
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=dtype).to(device).train()
    try:
        hf_full_s, memory = _transformers(model, ids, args, device)
        report.update(_rates("transformers_fb_full", hf_full_s, tokens, full_flops, peak, memory))
        report["fb_full_over_transformers"] = hf_full_s / full_s
        try:
            adapted, report["transformers_fb_lora_impl"] = _peft(model, 32, 64)
            hf_lora_s, memory = _transformers(adapted, ids, args, device)
        except ImportError:  # no PEFT: transformers' forward through posttrain's own adapter
            report["transformers_fb_lora_impl"] = "posttrain's LoRA wrapper (peft not installed)"
            with engine.trainer_model("r", "s0") as wrapped:
                hf_lora_s, memory = _transformers(wrapped, ids, args, device)
                engine.discard_gradients("r", "s0")
        lora_rates = _rates("transformers_fb_lora", hf_lora_s, tokens, lora_flops, peak, memory)
        report.update(lora_rates)
        report["fb_lora_over_transformers"] = hf_lora_s / lora_s
    finally:
        del model
        reset_peak(device)
    return report
