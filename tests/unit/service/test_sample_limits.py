"""A sample request's limits at submit (service/operations/submit.py): max_tokens None resolved to
what the context length and the operation token limit leave, and top-k prompt logprobs
refused above MAX_TOPK_PROMPT_LOGPROBS, naming the field. The fake engine's context is 1024."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine, wire, wired_fixture  # noqa: F401

from posttrain.config import LimitsConfig
from posttrain.errors import InvalidRequest
from posttrain.service.operations.submit import resolved_max_tokens
from posttrain.statuses import OperationStatus
from posttrain.types import (
    MAX_TOPK_PROMPT_LOGPROBS,
    OperationKind,
    SampleRequest,
    SamplingParams,
)

SAMPLE = OperationKind.SAMPLE
NONE = SamplingParams(max_tokens=None)


def test_max_tokens_none_is_what_the_context_leaves_after_the_longest_prompt():
    request = SampleRequest(((1,) * 10, (2,) * 30), 4, NONE)
    resolved = resolved_max_tokens(request, 1024, LimitsConfig())
    assert resolved.sampling_params == SamplingParams(max_tokens=1024 - 30)
    assert resolved.prompts == request.prompts and resolved.num_samples == 4
    given = SampleRequest(((1,) * 10,), 1, SamplingParams(max_tokens=7))
    assert resolved_max_tokens(given, 1024, LimitsConfig()) is given


def test_max_tokens_none_stays_within_the_operation_token_limit():
    request = SampleRequest(((1,) * 10, (2,) * 30), 4, NONE)
    limits = LimitsConfig(max_operation_tokens=1000)
    max_tokens = resolved_max_tokens(request, 1024, limits).sampling_params.max_tokens
    assert max_tokens == 105
    assert 4 * (10 + 30 + 2 * max_tokens) == 1000  # exactly the limit; one more is over


def test_a_prompt_that_fills_the_context_is_refused_naming_max_tokens(wired):
    sid = wired.session(wired.resource())
    full = SampleRequest(((3,) * 1024,), 1, NONE)
    with pytest.raises(InvalidRequest) as refused:
        wired.submit_op(sid, SAMPLE, full, "full")
    assert refused.value.param == "sampling_params.max_tokens"
    fits = wired.submit_op(sid, SAMPLE, SampleRequest(((3,) * 1023,), 2, NONE), "fits")
    wired.drain(wired.sessions.get("user_local", sid).resource_id)
    assert wired.op(fits.id).status == OperationStatus.COMPLETED


def test_top_k_prompt_logprobs_above_the_cap_is_refused_naming_the_field(wired):
    sid = wired.session(wired.resource())
    at_cap = SampleRequest(((3, 4),), topk_prompt_logprobs=MAX_TOPK_PROMPT_LOGPROBS)
    assert wired.submit_op(sid, SAMPLE, at_cap, "at").status == OperationStatus.PENDING
    over = SampleRequest(((3, 4),), topk_prompt_logprobs=MAX_TOPK_PROMPT_LOGPROBS + 1)
    with pytest.raises(InvalidRequest, match="topk_prompt_logprobs") as refused:
        wired.submit_op(sid, SAMPLE, over, "over")
    assert refused.value.param == "topk_prompt_logprobs"
