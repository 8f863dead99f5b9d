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


class ForwardBackward:
    """One --fb-rows x --fb-tokens batch and its FLOPs; each variant is its own gpu_check
    section (fb_lora, fb_full, fb_transformers), so one failing keeps the others' numbers."""

    def __init__(self, engine: LocalEngine, config: dict, args, device, dtype, generator, vocab):
        self.engine, self.args, self.device, self.dtype = engine, args, device, dtype
        rows, length = args.fb_rows, args.fb_tokens
        self.samples = tuple(ce_sample(generator, length, vocab) for _ in range(rows))
        self.tokens = rows * length
        resource, session = engine._session("r", "s0")
        self.base = matmul_parameters(resource.loaded.model)
        self.lora = sum(p.numel() for _, p in resource.lora.adapter_parameters(session.trainer_key))
        self.lora_flops, self.lora_flops_6n = fb_flops(
            config, self.base, self.lora, rows, length, full_weight=False
        )
        self.full_flops, _ = fb_flops(config, self.base, 0, rows, length, full_weight=True)
        self.peak = device_peak_tflops(args, device)

    def counts(self) -> dict:
        return {
            "fb_tokens": self.tokens,
            "fb_shape": f"{self.args.fb_rows} x {self.args.fb_tokens} tokens",
            "fb_matmul_parameters": self.base,
            "fb_lora_parameters": self.lora,
            "peak_tflops": self.peak,
        }

    def posttrain_lora(self) -> dict:
        """posttrain LoRA r32 (resource r, session s0): the keys without a variant in their
        name, as before the full-weight row."""
        request = ForwardBackwardRequest(self.samples, CE)
        seconds, memory = _posttrain(self.engine, "r", "s0", request, self.args, self.device)
        rates = _rates("fb", seconds, self.tokens, self.lora_flops, self.peak, memory)
        rates["mfu"] = rates.pop("fb_mfu")
        peak = None if self.peak is None else self.peak * 1e12
        rates["mfu_6n"] = None if peak is None else self.lora_flops_6n / seconds / peak
        return self.counts() | rates

    def posttrain_full(self) -> dict:
        """posttrain full weight (resource f, session fw)."""
        request = ForwardBackwardRequest(self.samples, CE)
        seconds, memory = _posttrain(self.engine, "f", "fw", request, self.args, self.device)
        return _rates("fb_full", seconds, self.tokens, self.full_flops, self.peak, memory)

    def transformers(self, directory: Path) -> dict:
        """transformers full weight on the model from_pretrained, then PEFT LoRA r32 on it
        (posttrain's own adapter wrapper where peft is not installed)."""
        report: dict[str, object] = {}
        args, device = self.args, self.device
        ids = torch.tensor([s.tokens for s in self.samples], device=device)
        # use_kernels=False: plain transformers; its Hub kernels are fetched online at train()
        model = Qwen3ForCausalLM.from_pretrained(directory, dtype=self.dtype, use_kernels=False)
        model = model.to(device).train()
        try:
            seconds, memory = _transformers(model, ids, args, device)
            flops = self.full_flops
            report.update(
                _rates("transformers_fb_full", seconds, self.tokens, flops, self.peak, memory)
            )
            try:
                adapted, report["transformers_fb_lora_impl"] = _peft(model, 32, 64)
                seconds, memory = _transformers(adapted, ids, args, device)
            except ImportError:  # no PEFT: transformers' forward through posttrain's adapter
                report["transformers_fb_lora_impl"] = "posttrain's LoRA wrapper (no peft)"
                with self.engine.trainer_model("r", "s0") as wrapped:
                    seconds, memory = _transformers(wrapped, ids, args, device)
                    self.engine.discard_gradients("r", "s0")
            flops = self.lora_flops
            report.update(
                _rates("transformers_fb_lora", seconds, self.tokens, flops, self.peak, memory)
            )
        finally:
            del model
            reset_peak(device)
        return report


def fb_ratios(report: dict) -> dict:
    """posttrain / transformers tokens/s, for each variant both sides measured."""
    ratios = {}
    for variant, ours in (("full", "fb_full_seconds"), ("lora", "fb_seconds")):
        theirs = f"transformers_fb_{variant}_seconds"
        if ours in report and theirs in report:
            ratios[f"fb_{variant}_over_transformers"] = report[theirs] / report[ours]
    return ratios
