"""Checkpoint files: training state round-trips bit-exactly, the adapter is in PEFT's key
layout, and the merged model equals the adapter-applied one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.checkpoint import formats as weights
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

CE = LossConfig(LossType.CROSS_ENTROPY)
LORA = LoraConfig(rank=4, alpha=8, seed=1)
TOKENS_1T = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def ce_request(tokens: list[int], *, forward_only: bool = False) -> ForwardBackwardRequest:
    sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    return ForwardBackwardRequest((sample,), CE, forward_only=forward_only)


def step_request(muon_scaling: MuonScaling | None) -> OptimStepRequest:
    if muon_scaling is None:
        return OptimStepRequest(adam=AdamParams(learning_rate=1e-2))
    return OptimStepRequest(muon=MuonParams(learning_rate=1e-2))


def train(engine: LocalEngine, session_id: str, muon_scaling: MuonScaling | None, steps: int):
    for index in range(steps):
        forward_backward(engine, "r", session_id, ce_request([5 + index, 6, 7, 8, 9, 10]))
        engine.optim_step("r", session_id, step_request(muon_scaling))


def trainable(engine: LocalEngine, session_id: str) -> dict[str, torch.Tensor]:
    _, session = engine._session("r", session_id)
    return {name: p.detach().clone() for name, p in session.optimizer.named_params}


def make_engine(muon_scaling: MuonScaling | None) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu"), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR})
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=muon_scaling)
    return engine


@pytest.mark.parametrize("muon_scaling", [None, MuonScaling.MATCH_ADAM])
def test_training_state_round_trip_continues_bit_exactly(tmp_path, muon_scaling):
    engine = make_engine(muon_scaling)
    engine.create_session("r", "a", LORA)
    train(engine, "a", muon_scaling, 2)
    engine.save_training_state("r", "a", tmp_path)
    # Another seed: every loaded value must come from the checkpoint.
    engine.create_session("r", "b", LoraConfig(rank=4, alpha=8, seed=99))
    engine.load_training_state("r", "b", tmp_path, load_optimizer=True)
    for name, value in trainable(engine, "a").items():
        assert torch.equal(trainable(engine, "b")[name], value), name
    state_a = engine._session("r", "a")[1].optimizer.state_dict()
    state_b = engine._session("r", "b")[1].optimizer.state_dict()
    assert state_a["adam"] and bool(state_a["muon"]) == (muon_scaling is not None)
    for group, entries in state_a.items():
        assert entries.keys() == state_b[group].keys(), group
        for name, entry in entries.items():
            for key, value in entry.items():
                assert torch.equal(state_b[group][name][key], value), (group, name, key)
    train(engine, "a", muon_scaling, 2)
    train(engine, "b", muon_scaling, 2)
    after_a, after_b = trainable(engine, "a"), trainable(engine, "b")
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)
    # The resumed generator serves the loaded weights (weights-sync not needed for version 0).
    resource, session = engine._session("r", "b")
    generator = resource.lora.adapter_state(session.generator_key)
    assert generator.keys() == after_b.keys()


def test_loading_without_optimizer_state_starts_a_fresh_optimizer(tmp_path):
    engine = make_engine(None)
    engine.create_session("r", "a", LORA)
    train(engine, "a", None, 2)
    engine.save_training_state("r", "a", tmp_path)
    engine.create_session("r", "b", LoraConfig(rank=4, alpha=8, seed=99))
    engine.load_training_state("r", "b", tmp_path, load_optimizer=False)
    assert engine._session("r", "b")[1].optimizer.state_dict() == {"adam": {}, "muon": {}}
    assert all(torch.equal(trainable(engine, "b")[n], v) for n, v in trainable(engine, "a").items())


def test_loading_a_checkpoint_of_another_rank_is_rejected_and_changes_nothing(tmp_path):
    engine = make_engine(None)
    engine.create_session("r", "a", LORA)
    engine.save_training_state("r", "a", tmp_path)
    engine.create_session("r", "b", LoraConfig(rank=2, alpha=8, seed=3))
    before = trainable(engine, "b")
    with pytest.raises(ValueError, match="shape"):
        engine.load_training_state("r", "b", tmp_path, load_optimizer=True)
    assert all(torch.equal(trainable(engine, "b")[n], v) for n, v in before.items())


def test_adapter_files_use_peft_key_names_and_config(tmp_path):
    engine = make_engine(None)
    engine.create_session("r", "a", LORA)
    train(engine, "a", None, 1)
    engine.save_adapter("r", "a", tmp_path, lora=LORA, base_model=BUILTIN_MODEL_ID)
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    q_A = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    q_B = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_A.shape == (4, 128) and q_B.shape == (128, 4)  # [r, in], [out, r]
    assert "base_model.model.lm_head.lora_B.weight" in tensors
    # 4 layers x 7 projections + lm_head, an A and a B each.
    assert len(tensors) == 2 * (4 * 7 + 1)
    assert all(key.startswith("base_model.model.") and key.endswith(".weight") for key in tensors)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "lm_head",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    expected = trainable(engine, "a")
    loaded, scale = weights.load_peft_adapter(tmp_path)
    assert scale == 2.0
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[n], expected[n]) for n in expected)


def test_target_modules_fall_back_to_full_names_when_short_names_would_overmatch():
    model = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    lora = LoraModel(model)
    adapted = [name for name in lora.layers if name != "model.layers.3.self_attn.q_proj"]
    assert weights.peft_target_modules(lora, adapted) == sorted(adapted)


def adapter_with_nonzero_b(model: torch.nn.Module) -> tuple[LoraModel, dict[str, torch.Tensor]]:
    lora = LoraModel(model)
    named = lora.add_adapter("a", AdapterSpec(4, 8, 0.0, seed=5, train_unembed=True))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in named:
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return lora, lora.adapter_state("a")


def merged_matches_adapter(base_dir: Path, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    lora, tensors = adapter_with_nonzero_b(model)
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    adapter_dir.mkdir()
    weights.save_peft_adapter(
        adapter_dir,
        tensors,
        lora=LoraConfig(rank=4, alpha=8),
        base_model="base",
        target_modules=weights.peft_target_modules(lora, {n.rsplit(".", 1)[0] for n in tensors}),
    )
    weights.export_merged(base_dir, adapter_dir, merged_dir)
    with torch.no_grad(), lora.route([("a", None)]):
        adapted_logits = model(input_ids=TOKENS_1T).logits
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=TOKENS_1T).logits
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=0, atol=1e-5)
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(input_ids=TOKENS_1T).logits - adapted_logits).abs().max() > 1e-2
    return merged, merged_dir


def test_merged_model_equals_the_adapter_applied_model(tmp_path):
    _, merged_dir = merged_matches_adapter(BUILTIN_MODEL_DIR, tmp_path)
    names = {p.name for p in merged_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert all(p.is_file() for p in merged_dir.iterdir())
    assert AutoTokenizer.from_pretrained(merged_dir).encode(
        "12+34="
    ) == AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).encode("12+34=")


def test_merging_a_head_adapter_unties_tied_embeddings(tmp_path):
    config = AutoConfig.from_pretrained(BUILTIN_MODEL_DIR)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(config)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    base_dir = tmp_path / "tied-base"
    tied.save_pretrained(base_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUILTIN_MODEL_DIR / name, base_dir / name)
    work = tmp_path / "work"
    work.mkdir()
    merged, _ = merged_matches_adapter(base_dir, work)
    # The head adapter changed the head only; the input embeddings are the base model's.
    torch.testing.assert_close(
        merged.get_input_embeddings().weight, tied.get_input_embeddings().weight, rtol=0, atol=0
    )
    assert not torch.equal(
        merged.get_output_embeddings().weight, tied.get_input_embeddings().weight
    )


def test_full_weight_training_state_round_trip_continues_bit_exactly(tmp_path):
    engine = make_engine(None)
    engine.create_session("r", "a", None)  # full weights: the resource's one session
    train(engine, "a", None, 2)
    engine.save_training_state("r", "a", tmp_path)
    train(engine, "a", None, 1)
    expected = trainable(engine, "a")
    engine.drop_session("r", "a")  # restores the base weights
    engine.create_session("r", "b", None)
    engine.load_training_state("r", "b", tmp_path, load_optimizer=True)
    train(engine, "b", None, 1)
    after = trainable(engine, "b")
    assert after.keys() == expected.keys() and "lm_head.weight" in after
    assert all(torch.equal(after[n], expected[n]) for n in expected)


def test_full_weight_model_export_holds_the_trained_parameters(tmp_path):
    engine = make_engine(None)
    engine.create_session("r", "a", None)
    train(engine, "a", None, 1)
    engine.save_full_model("r", "a", tmp_path / "model", base_model=BUILTIN_MODEL_ID)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    loaded = dict(saved.named_parameters())
    trained = trainable(engine, "a")
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n].detach(), trained[n]) for n in trained)
    assert (tmp_path / "model" / "tokenizer.json").is_file()
