"""The generator on the built-in model: KV cache and row freeing against full recomputes, seeds,
stop strings, prompt logprobs, the prefix cache and in-flight weight updates."""

from __future__ import annotations

import pytest
import torch
from engine_calls import forward_backward, sample

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.generate import sampler
from posttrain.engine.generate.prefix_cache import PrefixCache
from posttrain.engine.generate.sampling_math import (
    CDF_BLOCK,
    choose_tokens,
    draw_inverse_cdf,
    filter_logits,
)
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.errors import NonFiniteLoss
from posttrain.model.kv_cache import KVCache
from posttrain.types import (
    AdamParams,
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    OptimStepRequest,
    SampleRequest,
    SamplingParams,
    StopReason,
    TrainingSample,
)

CE = LossConfig(LossType.CROSS_ENTROPY)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def session_engine() -> LocalEngine:
    """The built-in model on resource "r" with one LoRA session "s"."""
    engine = LocalEngine(
        EngineConfig(device="cpu", logprob_chunk_tokens=5), {BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}
    )
    engine.load_resource("r", BUILTIN_MODEL_ID, muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    return engine


@pytest.fixture
def engine() -> LocalEngine:
    return session_engine()


def encode(engine: LocalEngine, text: str) -> tuple[int, ...]:
    tokenizer = engine._resource("r").loaded.tokenizer
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def train_one_step(engine: LocalEngine, session: str, tokens: list[int]) -> None:
    """One large cross-entropy step, so the trainer's weights clearly differ from before."""
    sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    forward_backward(engine, "r", session, ForwardBackwardRequest((sample,), CE))
    engine.optim_step("r", session, OptimStepRequest(adam=AdamParams(learning_rate=5e-2)))


def forward_logprobs(engine: LocalEngine, key: str, tokens: list[int]) -> torch.Tensor:
    """float32 log-softmax of a full forward pass (no cache) under adapter `key`: [T, V]."""
    resource = engine._resource("r")
    with torch.no_grad(), resource.lora.route([(key, None)]):
        logits = resource.loaded.model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def greedy_without_cache(engine: LocalEngine, key: str, prompt: tuple[int, ...], steps: int):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(forward_logprobs(engine, key, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


# ---------------------------------------------------------------- the decode loop


def test_batched_generation_with_shared_prefill_and_row_freeing_equals_one_at_a_time(engine):
    # Rows end at different steps (max_tokens 3 / 9 / 20, and EOS), so the batch is compacted
    # several times while other rows keep decoding from the shared, fanned-out prefill.
    requests = [
        SampleRequest((encode(engine, "12+34="),), 3, SamplingParams(max_tokens=3, seed=1)),
        SampleRequest((encode(engine, "reverse ab:"),), 4, SamplingParams(max_tokens=9, seed=2)),
        SampleRequest(
            (encode(engine, "1 2 3"), encode(engine, "hello")),
            2,
            SamplingParams(max_tokens=20, temperature=0.7, top_k=20, top_p=0.9, seed=3),
        ),
        SampleRequest((encode(engine, "reverse reverse reverse"),), 2, GREEDY),
    ]
    batched = engine.sample_batch("r", [("s", q) for q in requests])
    lengths = {len(s.tokens) for results in batched for r in results for s in r.sequences}
    assert len(lengths) >= 4, lengths  # rows really finished at different steps
    for request, results in zip(requests, batched, strict=True):
        for prompt, result in zip(request.prompts, results, strict=True):
            alone = sample(
                engine,
                "r",
                "s",
                SampleRequest((prompt,), request.num_samples, request.sampling_params),
            )[0]
            for ours, reference in zip(result.sequences, alone.sequences, strict=True):
                assert ours.tokens == reference.tokens
                assert ours.stop_reason == reference.stop_reason
                torch.testing.assert_close(ours.logprobs, reference.logprobs, atol=1e-5, rtol=0)
            if request.sampling_params.temperature == 0:
                tokens = result.sequences[0].tokens
                assert all(s.tokens == tokens for s in result.sequences)
                expected = greedy_without_cache(engine, "s@generator", prompt, len(tokens))
                assert tokens == expected


def test_a_cache_that_grows_during_decode_keeps_every_row_exact(engine, monkeypatch):
    monkeypatch.setattr(sampler, "DECODE_POSITIONS_PER_GROWTH", 3)  # grows every 3 tokens
    prompts = (encode(engine, "reverse reverse reverse"), encode(engine, "7+8="))
    params = SamplingParams(max_tokens=14, temperature=0.0)
    results = sample(engine, "r", "s", SampleRequest(prompts, 2, params))
    for prompt, result in zip(prompts, results, strict=True):
        tokens = result.sequences[0].tokens
        assert tokens == greedy_without_cache(engine, "s@generator", prompt, len(tokens))
    assert len(results[0].sequences[0].tokens) == 14


def test_rows_of_different_sessions_share_passes_with_their_own_adapters(engine):
    engine.create_session("r", "t", LoraConfig(rank=4, alpha=8, seed=2))
    train_one_step(engine, "t", list(encode(engine, "zzzzzzzz")))
    engine.publish("r", "t", version=1)
    prompt = encode(engine, "reverse reverse reverse")
    request = SampleRequest((prompt,), 2, SamplingParams(max_tokens=16, temperature=0.0))
    together = engine.sample_batch("r", [("s", request), ("t", request)])
    for session, results in zip(("s", "t"), together, strict=True):
        alone = sample(engine, "r", session, request)
        assert results[0].sequences[0].tokens == alone[0].sequences[0].tokens
        torch.testing.assert_close(
            results[0].sequences[0].logprobs, alone[0].sequences[0].logprobs, atol=1e-5, rtol=0
        )
    assert together[0][0].sequences[0].tokens != together[1][0].sequences[0].tokens
    assert [(p.start_token, p.version) for p in together[1][0].policy_segments] == [(0, 1)]
    assert [(p.start_token, p.version) for p in together[0][0].policy_segments] == [(0, 0)]


def test_a_seed_reproduces_whatever_the_batch_mates_and_num_samples(engine):
    prompt = encode(engine, "12+34=")
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.95, seed=123)
    alone = sample(engine, "r", "s", SampleRequest((prompt,), 3, params))[0]
    crowded = engine.sample_batch(
        "r",
        [
            ("s", SampleRequest((encode(engine, "hello"), prompt), 5, params)),
            ("s", SampleRequest((encode(engine, "7+8="),), 4, SamplingParams(seed=9))),
        ],
    )[0][1]
    first_three = [s.tokens for s in crowded.sequences[:3]]
    assert [s.tokens for s in alone.sequences] == first_three
    assert len({tuple(t) for t in first_three}) > 1  # samples of one prompt differ
    other_seed = sample(
        engine, "r", "s", SampleRequest((prompt,), 3, SamplingParams(max_tokens=15, seed=124))
    )[0]
    assert [s.tokens for s in other_seed.sequences] != first_three


def test_a_stop_string_spanning_two_tokens_ends_the_sequence_after_it(engine):
    prompt = encode(engine, "reverse reverse reverse")
    free = sample(engine, "r", "s", SampleRequest((prompt,), 1, GREEDY))[0].sequences[0]
    tokenizer = engine._resource("r").loaded.tokenizer
    text = tokenizer.decode(free.tokens)
    stop = text[4:6]  # char-level tokenizer: two characters are two tokens
    end = text.index(stop) + len(stop)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=(stop, "never"))
    stopped = sample(engine, "r", "s", SampleRequest((prompt,), 1, params))[0].sequences[0]
    assert stopped.tokens == free.tokens[:end]
    assert stopped.stop_reason == StopReason.STOP
    assert tokenizer.decode(stopped.tokens).endswith(stop)


def test_prompt_logprobs_and_topk_come_from_the_forward_pass(engine):
    prompt = encode(engine, "<|im_start|>12+34=46")
    request = SampleRequest(
        (prompt,), 2, SamplingParams(max_tokens=2), prompt_logprobs=True, topk_prompt_logprobs=5
    )
    result = sample(engine, "r", "s", request)[0]
    expected_TV = forward_logprobs(engine, "s@generator", list(prompt))
    targets = torch.tensor(prompt[1:])
    expected = expected_TV[:-1].gather(-1, targets[:, None]).squeeze(-1)
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] == 0.0
    torch.testing.assert_close(
        torch.tensor(result.prompt_logprobs[1:]), expected, atol=1e-5, rtol=0
    )
    topk = result.topk_prompt_logprobs
    assert len(topk) == len(prompt) and topk[0].token_ids == [] and topk[0].logprobs == []
    found = 0
    for position in range(1, len(prompt)):
        entry = topk[position]
        assert len(entry.token_ids) == 5
        assert entry.logprobs == sorted(entry.logprobs, reverse=True)
        reference = torch.topk(expected_TV[position - 1], 5)
        torch.testing.assert_close(
            torch.tensor(entry.logprobs), reference.values, atol=1e-5, rtol=0
        )
        if prompt[position] in reference.indices.tolist():
            found += 1
            assert prompt[position] in entry.token_ids
    assert found > 0
    assert result.sequences[0].prompt_cache_hit_tokens == 0  # logprobs need a full prefill


