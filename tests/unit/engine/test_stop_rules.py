"""Where a sampled sequence ends (SamplingParams: stop token ids, EOS or not, stop strings,
max_tokens, max_tokens None resolved to the context limit) and what its logprobs are, on the
built-in model, whose greedy continuation of "12+34=" ends with EOS (id 0) as its 4th token.
Every decode path (blocks of passes, static passes) must end rows at the same tokens."""

from __future__ import annotations

import pytest
import torch
from engine_calls import sample
from test_decode_blocks import assert_identical, engine_for, run_blocks
from test_sampler import GREEDY, encode, session_engine

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, LimitsConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.service.operations.submit import resolved_max_tokens
from posttrain.types import SampleRequest, SamplingParams, StopReason


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return session_engine()


def eos_ids(engine: LocalEngine) -> frozenset[int]:
    return engine._resource("r").loaded.eos_token_ids


def one(engine: LocalEngine, prompt: tuple[int, ...], params: SamplingParams, n: int = 1):
    return sample(engine, "r", "s", SampleRequest((prompt,), n, params))[0]


def forward_logprobs(engine: LocalEngine, tokens: list[int]) -> torch.Tensor:
    """float32 log-softmax of one full forward pass (no cache) of the generator: [T, V]."""
    resource = engine._resource("r")
    with torch.no_grad(), resource.lora.route([("s@generator", None)]):
        logits = resource.loaded.model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def teacher_forced(engine: LocalEngine, prompt: tuple[int, ...], tokens: list[int]):
    """The logprob of each of `tokens` after `prompt`, and the argmax at each position."""
    logprobs_TV = forward_logprobs(engine, [*prompt, *tokens])[len(prompt) - 1 : -1]
    chosen = logprobs_TV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    return chosen, logprobs_TV.argmax(-1).tolist()


def test_a_stop_token_id_ends_the_sequence_at_that_token_which_is_kept(engine):
    prompt = encode(engine, "reverse reverse reverse")
    free = one(engine, prompt, GREEDY).sequences[0]
    assert free.stop_reason == StopReason.LENGTH
    # The first token that did not occur before it: the sequence must end exactly there.
    at = next(i for i in range(1, len(free.tokens)) if free.tokens[i] not in free.tokens[:i])
    later = free.tokens[-1] if free.tokens[-1] not in free.tokens[: at + 1] else None
    stop_ids = (free.tokens[at],) if later is None else (later, free.tokens[at])
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stop_ids)
    stopped = one(engine, prompt, params).sequences[0]
    assert stopped.tokens == free.tokens[: at + 1]
    assert stopped.tokens[-1] == free.tokens[at]
    assert stopped.stop_reason == StopReason.STOP
    torch.testing.assert_close(stopped.logprobs, free.logprobs[: at + 1], atol=1e-5, rtol=0)
    # A stop id on the very first token: a one-token sequence.
    first = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(free.tokens[0],))
    assert one(engine, prompt, first).sequences[0].tokens == free.tokens[:1]


def test_eos_still_stops_beside_stop_token_ids_and_stop_strings(engine):
    prompt = encode(engine, "12+34=")
    default = one(engine, prompt, GREEDY).sequences[0]
    assert default.stop_reason == StopReason.STOP and default.tokens[-1] in eos_ids(engine)
    assert len(default.tokens) == 4
    unused = next(t for t in range(1, 99) if t not in default.tokens)
    for params in (
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(unused,)),
        SamplingParams(max_tokens=12, temperature=0.0, stop=("never",)),
    ):
        ended = one(engine, prompt, params).sequences[0]
        assert (ended.tokens, ended.stop_reason) == (default.tokens, StopReason.STOP)


def test_without_eos_a_sequence_runs_past_eos_to_max_tokens(engine):
    prompt = encode(engine, "12+34=")
    at_eos = one(engine, prompt, GREEDY).sequences[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False)
    result = one(engine, prompt, params, n=2)
    for sequence in result.sequences:
        assert sequence.stop_reason == StopReason.LENGTH
        assert len(sequence.tokens) == 12
        assert sequence.tokens[:4] == at_eos.tokens  # EOS at the 4th token, then on
        assert sequence.tokens[3] in eos_ids(engine)
        # Past EOS every token is still the model's greedy choice after all before it.
        chosen, argmax = teacher_forced(engine, prompt, sequence.tokens)
        assert sequence.tokens == argmax
        torch.testing.assert_close(torch.tensor(sequence.logprobs), chosen, atol=1e-5, rtol=0)
    # An explicit stop id still ends it, EOS included; so does a stop string.
    tokenizer = engine._resource("r").loaded.tokenizer
    eos = at_eos.tokens[3]
    with_id = SamplingParams(
        max_tokens=12, temperature=0.0, stop_at_eos=False, stop_token_ids=(eos,)
    )
    assert one(engine, prompt, with_id).sequences[0].tokens == at_eos.tokens
    # A two-token string first seen past EOS (where the sequence repeats "\n" and EOS).
    tokens = result.sequences[0].tokens
    decode = tokenizer.decode
    at = next(i for i in range(4, 10) if decode(tokens[i : i + 2]) not in decode(tokens[: i + 1]))
    with_string = SamplingParams(
        max_tokens=12, temperature=0.0, stop_at_eos=False, stop=(decode(tokens[at : at + 2]),)
    )
    ended = one(engine, prompt, with_string).sequences[0]
    assert (ended.tokens, ended.stop_reason) == (tokens[: at + 2], StopReason.STOP)
    assert at + 2 < 12 and tokens.count(eos) >= 1


