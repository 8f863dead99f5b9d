"""Every operation on every decoder family (tests/unit/model/families.py) at engine level, beyond
the parity tests (test_family_parity.py):

- custom forward-backward is cross-entropy with weights -g;
- two sessions in one shared forward pass, and in one generation, get what each gets alone;
- Muon leaves every family's embeddings and head to AdamW, and trains full weights;
- full-weight sessions train, a publish while a generation runs (a PIPELINE weights-sync)
  switches it to the trained weights, and the session's end restores the base weights;
- training checkpoints of LoRA and full-weight sessions resume exactly, a LoRA inference
  checkpoint resumes the weights, and a full-weight export is the trained model;
- every sampling parameter (seed, top_k, top_p, stop, prompt_logprobs, topk_prompt_logprobs)
  holds against plain transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward, sample
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
import families  # noqa: E402

from posttrain.config import EngineConfig  # noqa: E402
from posttrain.engine.hosts.in_process import LocalEngine  # noqa: E402
from posttrain.engine.optim.muon import is_muon_param  # noqa: E402
from posttrain.types import (  # noqa: E402
    AdamParams,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    MuonParams,
    MuonScaling,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    StopReason,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
TOKENS = (1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20)
PROMPT = TOKENS[:9]  # longer than the sliding windows
STEP = OptimStepRequest(adam=AdamParams(learning_rate=1e-2, weight_decay=0.0))
LORA = LoraConfig(rank=4, alpha=8, seed=1)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
ALL = list(families.FAMILIES)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: families.build(f, root / f) for f in families.FAMILIES}


def engine_for(directory: Path, lora: LoraConfig | None) -> LocalEngine:
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", lora)
    return engine


def ce_sample(tokens: tuple[int, ...]) -> TrainingSample:
    return TrainingSample(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )


def scored(engine: LocalEngine, tokens: tuple[int, ...]) -> tuple[float, list[float]]:
    """forward_only: the loss and the per-token logprobs of tokens[1:]."""
    request = ForwardBackwardRequest((ce_sample(tokens),), CE, True, return_loss_fn_outputs=True)
    result = forward_backward(engine, "r", "s", request)
    return result.loss, result.loss_fn_outputs[0]


def train(engine: LocalEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        request = ForwardBackwardRequest((ce_sample(TOKENS),), CE)
        losses.append(forward_backward(engine, "r", "s", request).loss)
        engine.optim_step("r", "s", STEP)
    return losses


def plain_logprobs(directory: Path, tokens: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of plain transformers' logits over `tokens`: [T, V]."""
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), -1)


# ---------------------------------------------------------------- custom losses


def gradients(engine: LocalEngine) -> dict[str, torch.Tensor]:
    named = engine._session("r", "s")[1].optimizer.named_params
    return {name: p.grad.clone() for name, p in named if p.grad is not None}