# ---------------------------------------------------------------- token choice


def reference_choice(logits_V, temperature, top_k, top_p, uniform):
    """One row, the textbook way: temperature, keep the k best, then the top_p nucleus."""
    if temperature == 0:
        return int(logits_V.argmax())
    z = logits_V / temperature
    order = torch.argsort(z, descending=True)
    keep = order[: top_k if top_k > 0 else len(z)]
    probs = torch.softmax(z[keep], -1)
    nucleus = []
    mass = 0.0
    for token, p in zip(keep.tolist(), probs.tolist(), strict=True):
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += p
    filtered = torch.full_like(z, float("-inf"))
    filtered[nucleus] = z[nucleus]
    cdf = torch.softmax(filtered, -1).cumsum(-1)
    return int((cdf > uniform * cdf[-1]).nonzero()[0])


def test_choose_tokens_matches_a_per_row_reference_and_ignores_batch_mates():
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 40, generator=generator) * 3, dim=-1)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5])
    top_k = torch.tensor([-1, -1, 5, -1, 3, 10])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.9, 0.5])
    for trial in range(20):
        uniform = torch.rand(6, generator=generator)
        chosen = choose_tokens(logprobs, temperature, top_k, top_p, uniform)
        for row in range(6):
            expected = reference_choice(
                logprobs[row],
                float(temperature[row]),
                int(top_k[row]),
                float(top_p[row]),
                float(uniform[row]),
            )
            assert int(chosen[row]) == expected, (trial, row)
            alone = choose_tokens(
                logprobs[row : row + 1],
                temperature[row : row + 1],
                top_k[row : row + 1],
                top_p[row : row + 1],
                uniform[row : row + 1],
            )
            assert int(alone[0]) == expected


