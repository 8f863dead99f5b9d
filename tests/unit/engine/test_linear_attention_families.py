"""The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 text dense and MoE; families.py's
LINEAR_ATTENTION_FAMILIES) at engine level: the trainer's logprobs are plain transformers' for
samples of different lengths in one padded batch, LoRA adapts every projection of the linear
attention layers as well as the gated attention and MLPs, the trainer's LoRA gradients equal
autograd through plain transformers with the adapters merged into its weights, LoRA training
lowers the loss; sampling with per-row recurrent states (linear_attention.py) gives the
trainer's logprobs for ragged prefills and forks; a row's state is the layers' fixed-size
conv and delta-rule states; the memory estimate counts a linear layer's activations. The
family tests (families.FAMILIES) cover the rest: greedy decode against a full recompute,
sampling parameters, two sessions, full weights, checkpoints, joins and routing replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from peft import PeftModel
from torch.func import functional_call
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.checkpoint import formats  # noqa: E402
from posttrain.engine.generate import generator  # noqa: E402
from posttrain.engine.generate.prefill import (  # noqa: E402
    PREFIX_CACHE_REFUSED_RECURRENT,
    forward_rows,
    new_cache,
)
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.memory import estimate  # noqa: E402
from posttrain.model.kv_cache import KVCache  # noqa: E402
from posttrain.model.lora import AdapterSpec, LoraModel  # noqa: E402
from posttrain.service.metrics import OperationMetrics  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OperationKind,
    OptimStepRequest,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
FAMILIES = tuple(families.LINEAR_ATTENTION_FAMILIES)
LONG = (1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20)
SHORT = (1, 44, 45, 46, 47, 48, 49)
RANK, ALPHA = 4, 8
# The linear-attention (Gated DeltaNet) projections of decoder layer 0, by family.
LINEAR_PROJECTIONS = {
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
    "qwen3_5_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "qwen3_5_moe_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("linear")
    return {f: families.build(f, root / f) for f in FAMILIES}


def engine_for(directory: Path) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=RANK, alpha=ALPHA, seed=1))
    return engine


def ce_sample(tokens: tuple[int, ...]) -> TrainingSample:
    return TrainingSample(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )


def plain_logprobs(model: torch.nn.Module, tokens: tuple[int, ...], **params) -> torch.Tensor:
    """log_softmax of plain transformers' logits at tokens[1:], `params` replacing weights."""
    inputs = torch.tensor([tokens[:-1]])
    logits = functional_call(model, params, (), {"input_ids": inputs}).logits[0]
    targets = torch.tensor(tokens[1:])[:, None]
    return torch.log_softmax(logits.float(), -1).gather(-1, targets)[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_logprobs_are_plain_transformers_for_a_padded_batch(family, family_dirs):
    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    engine = engine_for(family_dirs[family])
    request = ForwardBackwardRequest(
        (ce_sample(LONG), ce_sample(SHORT)), CE, True, return_loss_fn_outputs=True
    )
    got = forward_backward(engine, "r", "s", request).loss_fn_outputs
    with torch.no_grad():
        for tokens, row in zip((LONG, SHORT), got, strict=True):
            expected = plain_logprobs(plain, tokens)
            torch.testing.assert_close(torch.tensor(row), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_gradients_equal_autograd_through_plain_transformers(family, family_dirs):
    """After one step (adapters B nonzero), the trainer's gradients of every adapter (linear
    attention, gated attention, MLPs or experts, head) are those of plain transformers'
    forward with W + (alpha / rank) B A in place of each adapted weight."""
    engine = engine_for(family_dirs[family])
    step = OptimStepRequest(adam=AdamParams(learning_rate=1e-2))
    forward_backward(engine, "r", "s", ForwardBackwardRequest((ce_sample(LONG),), CE))
    engine.optim_step("r", "s", step)
    request = ForwardBackwardRequest((ce_sample(LONG), ce_sample(SHORT)), CE)
    forward_backward(engine, "r", "s", request)
    named = dict(engine._session("r", "s")[1].optimizer.named_params)
    got = {name: p.grad.clone() for name, p in named.items()}
    adapted = sorted({name.rsplit(".", 1)[0] for name in named})
    linear = LINEAR_PROJECTIONS[family]
    assert {f"model.layers.0.linear_attn.{p}" for p in linear} <= set(adapted)

    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    weights = dict(plain.named_parameters())
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in named.items()}
    params = {}
    for module in adapted:
        base = f"{module}.weight" if f"{module}.weight" in weights else module
        merged = leaves[f"{module}.lora_B"] @ leaves[f"{module}.lora_A"]
        params[base] = weights[base].detach() + (ALPHA / RANK) * merged
    loss = -sum(plain_logprobs(plain, tokens, **params).sum() for tokens in (LONG, SHORT))
    loss.backward()
    for name, leaf in leaves.items():
        torch.testing.assert_close(got[name], leaf.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_lowers_the_loss(family, family_dirs):
    engine = engine_for(family_dirs[family])
    request = ForwardBackwardRequest((ce_sample(LONG),), CE)
    losses = []
    for _ in range(4):
        losses.append(forward_backward(engine, "r", "s", request).loss)
        engine.optim_step("r", "s", OptimStepRequest(adam=AdamParams(learning_rate=1e-2)))
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("family", FAMILIES)
def test_sampler_logprobs_equal_a_forward_for_prompts_of_different_lengths_and_forks(
    family, family_dirs
):
    """Two prompts of different lengths prefill in one ragged pass (each row's state taken at
    its own end), three samples fork from each prompt's state, and every sampled token's
    logprob is the trainer's forward of the whole sequence within 1e-5."""
    engine = engine_for(family_dirs[family])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    results = sample(engine, "r", "s", SampleRequest((LONG, SHORT), 3, params))
    for prompt, result in zip((LONG, SHORT), results, strict=True):
        assert len({tuple(s.tokens) for s in result.sequences}) == 3
        for sequence in result.sequences:
            tokens = (*prompt, *sequence.tokens)
            request = ForwardBackwardRequest((ce_sample(tokens),), CE, True, True)
            (scored,) = forward_backward(engine, "r", "s", request).loss_fn_outputs
            torch.testing.assert_close(
                torch.tensor(sequence.logprobs),
                torch.tensor(scored[-len(sequence.tokens) :]),
                atol=1e-5,
                rtol=0,
            )


def test_a_rows_recurrent_state_is_its_layers_conv_and_delta_rule_states(family_dirs):
    """What a row holds beside the KV, whatever its length: per linear-attention layer the
    conv state (channels x (kernel - 1) in the model's dtype) and the delta rule's state
    (value heads x key dim x value dim, float32)."""
    loaded = families.load("qwen3_next", family_dirs["qwen3_next"])
    recurrent = loaded.kv.recurrent
    assert recurrent is not None
    config = loaded.model.config
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    assert recurrent.layers == (0,)
    assert loaded.kv.num_layers == 1  # KV for the attention layer only
    assert recurrent.conv_channels == channels
    assert recurrent.conv_columns == config.linear_conv_kernel_dim - 1
    delta = config.linear_num_value_heads * 8 * 8
    assert recurrent.bytes_per_row(4) == 4 * (channels * 3 + delta)
    cache = KVCache.for_model(
        loaded.kv, num_rows=3, capacity=8, dtype=torch.float32, device=torch.device("cpu")
    )
    longer = KVCache.for_model(
        loaded.kv, num_rows=3, capacity=800, dtype=torch.float32, device=torch.device("cpu")
    )
    assert cache.recurrent_bytes() == longer.recurrent_bytes() == 3 * recurrent.bytes_per_row(4)


def test_saved_activations_of_a_hybrid_are_counted(tmp_path):
    """The estimate counts what autograd saves for a hybrid's linear-attention layer (the
    chunked delta rule's float32 tensors) within the family tests' bounds."""
    size = families.Size(hidden_size=256, num_hidden_layers=2, max_position_embeddings=4096)
    extra = {"linear_key_head_dim": 32, "linear_value_head_dim": 32, "head_dim": 64}
    directory = families.build("qwen3_5_text", tmp_path / "m", size=size, extra=extra)
    engine = LocalEngine(
        EngineConfig(device="cpu", activation_checkpointing="off"), {"m": directory}
    )
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=8, seed=1))
    loaded = engine._resource("r").loaded
    weights = {p.untyped_storage().data_ptr() for p in loaded.model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rows, tokens = 2, 256
    samples = tuple(
        ce_sample(tuple(3 + (t + r) % 90 for t in range(tokens + 1))) for r in range(rows)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_backward(engine, "r", "s", ForwardBackwardRequest(samples, CE))
    shape = estimate.model_shape(loaded.model.config, loaded.kv, 4)
    assert shape.linear_layers == 1 and shape.recurrent_row_bytes > 0
    counted = estimate.saved_activation_bytes(shape, rows * tokens)
    measured = sum(saved.values())
    assert measured <= counted <= 1.6 * measured, (measured, counted)


@pytest.mark.parametrize("short", [3, 1])
def test_a_ragged_pass_takes_each_rows_state_at_its_own_end(short, family_dirs):
    """Rows appending different counts of positions in one pass (right-padded; a row of one
    position: no chunked part), then a token each: the same hidden states and recurrent
    states as each row run alone."""
    engine = engine_for(family_dirs["qwen3_5_text"])
    resource = engine._resource("r")
    generator.served(resource, engine._session("r", "s")[1])
    gm = generator.generator_model(engine.config, resource, resource.loaded.model)
    prompts, key = [LONG[:9], SHORT[:short]], "s@generator"

    def run(rows: list[tuple[int, ...]]) -> tuple[torch.Tensor, KVCache]:
        cache = new_cache(gm, len(rows), 16)
        width = max(len(r) for r in rows)
        batch_BQ = torch.tensor([[*r, *(0,) * (width - len(r))] for r in rows])
        counts = torch.tensor([len(r) for r in rows])
        with torch.no_grad():
            forward_rows(gm, cache, batch_BQ, counts, [key] * len(rows))
            next_B1 = torch.tensor([[70]] * len(rows))
            hidden = forward_rows(
                gm, cache, next_B1, torch.ones(len(rows), dtype=torch.int64), [key] * len(rows)
            )
        return hidden[:, -1], cache

    together, cache = run(prompts)
    assert cache.recurrent is not None
    for row, prompt in enumerate(prompts):
        alone, own = run([prompt])
        assert own.recurrent is not None
        torch.testing.assert_close(together[row], alone[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            cache.recurrent.delta[:, row], own.recurrent.delta[:, 0], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(cache.recurrent.conv[:, row], own.recurrent.conv[:, 0])


def test_a_hybrids_prompts_skip_the_prefix_cache_with_the_reason_counted(family_dirs):
    engine = engine_for(family_dirs["qwen3_5_text"])
    request = SampleRequest((SHORT,), 2, SamplingParams(max_tokens=3, seed=1))
    for _ in range(2):
        (result,) = sample(engine, "r", "s", request)
        assert result.prefix_cache_refused == PREFIX_CACHE_REFUSED_RECURRENT
        assert all(s.prompt_cache_hit_tokens == 0 for s in result.sequences)
    metrics = OperationMetrics()
    metrics.count_tokens(OperationKind.SAMPLE, request, SampleOutput((result, result)))
    assert metrics.prefix_cache_refusals() == [(PREFIX_CACHE_REFUSED_RECURRENT, 2)]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_an_exported_adapter_loads_in_peft_and_gives_the_same_logits(tmp_path, family):
    """The PEFT adapter of every projection (linear attention, shared expert and its gate,
    experts as target parameters) applied by peft to plain transformers gives our logits."""
    base_dir = families.build(family, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraModel(model)
    named = lora.add_adapter("a", AdapterSpec(RANK, ALPHA, 0.0, seed=5, train_unembed=False))
    with torch.no_grad():
        for name, parameter in named:
            if name.endswith("lora_B"):
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    state = lora.adapter_state("a")
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    targets = formats.peft_target_modules(lora, {n.rsplit(".", 1)[0] for n in state})
    formats.save_peft_adapter(
        adapter_dir,
        state,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, seed=5),
        base_model="base",
        target_modules=targets,
    )
    tokens = torch.tensor([LONG])
    with torch.no_grad(), lora.route([("a", None)]):
        ours = model(input_ids=tokens).logits
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        base = plain(input_ids=tokens).logits
        theirs = PeftModel.from_pretrained(plain, adapter_dir).eval()(input_ids=tokens).logits
    assert (ours - base).abs().max() > 0.1  # the adapter changes the model
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