@pytest.mark.parametrize("family", ALL)
def test_custom_forward_backward_equals_cross_entropy_with_weights_minus_g(family, family_dirs):
    engine = engine_for(family_dirs[family], LORA)
    train(engine, 1)  # lora_B moves off zero, so every factor has a gradient
    g = tuple(-0.1 * (1 + i % 3) for i in range(len(TOKENS) - 1))
    weighted = TrainingSample(
        tokens=TOKENS[:-1],
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in TOKENS[1:]),
            "weights": tuple(-x for x in g),  # CE's gradient coefficient is -w
        },
    )
    forward_backward(engine, "r", "s", ForwardBackwardRequest((weighted,), CE))
    via_ce = gradients(engine)
    engine.discard_gradients("r", "s")
    engine.custom_forward_backward(
        "r", "s", CustomForwardBackwardRequest((ce_sample(TOKENS),), (g,))
    )
    custom = gradients(engine)
    assert custom.keys() == via_ce.keys() and len(custom) > 0
    for name in via_ce:
        torch.testing.assert_close(custom[name], via_ce[name], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- sessions in shared passes


@pytest.mark.parametrize("family", ALL)
def test_two_sessions_in_shared_passes_score_and_sample_as_each_alone(family, family_dirs):
    engine = engine_for(family_dirs[family], LORA)
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    for session, tokens in (("s", TOKENS), ("t", TOKENS[::-1])):
        request = ForwardBackwardRequest((ce_sample(tokens),), CE)
        forward_backward(engine, "r", session, request)
        engine.optim_step("r", session, OptimStepRequest(adam=AdamParams(learning_rate=5e-2)))
        engine.publish("r", session, version=1)
    score = ForwardBackwardRequest((ce_sample(TOKENS),), CE, True, return_loss_fn_outputs=True)
    alone = [forward_backward(engine, "r", s, score).loss_fn_outputs[0] for s in ("s", "t")]
    shared = engine.forward_backward_batch("r", [("s", score), ("t", score)])
    for result, expected in zip(shared, alone, strict=True):
        assert not isinstance(result, Exception)
        assert result.loss_fn_outputs[0] == pytest.approx(expected, abs=1e-5)
    assert alone[0] != pytest.approx(alone[1], abs=1e-3)  # the sessions' weights differ

    generate = SampleRequest((PROMPT,), 2, GREEDY)
    alone_sampled = [sample(engine, "r", s, generate)[0] for s in ("s", "t")]
    together = engine.sample_batch("r", [("s", generate), ("t", generate)])
    for (result,), expected in zip(together, alone_sampled, strict=True):
        for got, want in zip(result.sequences, expected.sequences, strict=True):
            assert got.tokens == want.tokens
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


# ---------------------------------------------------------------- full weights and weights-sync


@pytest.mark.parametrize("family", ALL)
def test_full_weight_training_lowers_the_loss_and_a_publish_mid_generation_serves_it(
    family, family_dirs
):
    engine = engine_for(family_dirs[family], None)
    before, base_logprobs = scored(engine, TOKENS)
    train(engine, 3)
    after, _ = scored(engine, TOKENS)
    assert after < before

    calls = []

    def publish_on_the_third_boundary() -> None:
        calls.append(1)
        if len(calls) == 3:
            engine.publish("r", "s", version=3)

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    request = SampleRequest((PROMPT,), 2, params)
    (result,) = sample(engine, "r", "s", request, between_tokens=publish_on_the_third_boundary)
    switched = [(p.start_token, p.version) for p in result.policy_segments]
    assert switched[0] == (0, 0)
    for sequence in result.sequences:
        if len(sequence.tokens) <= 3:  # ended before the switch: one segment
            continue
        assert switched == [(0, 0), (3, 3)]
        # After the switch the rows decode on the trained weights: the trainer's forward_only.
        _, forward = scored(engine, PROMPT + tuple(sequence.tokens))
        torch.testing.assert_close(
            torch.tensor(sequence.logprobs[3:]),
            torch.tensor(forward[len(PROMPT) + 2 :]),
            atol=1e-4,
            rtol=0,
        )

    # Ending the session puts the base weights back for the resource's next session.
    engine.drop_session("r", "s")
    engine.create_session("r", "s", None)
    assert scored(engine, TOKENS)[1] == base_logprobs


@pytest.mark.parametrize("family", ALL)
def test_muon_leaves_the_embeddings_and_the_head_of_every_family_to_adamw(family, family_dirs):
    """losses.md 12.3: whatever the family names them (GPT-NeoX: embed_in, embed_out)."""
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family])
    names = {id(p): name for name, p in model.named_parameters()}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        name = names[id(module.weight)]
        assert not is_muon_param(name, 2), name
        assert not is_muon_param(name.removesuffix(".weight") + ".lora_B", 2), name
    assert any(is_muon_param(name, p.ndim) for name, p in model.named_parameters())


@pytest.mark.parametrize("family", ALL)
def test_full_weight_training_under_muon_lowers_the_loss(family, family_dirs):
    engine = LocalEngine(EngineConfig(device="cpu"), {"m": family_dirs[family]})
    engine.load_resource("r", "m", muon_scaling=MuonScaling.MATCH_ADAM)
    engine.create_session("r", "s", None)
    assert engine._session("r", "s")[1].optimizer.muon_param_names
    losses = []
    for _ in range(3):
        request = ForwardBackwardRequest((ce_sample(TOKENS),), CE)
        losses.append(forward_backward(engine, "r", "s", request).loss)
        engine.optim_step("r", "s", OptimStepRequest(muon=MuonParams(learning_rate=0.02)))
    assert scored(engine, TOKENS)[0] < losses[0], losses


# ---------------------------------------------------------------- checkpoints and exports


