"""The decode loop's live rows (engine/generate/decode_rows.py): uniforms drawn ahead are exactly
the per-step draws of each row's own generator, across refills and rows leaving; the batch's
sampling kind decided on the host agrees with the device-side rule; one host transfer gives
the exact tokens and float32 logprobs."""

from __future__ import annotations

import torch

from posttrain.engine.generate import decode_rows
from posttrain.engine.generate.decode_rows import LiveRows, SampledRow
from posttrain.engine.generate.sampling_math import (
    GREEDY,
    PLAIN,
    batch_kind,
    choose_tokens,
    choose_tokens_static,
    is_plain,
    row_seed,
)
from posttrain.types import SamplingParams

VOCAB = 50


def rows_of(params: list[SamplingParams]) -> list[SampledRow]:
    rows = []
    for j, p in enumerate(params):
        generator = None
        if p.temperature > 0:
            generator = torch.Generator().manual_seed(row_seed(p.seed, j))
        rows.append(SampledRow(0, 0, "a", p, generator))
    return rows


def test_uniforms_drawn_ahead_equal_one_draw_per_step_across_refills_and_rows_leaving(
    monkeypatch,
):
    monkeypatch.setattr(decode_rows, "DRAWS_AHEAD", 4)  # several refills in 11 steps
    params = [SamplingParams(max_tokens=11 + j, temperature=1.0, seed=7) for j in range(5)]
    params[2] = SamplingParams(max_tokens=11, temperature=0.0)  # greedy: draws nothing
    rows = rows_of(params)
    expected = {  # each row's generator asked for one float per step, as before
        j: [float(torch.rand((), generator=g)) for _ in range(11)]
        for j, g in ((j, rows_of(params)[j].generator) for j in range(5))
        if g is not None
    }
    batch = LiveRows(rows, list(range(5)), torch.device("cpu"), VOCAB)
    seen: dict[int, list[float]] = {j: [] for j in range(5)}
    for step in range(11):
        column = batch.uniforms().tolist()
        for position, r in enumerate(batch.live):
            seen[r].append(column[position])
            rows[r].tokens.append(0)
        if step == 5:
            batch.keep([4, 1, 2])  # rows 0 and 3 leave, row 4 moves into a hole
    for j, values in expected.items():
        assert seen[j] == values[: len(seen[j])], j
    assert seen[2] == [0.0] * 11 and len(seen[0]) == 6 and len(seen[4]) == 11


def test_host_kind_agrees_with_the_device_rule_and_changes_no_token():
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(4, VOCAB, generator=generator) * 3, dim=-1)
    uniform = torch.rand(4, generator=generator)
    cases = [
        [SamplingParams(temperature=0.0)] * 4,
        [SamplingParams(temperature=1.0)] * 2 + [SamplingParams(temperature=1.0, top_k=VOCAB)] * 2,
        [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)] * 2,
        [SamplingParams(temperature=1.0, top_p=0.9)] * 4,
    ]
    for params, kind in zip(cases, [GREEDY, PLAIN, None, None], strict=True):
        assert batch_kind(params, VOCAB) == kind
        temperature = torch.tensor([p.temperature for p in params])
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        plain = is_plain(temperature, top_k, top_p, VOCAB).tolist()
        assert plain == [is_plain(p.temperature, p.top_k, p.top_p, VOCAB) for p in params]
        hinted = choose_tokens(logprobs, temperature, top_k, top_p, uniform, kind)
        assert torch.equal(hinted, choose_tokens(logprobs, temperature, top_k, top_p, uniform))


def test_one_transfer_gives_exact_tokens_and_float32_logprobs_of_a_block():
    batch = LiveRows(rows_of([SamplingParams()] * 3), [0, 1, 2], torch.device("cpu"), VOCAB)
    tokens_KB = torch.tensor([[0, 151935, 2**40], [7, 8, 9]])  # two steps of three rows
    logprobs_KB = torch.tensor(
        [[-1e-30, -3.3, float("-inf")], [-0.5, -1e-7, -20.25]], dtype=torch.float32
    )
    tokens, logprobs = batch.to_host(tokens_KB, logprobs_KB)
    assert tokens == tokens_KB.tolist() and all(isinstance(t, int) for k in tokens for t in k)
    assert logprobs == logprobs_KB.tolist()


def test_the_static_choice_draws_what_choose_tokens_draws_without_host_reads():
    # Every kind of row in one batch (greedy, plain, tempered, top-k, top-p, a temperature so
    # small every tempered logprob is -inf), many uniforms: the same tokens, byte for byte.
    generator = torch.Generator().manual_seed(3)
    rows = 7
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 1e-40, 1.0])
    top_k = torch.tensor([0, 0, 0, 5, 0, 0, VOCAB])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.6, 1.0, 1.0])
    for _ in range(20):
        logprobs = torch.log_softmax(torch.randn(rows, VOCAB, generator=generator) * 3, dim=-1)
        uniform = torch.rand(rows, generator=generator)
        expected = choose_tokens(logprobs, temperature, top_k, top_p, uniform)
        got = choose_tokens_static(logprobs, temperature, top_k, top_p, uniform, None)
        assert torch.equal(got, expected)
    for kind, t in ((GREEDY, 0.0), (PLAIN, 1.0)):
        same = torch.full((rows,), t)
        expected = choose_tokens(logprobs, same, top_k * 0, top_p * 0 + 1, uniform, kind)
        got = choose_tokens_static(logprobs, same, top_k * 0, top_p * 0 + 1, uniform, kind)
        assert torch.equal(got, expected)