def test_the_two_level_inverse_cdf_draws_what_one_running_sum_draws():
    # A vocabulary of 2.5 blocks with runs of zero-probability tokens, including a whole block.
    generator = torch.Generator().manual_seed(0)
    vocab = CDF_BLOCK * 5 // 2
    probs = torch.rand(4, vocab, generator=generator) ** 4
    probs[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0
    probs[0, :100] = 0.0
    probs[1, vocab - 50 :] = 0.0
    probs[2, :] = 0.0
    probs[2, [3, CDF_BLOCK + 7, vocab - 1]] = torch.tensor([0.2, 0.0, 0.8])
    uniform = torch.rand(4, 500, generator=generator)
    edges = torch.tensor([0.0, 1e-9, 0.5, 1.0 - 2**-24])
    for u in [*uniform.T, *(e.expand(4) for e in edges)]:
        drawn = draw_inverse_cdf(probs, u)
        cdf = probs.double().cumsum(-1)
        for row in range(4):
            token = int(drawn[row])
            assert probs[row, token] > 0, (row, float(u[row]))
            expected = int((cdf[row] > u[row].double() * cdf[row, -1]).nonzero()[0])
            if token != expected:  # only where float32 block sums round across a boundary
                gap = abs(float(cdf[row, min(token, expected)] / cdf[row, -1] - u[row]))
                assert gap < 1e-5, (row, token, expected)


def test_filter_logits_keeps_the_smallest_nucleus_reaching_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, torch.tensor([-1]), torch.tensor([0.75]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]
    kept = filter_logits(logits, torch.tensor([1]), torch.tensor([1.0]))
    assert torch.isfinite(kept[0]).tolist() == [True, False, False, False]
    untouched = filter_logits(logits, torch.tensor([-1]), torch.tensor([1.0]))
    assert torch.equal(untouched, logits)


# ---------------------------------------------------------------- prefix cache


def test_the_prefix_cache_serves_a_repeated_prompt_and_is_dropped_by_a_publish(engine):
    prompt = encode(engine, "<|im_start|>reverse abcdef:")
    request = SampleRequest((prompt,), 2, GREEDY)
    cold = sample(engine, "r", "s", request)[0]
    warm = sample(engine, "r", "s", request)[0]
    assert [s.prompt_cache_hit_tokens for s in cold.sequences] == [0, 0]
    assert [s.prompt_cache_hit_tokens for s in warm.sequences] == [len(prompt) - 1] * 2
    for hot, fresh in zip(warm.sequences, cold.sequences, strict=True):
        assert hot.tokens == fresh.tokens
        torch.testing.assert_close(hot.logprobs, fresh.logprobs, atol=1e-5, rtol=0)
    # A prompt that shares a prefix hits exactly the shared part.
    sibling = prompt[:-4] + encode(engine, "xyz:")
    shared = sample(engine, "r", "s", SampleRequest((sibling,), 1, GREEDY))[0]
    assert shared.sequences[0].prompt_cache_hit_tokens == len(prompt) - 4
    train_one_step(engine, "s", list(prompt))
    engine.publish("r", "s", version=1)
    after = sample(engine, "r", "s", request)[0]
    assert [s.prompt_cache_hit_tokens for s in after.sequences] == [0, 0]
    assert after.sequences[0].tokens == greedy_without_cache(
        engine, "s@generator", prompt, len(after.sequences[0].tokens)
    )


def span(value: float, positions: int) -> torch.Tensor:
    return torch.full((1, 2, 1, positions, 2), value)  # [N, 2, H, P, D], 16 bytes a position


def test_prefix_cache_lookup_returns_the_longest_cached_prefix_across_split_edges():
    cache = PrefixCache(budget_bytes=10_000)
    ns = ("a", 1)
    first = torch.arange(6.0).view(1, 1, 1, 6, 1).expand(1, 2, 1, 6, 2).contiguous()
    cache.insert(ns, (1, 2, 3, 4, 5, 6), lambda s, e: first[:, :, :, s:e])
    second = first + 100
    cache.insert(ns, (1, 2, 3, 9, 9), lambda s, e: second[:, :, :, s:e])  # splits after 3
    spans = cache.lookup(ns, (1, 2, 3, 4, 5, 7, 7), max_tokens=7)
    assert sum(s.shape[3] for s in spans) == 5
    torch.testing.assert_close(torch.cat(spans, dim=3), first[:, :, :, :5])
    spans = cache.lookup(ns, (1, 2, 3, 9, 9), max_tokens=4)
    joined = torch.cat(spans, dim=3)
    assert joined.shape[3] == 4
    torch.testing.assert_close(joined[:, :, :, :3], first[:, :, :, :3])
    torch.testing.assert_close(joined[:, :, :, 3], second[:, :, :, 3])
    assert cache.lookup(("a", 2), (1, 2, 3), max_tokens=3) == []  # other generation
    assert cache.nbytes == (6 + 2) * 16  # the shared prefix is stored once
    cache.drop_owner("a")
    assert cache.nbytes == 0 and cache.lookup(ns, (1, 2, 3), max_tokens=3) == []


def test_prefix_cache_evicts_least_recently_used_leaves_under_its_budget():
    cache = PrefixCache(budget_bytes=3 * 4 * 16)  # three 4-position entries
    ns = ("a", 1)
    for first_token in (1, 2, 3):
        cache.insert(ns, (first_token, 0, 0, 0), lambda s, e, v=float(first_token): span(v, e - s))
    assert len(cache.lookup(ns, (1, 0, 0, 0), max_tokens=4)) == 1  # 1 is now the newest
    cache.insert(ns, (4, 0, 0, 0), lambda s, e: span(4.0, e - s))
    assert cache.lookup(ns, (2, 0, 0, 0), max_tokens=4) == []  # least recently used: gone
    for kept in (1, 3, 4):
        assert len(cache.lookup(ns, (kept, 0, 0, 0), max_tokens=4)) == 1
    assert cache.nbytes <= cache.budget_bytes
    disabled = PrefixCache(budget_bytes=0)
    disabled.insert(ns, (1, 2), lambda s, e: span(1.0, e - s))
    assert disabled.nbytes == 0 and disabled.lookup(ns, (1, 2), max_tokens=2) == []


# ---------------------------------------------------------------- KV cache


def test_kv_cache_compaction_keeps_each_surviving_row_intact():
    cache = KVCache(
        num_layers=2,
        num_rows=4,
        capacity=6,
        num_kv_heads=1,
        head_dim=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for row in range(4):
        cache.write_span(row, 0, torch.full((2, 2, 1, row + 2, 3), float(row)))
    before = [cache.span(row, 0, row + 2).clone() for row in range(4)]
    cache.keep(torch.tensor([1, 3]))
    assert cache.num_rows == 2 and cache.lengths_B[:2].tolist() == [3, 5]
    torch.testing.assert_close(cache.span(0, 0, 3), before[1])
    torch.testing.assert_close(cache.span(1, 0, 5), before[3])


# ---------------------------------------------------------------- in-flight weight updates


def test_a_publish_between_tokens_switches_running_rows_to_the_new_weights(engine):
    prompt = encode(engine, "reverse reverse reverse")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    old = sample(engine, "r", "s", SampleRequest((prompt,), 1, params))[0].sequences[0]
    assert old.stop_reason == StopReason.LENGTH
    train_one_step(engine, "s", list(prompt) + old.tokens)
    calls = []

    def publish_on_the_fifth_boundary() -> None:
        calls.append(1)
        if len(calls) == 5:
            engine.publish("r", "s", version=1)

    result = sample(
        engine,
        "r",
        "s",
        SampleRequest((prompt,), 3, params),
        between_tokens=publish_on_the_fifth_boundary,
    )[0]
    # The hook runs before each decode pass; the 5th comes after 5 tokens exist.
    assert [(p.start_token, p.version) for p in result.policy_segments] == [(0, 0), (5, 1)]
    for sequence in result.sequences:
        assert sequence.tokens[:5] == old.tokens[:5]
        continued = greedy_without_cache(
            engine, "s@generator", prompt + tuple(sequence.tokens[:5]), len(sequence.tokens) - 5
        )
        assert sequence.tokens[5:] == continued
        new_logprobs = forward_logprobs(engine, "s@generator", list(prompt) + sequence.tokens)
        targets = torch.tensor(sequence.tokens[5:])
        expected = new_logprobs[len(prompt) + 4 : -1].gather(-1, targets[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sequence.logprobs[5:]), expected, atol=1e-4, rtol=0)
    assert result.sequences[0].tokens != old.tokens  # the new weights really took over


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=1e-40, seed=1),  # every tempered value -inf
        SamplingParams(max_tokens=8, temperature=1e30, seed=1),  # tempered to uniform
        SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=1),
        SamplingParams(max_tokens=8, temperature=1.3, top_p=1e-9, seed=1),
        SamplingParams(max_tokens=8, temperature=2.0, top_k=3, top_p=0.5, seed=1),
    ],
    ids=["tiny-temperature", "huge-temperature", "top-k-1", "top-p-tiny", "top-k-and-p"],
)
def test_sampled_logprobs_are_finite_at_sampling_edges(engine, params):
    (result,) = sample(engine, "r", "s", SampleRequest(((5, 6, 7),), 4, params))
    for sequence in result.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) > 0
        assert all(torch.isfinite(torch.tensor(sequence.logprobs)))


def test_a_tiny_temperature_samples_the_greedy_tokens(engine):
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, seed=1)
    (greedy,) = sample(engine, "r", "s", SampleRequest(((5, 6, 7),), 1, GREEDY))
    (cold,) = sample(engine, "r", "s", SampleRequest(((5, 6, 7),), 1, tiny))
    assert cold.sequences[0].tokens == greedy.sequences[0].tokens[:8]


def test_non_finite_generator_weights_fail_the_sample_instead_of_null_logprobs(engine):
    model = engine._resource("r").loaded.model
    with torch.no_grad():
        model.get_output_embeddings().base.weight[7].fill_(float("nan"))
    with pytest.raises(NonFiniteLoss, match="logits are not finite"):
        sample(engine, "r", "s", SampleRequest(((5, 6, 7),), 2, GREEDY))
