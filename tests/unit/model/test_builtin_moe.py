"""The built-in MoE model (posttrain/tiny-qwen3-moe): LoRA covers every layer's experts and
never the router, and its router spreads the demo's tokens over the experts (routed-expert
replay needs choices that can change)."""

from __future__ import annotations

import torch

from posttrain.config import BUILTIN_MODELS
from posttrain.demo.task import split_problems
from posttrain.model.loader import load_model
from posttrain.model.lora import AdapterSpec, LoraModel

MOE_DIR = BUILTIN_MODELS["posttrain/tiny-qwen3-moe"]
NUM_LAYERS, NUM_EXPERTS, TOP_K = 4, 8, 2


def test_lora_on_the_moe_built_in_adapts_every_layers_experts_and_not_the_router():
    model = load_model(MOE_DIR, torch.device("cpu"), torch.float32).model
    spec = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=False)
    named = dict(LoraModel(model).add_adapter("a", spec))
    for layer in range(NUM_LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        assert named[f"{experts}.gate_up_proj.lora_A"].shape == (NUM_EXPERTS, 4, 128)
        assert named[f"{experts}.down_proj.lora_B"].shape == (NUM_EXPERTS, 128, 4)
    assert not [name for name in named if ".mlp.gate." in name]


def test_the_moe_built_in_routes_demo_lines_to_many_experts_in_every_layer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MOE_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(MOE_DIR)
    _, heldout = split_problems(seed=0, num_heldout=64)
    counts_LE = torch.zeros(NUM_LAYERS, NUM_EXPERTS)
    with torch.no_grad():
        for problem in heldout:
            ids = tokenizer.encode(f"{problem.prompt}{problem.answer}<|endoftext|>")
            output = model(input_ids=torch.tensor([ids]), output_router_logits=True)
            for layer, logits_TE in enumerate(output.router_logits):
                chosen = logits_TE.topk(TOP_K, dim=-1).indices.flatten()
                counts_LE[layer] += torch.bincount(chosen, minlength=NUM_EXPERTS)
    share_LE = counts_LE / counts_LE.sum(dim=1, keepdim=True)
    # At least five experts of every layer take 5% or more of that layer's choices.
    assert ((share_LE >= 0.05).sum(dim=1) >= 5).all(), counts_LE