def test_sampled_logprobs_equal_a_teacher_forced_forward_pass(engine):
    prompt = encode(engine, "<|im_start|>7+8=")
    for params in (
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, stop_at_eos=False),
        SamplingParams(max_tokens=16, temperature=0.6, top_k=8, top_p=0.9, seed=6),
    ):
        result = one(engine, prompt, params, n=3)
        assert len({tuple(s.tokens) for s in result.sequences}) > 1
        for sequence in result.sequences:
            # The model's own (untempered) logprob of each sampled token.
            chosen, _ = teacher_forced(engine, prompt, sequence.tokens)
            assert len(sequence.logprobs) == len(sequence.tokens)
            torch.testing.assert_close(torch.tensor(sequence.logprobs), chosen, atol=1e-5, rtol=0)


def test_compute_logprobs_is_one_token_and_the_prompt_logprobs_after_position_0(engine):
    # Tinker's compute_logprobs: sample(max_tokens=1, prompt_logprobs=True).
    prompt = encode(engine, "<|im_start|>12+34=46")
    request = SampleRequest((prompt,), 1, SamplingParams(max_tokens=1), prompt_logprobs=True)
    (result,) = sample(engine, "r", "s", request)
    assert len(result.sequences[0].tokens) == 1
    assert len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] == 0.0  # no logprob at position 0: the placeholder
    chosen, _ = teacher_forced(engine, prompt[:1], list(prompt[1:]))
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), chosen, atol=1e-5, rtol=0)


def test_max_tokens_none_samples_up_to_the_context_length(engine):
    loaded = engine._resource("r").loaded
    prompt = encode(engine, "12+34=")
    unresolved = SampleRequest(
        (prompt,), 1, SamplingParams(max_tokens=None, temperature=0.0, stop_at_eos=False)
    )
    request = resolved_max_tokens(unresolved, loaded.context_length, LimitsConfig())
    assert request.sampling_params.max_tokens == loaded.context_length - len(prompt)
    (result,) = sample(engine, "r", "s", request)
    sequence = result.sequences[0]
    assert sequence.stop_reason == StopReason.LENGTH
    assert len(prompt) + len(sequence.tokens) == loaded.context_length
    # The last tokens are still the model's greedy choices at the end of its context.
    chosen, argmax = teacher_forced(engine, prompt, sequence.tokens)
    assert sequence.tokens[-8:] == argmax[-8:]
    torch.testing.assert_close(torch.tensor(sequence.logprobs[-8:]), chosen[-8:], atol=1e-4, rtol=0)


def test_stop_rules_end_rows_alike_on_every_decode_path(monkeypatch):
    blocks = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    tokenizer = blocks._resource("r").loaded.tokenizer
    arithmetic = tuple(tokenizer.encode("12+34=", add_special_tokens=False))
    items = [
        ("s", SampleRequest((arithmetic,), 2, SamplingParams(max_tokens=13, temperature=0.0))),
        (
            "t",
            SampleRequest(
                (arithmetic, (5, 6, 7)),
                2,
                SamplingParams(max_tokens=17, temperature=0.0, stop_at_eos=False),
            ),
        ),
        (
            "s",
            SampleRequest(
                ((9, 10, 11, 12),),
                3,
                SamplingParams(max_tokens=19, temperature=1.0, seed=8, stop_token_ids=(30, 84)),
            ),
        ),
    ]
    results = run_blocks(blocks, monkeypatch, items)
    reference = results[1, False]
    assert {len(s.tokens) for s in reference[0][0].sequences} == {4}  # EOS
    assert {len(s.tokens) for s in reference[1][0].sequences} == {17}  # past EOS
    assert reference[1][0].sequences[0].tokens[3] == 0
    assert_identical(results)
