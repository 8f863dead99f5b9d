"""LoRA: B = 0 equals the base model; per-row routing applies each adapter to its rows only."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.model.lora import AdapterSpec, LoraLinear, LoraModel

SPEC = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=True)


def fresh_model():
    model = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    model.eval()
    return model


def test_fresh_adapter_with_zero_b_equals_the_base_model():
    model = fresh_model()
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        base = model(input_ids=tokens).logits
    lora = LoraModel(model)
    lora.add_adapter("a", SPEC)
    with torch.no_grad(), lora.route([("a", None)]):
        adapted = model(input_ids=tokens).logits
    torch.testing.assert_close(adapted, base, rtol=0, atol=0)


def test_adapters_cover_attention_mlp_and_head_and_respect_train_unembed():
    lora = LoraModel(fresh_model())
    names = {name for name, _ in lora.add_adapter("a", SPEC)}
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.self_attn.{projection}.lora_A" in names or (
            f"model.layers.0.mlp.{projection}.lora_A" in names
        ), projection
    assert "lm_head.lora_A" in names
    no_head = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=False)
    assert "lm_head.lora_A" not in {name for name, _ in lora.add_adapter("b", no_head)}


def test_row_routing_matches_running_each_adapter_alone():
    model = fresh_model()
    lora = LoraModel(model)
    for key, seed in (("a", 1), ("b", 2)):
        params = lora.add_adapter(key, AdapterSpec(4, 8, 0.0, seed, True))
        with torch.no_grad():
            for _, p in params:  # non-zero B so adapters differ from the base and each other
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    with torch.no_grad():
        with lora.route([("a", None)]):
            all_a = model(input_ids=tokens).logits
        with lora.route([("b", None)]):
            all_b = model(input_ids=tokens).logits
        base = model(input_ids=tokens).logits
        rows = [("a", torch.tensor([0, 2])), ("b", torch.tensor([1]))]
        with lora.route(rows):
            mixed = model(input_ids=tokens).logits
    torch.testing.assert_close(mixed[[0, 2]], all_a[[0, 2]])
    torch.testing.assert_close(mixed[1], all_b[1])
    assert not torch.allclose(all_a, base) and not torch.allclose(all_b, base)


def test_copy_adapter_is_an_independent_snapshot():
    lora = LoraModel(fresh_model())
    params = dict(lora.add_adapter("train", SPEC))
    lora.copy_adapter("train", "gen")
    with torch.no_grad():
        params["lm_head.lora_B"].add_(1.0)
    snapshot = lora.adapter_state("gen")
    assert float(snapshot["lm_head.lora_B"].abs().sum()) == 0.0
    assert not snapshot["lm_head.lora_A"].requires_grad


def test_route_blocks_nest_and_adapts_reports_the_head():
    lora = LoraModel(fresh_model())
    lora.add_adapter("a", SPEC)
    no_head = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=False)
    lora.add_adapter("b", no_head)
    head = lora.layers["lm_head"]
    outer = [("a", None)]
    with lora.route(outer):
        with lora.route([("b", None)]):
            assert not head.adapts()  # b has no head adapter
        assert head.routing is outer and head.adapts()
    assert head.routing == [] and not head.adapts()


def test_linears_inside_a_router_module_stay_frozen_and_a_wrapped_one_shows_its_base_weight():
    """HunYuan's MoE router is a `gate` module holding a Linear `wg`, whose dtype its forward
    reads through `wg.weight`: the router stays the base model's (never adapted), and a
    wrapped projection's `weight` is its frozen base weight."""
    config = AutoConfig.for_model(
        "hunyuan_v1_moe",
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        moe_topk=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        base = model(input_ids=tokens).logits
    lora = LoraModel(model)
    names = {name for name, _ in lora.add_adapter("a", SPEC)}
    mlp = model.model.layers[0].mlp
    assert type(mlp.gate.wg) is torch.nn.Linear
    assert not [name for name in names if ".gate." in name]
    assert "model.layers.0.self_attn.o_proj.lora_A" in names
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, LoraLinear) and o_proj.weight is o_proj.base.weight
    with torch.no_grad(), lora.route([("a", None)]):
        torch.testing.assert_close(model(input_ids=tokens).logits, base, rtol=0, atol=0)