@pytest.mark.parametrize("is_full_weight", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("family", ALL)
def test_a_training_checkpoint_resumes_with_identical_logprobs_and_steps(
    family, is_full_weight, family_dirs, tmp_path
):
    lora = None if is_full_weight else LORA
    engine = engine_for(family_dirs[family], lora)
    train(engine, 2)
    (tmp_path / "state").mkdir()
    engine.save_training_state("r", "s", tmp_path / "state")
    _, served = scored(engine, TOKENS)

    # Another adapter seed: every weight must come from the checkpoint.
    resumed = engine_for(family_dirs[family], lora and LoraConfig(rank=4, alpha=8, seed=99))
    resumed.load_training_state("r", "s", tmp_path / "state", load_optimizer=True)
    assert scored(resumed, TOKENS)[1] == served
    assert train(resumed, 2) == train(engine, 2)  # the optimizer state came back too

    if is_full_weight:  # the MERGED export of a full-weight session is the trained model
        engine.save_full_model("r", "s", tmp_path / "model", base_model="m")
        exported = plain_logprobs(tmp_path / "model", TOKENS[:-1])
        expected = exported.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
        _, trained = scored(engine, TOKENS)
        torch.testing.assert_close(torch.tensor(trained), expected, atol=1e-5, rtol=0)
    else:  # an inference checkpoint's PEFT adapter resumes the weights alone
        (tmp_path / "adapter").mkdir()
        engine.save_adapter("r", "s", tmp_path / "adapter", lora=LORA, base_model="m")
        _, trained = scored(engine, TOKENS)
        weights_only = engine_for(family_dirs[family], LoraConfig(rank=4, alpha=8, seed=99))
        weights_only.load_adapter("r", "s", tmp_path / "adapter")
        assert scored(weights_only, TOKENS)[1] == trained


# ---------------------------------------------------------------- sampling parameters


def first_stop_cut(decode, tokens: list[int], stop: str) -> int:
    """How many tokens a sequence keeps when `stop` ends it: up to the token that completes the
    first occurrence of `stop` in the decoded text."""
    return next(n for n in range(1, len(tokens) + 1) if stop in decode(tokens[:n]))


@pytest.mark.parametrize("family", ALL)
def test_every_sampling_parameter_holds(family, family_dirs):
    engine = engine_for(family_dirs[family], LORA)  # a fresh adapter: the base model's outputs
    (greedy,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 1, GREEDY))
    greedy_tokens = greedy.sequences[0].tokens

    # top_k 1 and a nucleus of one token both leave only the argmax, at any temperature.
    for narrow in (
        SamplingParams(max_tokens=8, top_k=1, seed=5),
        SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6),
    ):
        (result,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 2, narrow))
        assert [s.tokens for s in result.sequences] == [greedy_tokens] * 2

    # A seed reproduces its samples; another seed draws others.
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    first, again = (
        sample(engine, "r", "s", SampleRequest((PROMPT,), 3, seeded))[0] for _ in range(2)
    )
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    other = SamplingParams(max_tokens=8, temperature=1.0, seed=12)
    (reseeded,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 3, other))
    assert [s.tokens for s in reseeded.sequences] != [s.tokens for s in first.sequences]

    # A stop string ends the sequence at the token that completes it.
    tokenizer = engine._resource("r").loaded.tokenizer
    stop = next(t for t in (tokenizer.decode(greedy_tokens[i : i + 1]) for i in (2, 3)) if t)
    cut = first_stop_cut(tokenizer.decode, greedy_tokens, stop)
    stopping = SamplingParams(max_tokens=8, temperature=0.0, stop=(stop,))
    (stopped,) = sample(engine, "r", "s", SampleRequest((PROMPT,), 1, stopping))
    assert stopped.sequences[0].tokens == greedy_tokens[:cut]
    assert stopped.sequences[0].stop_reason == StopReason.STOP

    # prompt_logprobs and topk_prompt_logprobs are plain transformers' over the prompt.
    request = SampleRequest((PROMPT,), 1, GREEDY, prompt_logprobs=True, topk_prompt_logprobs=3)
    (scored_prompt,) = sample(engine, "r", "s", request)
    expected_TV = plain_logprobs(family_dirs[family], PROMPT)
    expected = expected_TV[:-1].gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert scored_prompt.prompt_logprobs[0] == 0.0
    torch.testing.assert_close(
        torch.tensor(scored_prompt.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0
    )
    topk = scored_prompt.topk_prompt_logprobs
    assert topk[0].token_ids == [] and len(topk) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        reference = torch.topk(expected_TV[position - 1], 3)
        torch.testing.assert_close(
            torch.tensor(topk[position].logprobs), reference.values, atol=1e-5, rtol=0
        )
