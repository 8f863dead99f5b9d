"""Adapter and merged exports of every family: PEFT's key layout, adapters that PEFT loads and
merged models (fused projections and MoE experts included) that reproduce the adapter-applied
model and the engine's logprobs in PEFT and in plain transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from posttrain.config import EngineConfig
from posttrain.engine.checkpoint import formats as weights
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    TrainingSample,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
import families  # noqa: E402
from families import FAMILIES  # noqa: E402

TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
LORA = LoraConfig(rank=4, alpha=8, seed=1)


def save_adapter(lora: LoraModel, tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    directory.mkdir()
    weights.save_peft_adapter(
        directory,
        tensors,
        lora=LORA,
        base_model="base",
        target_modules=weights.peft_target_modules(lora, {n.rsplit(".", 1)[0] for n in tensors}),
    )
    return directory


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_export_equals_the_adapter_applied_model(tmp_path, family):
    base_dir = families.build(family, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    lora = LoraModel(model)
    named = lora.add_adapter("a", AdapterSpec(4, 8, 0.0, seed=5, train_unembed=True))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in named:
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    adapter_dir = save_adapter(lora, lora.adapter_state("a"), tmp_path / "adapter")
    weights.export_merged(base_dir, adapter_dir, tmp_path / "merged")
    with torch.no_grad(), lora.route([("a", None)]):
        adapted = model(input_ids=TOKENS).logits
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=TOKENS).logits, adapted, rtol=0, atol=1e-5)
        assert (plain(input_ids=TOKENS).logits - adapted).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt_neox"])
def test_adapter_export_follows_peft_naming(tmp_path, family):
    base_dir = families.build(family, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    modules = dict(model.named_modules())
    lora = LoraModel(model)
    lora.add_adapter("a", AdapterSpec(4, 8, 0.0, seed=5, train_unembed=False))
    adapter_dir = save_adapter(lora, lora.adapter_state("a"), tmp_path / "adapter")
    keys = load_file(str(adapter_dir / weights.PEFT_WEIGHTS_FILE))
    for key, value in keys.items():
        assert key.startswith("base_model.model.") and key.endswith(
            (".lora_A.weight", ".lora_B.weight")
        )
        module = modules[key[len("base_model.model.") :].rsplit(".", 2)[0]]
        expected = (4, module.in_features) if ".lora_A." in key else (module.out_features, 4)
        assert tuple(value.shape) == expected, key
    config = (adapter_dir / weights.PEFT_CONFIG_FILE).read_text()
    fused = {"phi3": "qkv_proj", "gpt_neox": "query_key_value", "llama": "q_proj"}[family]
    assert f'"{fused}"' in config


def ce_request(tokens: list[int], *, forward_only: bool = False) -> ForwardBackwardRequest:
    sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    return ForwardBackwardRequest(
        (sample,),
        LossConfig(LossType.CROSS_ENTROPY),
        forward_only=forward_only,
        return_loss_fn_outputs=forward_only,
    )


def target_logprobs(logits_BTV: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_BTV.float(), dim=-1)[0].gather(-1, TOKENS[0, 1:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_reproduces_the_engines_logprobs(tmp_path, family):
    """A session trained 3 steps: its merged export in plain transformers, and its adapter
    export in PEFT (PeftModel.from_pretrained over the base, fused experts included), score
    like the engine."""
    from peft import PeftModel

    base_dir = families.build(family, tmp_path / "base")
    engine = LocalEngine(EngineConfig(device="cpu"), {family: base_dir})
    engine.load_resource("r", family, muon_scaling=None)
    engine.create_session("r", "a", LORA)
    tokens = TOKENS[0].tolist()
    for _ in range(3):
        forward_backward(engine, "r", "a", ce_request(tokens))
        engine.optim_step("r", "a", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    scored = forward_backward(engine, "r", "a", ce_request(tokens, forward_only=True))
    engine_logprobs = torch.tensor(scored.loss_fn_outputs[0])
    (tmp_path / "adapter").mkdir()
    engine.save_adapter("r", "a", tmp_path / "adapter", lora=LORA, base_model=family)
    engine.export_merged(family, tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        logits = merged(input_ids=TOKENS[:, :-1]).logits.float()
    torch.testing.assert_close(engine_logprobs, target_logprobs(logits), rtol=0, atol=1e-5)

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = target_logprobs(base(input_ids=TOKENS[:, :-1]).logits)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        adapted = target_logprobs(peft_model(input_ids=TOKENS[:, :-1]).logits)
    torch.testing.assert_close(adapted, engine_logprobs, rtol=0, atol=1e-5)
    assert (plain - engine_logprobs).abs().max() > 1e-3  # PEFT applied the adapter


def test_expert_adapters_export_as_peft_target_parameters(tmp_path):
    base_dir = families.build("qwen3_moe", tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraModel(model)
    named = lora.add_adapter("a", AdapterSpec(4, 8, 0.0, seed=5, train_unembed=False))
    with torch.no_grad():
        for name, p in named:
            if name.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    state = lora.adapter_state("a")
    adapter_dir = save_adapter(lora, state, tmp_path / "adapter")
    config = json.loads((adapter_dir / weights.PEFT_CONFIG_FILE).read_text())
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert config["target_parameters"] == sorted(
        f"{m}.{p}" for m in experts for p in ("gate_up_proj", "down_proj")
    )
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    keys = load_file(str(adapter_dir / weights.PEFT_WEIGHTS_FILE))
    scale = 2.0
    for parameter, key_prefix in (
        ("gate_up_proj", f"base_model.model.{experts[0]}.base_layer"),
        ("down_proj", f"base_model.model.{experts[0]}"),
    ):
        weight = lora.layers[f"{experts[0]}.{parameter}"].weight  # [E, d1, d2]
        num_experts, d1, d2 = weight.shape
        peft_A, peft_B = keys[f"{key_prefix}.lora_A.weight"], keys[f"{key_prefix}.lora_B.weight"]
        assert peft_A.shape == (4 * num_experts, d2) and peft_B.shape == (d1, 4 * num_experts)
        # PEFT's ParamWrapper.get_delta_weight for [E, out, in] experts, written out.
        peft_delta = torch.einsum(
            "o r e, e r i -> e o i",
            peft_B.reshape(d1, -1, num_experts),
            peft_A.reshape(num_experts, -1, d2),
        )
        ours = state[f"{experts[0]}.{parameter}.lora_B"] @ state[f"{experts[0]}.{parameter}.lora_A"]
        torch.testing.assert_close(scale * peft_delta, scale * ours, rtol=1e-6, atol=1e-7)
    loaded, loaded_scale = weights.load_peft_adapter(adapter_dir)
    assert loaded_scale == scale and loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)
