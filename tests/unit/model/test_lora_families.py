"""LoRA on every family: adapters attach to each attention and MLP projection (fused ones and
MoE experts included, never the router or embeddings), a fresh adapter leaves logits
bit-identical, training through the engine lowers the loss, and expert adapters match an
explicit per-expert computation."""

from __future__ import annotations

import sys
from pathlib import Path

import families
import pytest
import torch
from families import FAMILIES
from torch.nn import functional as F

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    MuonParams,
    MuonScaling,
    OptimStepRequest,
    TrainingSample,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_calls import forward_backward  # noqa: E402

SPEC = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=True)
LLAMA_STYLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapted projections of decoder layer 0, by family (attention then MLP).
EXPECTED = {
    **{f: LLAMA_STYLE for f in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")},
    "gemma3_text": LLAMA_STYLE,
    **{f: LLAMA_STYLE for f in ("olmo2", "granite")},
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
    # Multi-head latent attention's latent projections; layer 0 is DeepSeek-V3's dense one.
    "deepseek_v3": (
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    # Gated DeltaNet hybrids: layer 0 is linear attention; MoE with a gated shared expert.
    "qwen3_next": (
        "in_proj_qkvz",
        "in_proj_ba",
        "out_proj",
        "gate_up_proj",
        "down_proj",
        "gate_proj",
        "up_proj",
        "shared_expert_gate",
    ),
    "qwen3_5_text": (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    "qwen3_5_moe_text": (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "gate_up_proj",
        "down_proj",
        "gate_proj",
        "up_proj",
        "shared_expert_gate",
    ),
}
TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22]])


