"""The routed-experts store: keys belong to their session, expire after their TTL, and the
least recently used go first when the memory budget is full; a refused key names the field."""

from __future__ import annotations

import pytest

from posttrain.errors import InvalidRequest
from posttrain.service.routed_experts import RoutedExpertsStore
from posttrain.types import ExpertRoutes, SampledSequence, SampleResult, StopReason


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def routes(tokens: int) -> ExpertRoutes:
    return ExpertRoutes(tokens, 2, 2, bytes(2 * tokens * 2 * 2))  # 8 bytes a token


def refused(store: RoutedExpertsStore, session: str, key: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        store.get(session, key, "samples[3].routed_experts_key")
    assert info.value.param == "samples[3].routed_experts_key"
    return info.value


def test_a_key_is_its_sessions_only():
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20)
    key = store.put("s1", routes(5))
    assert store.get("s1", key, "p") == routes(5)
    assert "unknown or expired" in refused(store, "s2", key).message
    assert "unknown or expired" in refused(store, "s1", "re_never").message


def test_a_key_expires_after_its_ttl():
    clock = Clock()
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20, clock=clock)
    key = store.put("s", routes(5))
    clock.now += 59.9
    store.get("s", key, "p")
    clock.now += 0.2
    refused(store, "s", key)
    assert len(store) == 0 and store.size_bytes() == 0


def test_the_least_recently_used_keys_go_first_when_memory_is_full():
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=3 * 80)  # three routes of 10 tokens
    first, second, third = (store.put("s", routes(10)) for _ in range(3))
    store.get("s", first, "p")  # now second is the least recently used
    fourth = store.put("s", routes(10))
    refused(store, "s", second)
    for key in (first, third, fourth):
        store.get("s", key, "p")
    assert store.size_bytes() == 3 * 80


def test_sample_results_carry_keys_and_training_samples_get_their_routes():
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20)
    sequences = [
        SampledSequence([7, 8], [-0.1, -0.2], StopReason.LENGTH, 0, routes(4)),
        SampledSequence([9], [-0.3], StopReason.STOP),
    ]
    (result,) = store.keyed("s", [SampleResult(sequences, [])])
    with_routes, without = result.sequences
    assert with_routes.routed_experts is None and with_routes.routed_experts_key
    assert without.routed_experts_key is None
    assert store.get("s", with_routes.routed_experts_key, "p") == routes(4)


def test_an_ended_session_leaves_no_routes():
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20)
    kept = store.put("s2", routes(3))
    for _ in range(3):
        store.put("s1", routes(3))
    store.drop_session("s1")
    assert len(store) == 1 and store.size_bytes() == len(routes(3).data)
    store.get("s2", kept, "p")