def layer0_targets(lora: LoraModel) -> set[str]:
    prefix = next(name for name in lora.layers if ".layers.0." in name).split(".layers.0.")[0]
    return {
        name.rsplit(".", 1)[-1] for name in lora.layers if name.startswith(f"{prefix}.layers.0.")
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_attaches_to_every_projection_of_the_family(family):
    lora = LoraModel(families.model(family))
    assert layer0_targets(lora) == set(EXPECTED[family])
    assert lora.head_name == "lm_head"
    names = {name for name, _ in lora.add_adapter("a", SPEC)}
    assert "lm_head.lora_A" in names
    assert not any("embed" in name or ".gate.lora" in name for name in names)
    no_head = AdapterSpec(rank=4, alpha=8, dropout=0.0, seed=0, train_unembed=False)
    assert "lm_head.lora_A" not in {name for name, _ in lora.add_adapter("b", no_head)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fresh_adapter_leaves_logits_bit_identical(family):
    model = families.model(family)
    with torch.no_grad():
        base = model(input_ids=TOKENS).logits
    lora = LoraModel(model)
    lora.add_adapter("a", SPEC)
    with torch.no_grad():
        with lora.route([("a", None)]):
            every_row = model(input_ids=TOKENS).logits
        with lora.route([("a", torch.tensor([0, 2]))]):
            some_rows = model(input_ids=TOKENS).logits
    torch.testing.assert_close(every_row, base, rtol=0, atol=0)
    torch.testing.assert_close(some_rows, base, rtol=0, atol=0)


def ce_request(tokens: list[int]) -> ForwardBackwardRequest:
    sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    return ForwardBackwardRequest((sample,), LossConfig(LossType.CROSS_ENTROPY))


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_through_the_engine_lowers_the_loss(tmp_path, family):
    directory = families.build(family, tmp_path / family)
    engine = LocalEngine(EngineConfig(device="cpu"), {family: directory})
    engine.load_resource("r", family, muon_scaling=None)
    engine.create_session("r", "a", LoraConfig(rank=4, alpha=8, seed=1))
    request = ce_request([5, 6, 7, 8, 9, 10, 11, 12])
    losses = []
    for _ in range(4):
        losses.append(forward_backward(engine, "r", "a", request).metrics["loss:sum"])
        engine.optim_step("r", "a", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    assert losses[-1] < losses[0] - 1.0, losses


def explicit_moe_block(block, hidden_BTH, adapters_by_row):
    """The MoE block token by token: each routed expert's MLP with its weights plus
    s * B_e A_e of the token's adapter (None: base), times the router's gate weight."""
    experts = block.experts.base
    _, gate_weights, chosen = block.gate(hidden_BTH.reshape(-1, hidden_BTH.shape[-1]))
    rows, positions, _ = hidden_BTH.shape
    outputs = []
    for token in range(rows * positions):
        x = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])[token]
        adapter = adapters_by_row[token // positions]
        total = torch.zeros_like(x)
        for slot in range(chosen.shape[1]):
            e = int(chosen[token, slot])
            w_gu, w_d = experts.gate_up_proj[e], experts.down_proj[e]
            if adapter is not None:
                (a_gu, b_gu, s), (a_d, b_d, _) = adapter
                w_gu = w_gu + s * b_gu[e] @ a_gu[e]
                w_d = w_d + s * b_d[e] @ a_d[e]
            gate, up = F.linear(x, w_gu).chunk(2)
            total = total + gate_weights[token, slot] * F.linear(experts.act_fn(gate) * up, w_d)
        outputs.append(total)
    return torch.stack(outputs).reshape(hidden_BTH.shape)


# Ranks whose float32 rows are not a multiple of 16 bytes (1, 3) are padded for grouped_mm.
@pytest.mark.parametrize("rank", [4, 3, 1])
def test_expert_adapters_match_an_explicit_per_expert_computation(rank):
    model = families.model("qwen3_moe")
    lora = LoraModel(model)
    block = model.model.layers[0].mlp
    factors = {}
    for key, seed in (("a", 1), ("b", 2)):
        params = dict(lora.add_adapter(key, AdapterSpec(rank, 2 * rank, 0.0, seed, False)))
        with torch.no_grad():
            for name, p in params.items():  # non-zero B so the adapters act
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
        prefix = "model.layers.0.mlp.experts"
        factors[key] = [
            (params[f"{prefix}.{proj}.lora_A"], params[f"{prefix}.{proj}.lora_B"], 2.0)
            for proj in ("gate_up_proj", "down_proj")
        ]
    hidden = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    routing = [("a", torch.tensor([0, 2])), ("b", torch.tensor([1]))]
    with lora.route(routing):
        ours = block(hidden)
    reference = explicit_moe_block(block, hidden, [factors["a"], factors["b"], factors["a"]])
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t for key in ("a", "b") for pair in factors[key] for t in pair[:2]]
    ours_grads = torch.autograd.grad((ours * weights).sum(), leaves)
    reference_grads = torch.autograd.grad((reference * weights).sum(), leaves)
    for got, want in zip(ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert all(float(g.abs().sum()) > 0 for g in ours_grads)
    assert not any(name.endswith(".mlp.gate") for name in lora.layers)  # the router: frozen


def test_moe_sessions_in_one_shared_pass_match_each_alone(tmp_path):
    directory = families.build("qwen3_moe", tmp_path / "moe")

    def engine_with_sessions() -> LocalEngine:
        engine = LocalEngine(EngineConfig(device="cpu"), {"moe": directory})
        engine.load_resource("r", "moe", muon_scaling=None)
        for index, name in enumerate(("a", "b")):
            engine.create_session("r", name, LoraConfig(rank=4, alpha=8, seed=index))
            with torch.no_grad():  # non-zero B (experts included) so the sessions differ
                for param_name, p in engine._session("r", name)[1].optimizer.named_params:
                    if param_name.endswith("lora_B"):
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(10 + index))
        return engine

    requests = {"a": ce_request([5, 6, 7, 8, 9, 10]), "b": ce_request([20, 21, 22, 23])}
    alone_engine = engine_with_sessions()
    alone = {n: forward_backward(alone_engine, "r", n, r) for n, r in requests.items()}
    shared_engine = engine_with_sessions()
    shared = shared_engine.forward_backward_batch("r", list(requests.items()))
    for name, result in zip(requests, shared, strict=True):
        assert not isinstance(result, Exception)
        assert result.loss == pytest.approx(alone[name].loss, rel=1e-5)
        grads = {
            engine_name: {
                n: p.grad
                for n, p in engine._session("r", name)[1].optimizer.named_params
                if "experts" in n
            }
            for engine_name, engine in (("alone", alone_engine), ("shared", shared_engine))
        }
        assert grads["alone"] and grads["alone"].keys() == grads["shared"].keys()
        for key, want in grads["alone"].items():
            torch.testing.assert_close(grads["shared"][key], want, rtol=1e-4, atol=1e-7)
    assert shared[0].loss != pytest.approx(shared[1].loss)


def test_moe_lora_under_muon_updates_each_expert_and_lowers_the_loss(tmp_path):
    directory = families.build("qwen3_moe", tmp_path / "moe")
    engine = LocalEngine(EngineConfig(device="cpu"), {"moe": directory})
    engine.load_resource("r", "moe", muon_scaling=MuonScaling.MATCH_ADAM)
    engine.create_session("r", "a", LoraConfig(rank=4, alpha=8, seed=1))
    optimizer = engine._session("r", "a")[1].optimizer
    assert any("experts.gate_up_proj.lora_A" in n for n in optimizer.muon_param_names)
    request = ce_request([5, 6, 7, 8, 9, 10, 11, 12])
    losses = []
    for _ in range(4):
        losses.append(forward_backward(engine, "r", "a", request).metrics["loss:sum"])
        engine.optim_step("r", "a", OptimStepRequest(muon=MuonParams(learning_rate=1e-2)))
    assert losses[-1] < losses[0] - 1.0, losses
