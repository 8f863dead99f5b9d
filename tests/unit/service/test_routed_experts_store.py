"""The routed-experts store: keys belong to their session, expire after their TTL, and the
least recently used go first when the memory budget is full; a refused key names the field."""

from __future__ import annotations

import pytest

from posttrain.errors import InvalidRequest
from posttrain.service.durability.routed_experts import RoutedExpertsStore
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


def distinct(tokens: int, fill: int) -> ExpertRoutes:
    return ExpertRoutes(tokens, 2, 2, bytes([fill]) * (8 * tokens))


def test_keys_on_disk_outlive_the_store_that_made_them(tmp_path):
    """A restarted server's store serves the keys a COMPLETED sample reported, bit for bit,
    with the TTL they had; one file per sample operation."""
    clock = Clock()
    first = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20, clock=clock, directory=tmp_path)
    sequences = [
        SampledSequence([7, 8], [-0.1, -0.2], StopReason.LENGTH, 0, distinct(4, 1)),
        SampledSequence([9], [-0.3], StopReason.STOP, 0, distinct(2, 2)),
    ]
    (result,) = first.keyed("s", [SampleResult(sequences, [])])
    made = {
        seq.routed_experts_key: routes
        for seq, routes in zip(result.sequences, (distinct(4, 1), distinct(2, 2)), strict=True)
    }
    other = first.put("t", distinct(5, 9))
    assert len(list(tmp_path.iterdir())) == 2

    clock.now += 30
    again = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20, clock=clock, directory=tmp_path)
    for key, value in made.items():
        assert again.get("s", key, "p") == value
    refused(again, "s", other)  # still another session's
    assert again.get("t", other, "p") == distinct(5, 9)
    clock.now += 30.1  # the TTL runs from when the key was made, not from the restart
    for key in made:
        refused(again, "s", key)
    assert list(tmp_path.iterdir()) == []  # expired keys leave no files


def test_a_file_goes_when_its_last_key_does(tmp_path):
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=2 * 8 * 4, directory=tmp_path)
    store.put_many("s", [distinct(4, 1), distinct(4, 2)])  # one file, 64 bytes of routes
    (path,) = tmp_path.iterdir()
    store.put("s", distinct(4, 3))  # over budget: the oldest key goes, its file stays
    assert path.exists() and len(store) == 2
    store.put("s", distinct(4, 4))
    assert not path.exists() and len(store) == 2
    store.drop_session("s")
    assert list(tmp_path.iterdir()) == []


def test_a_crash_mid_write_leaves_no_key_and_no_litter(tmp_path):
    store = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20, directory=tmp_path)
    kept = store.put("s", distinct(3, 5))
    (tmp_path / "b_cut.routes.tmp").write_bytes(b'{"session_id": "s"')  # killed mid-write
    (tmp_path / "b_bad.routes").write_bytes(b"not a header\n")
    again = RoutedExpertsStore(ttl_s=60, budget_bytes=1 << 20, directory=tmp_path)
    assert again.get("s", kept, "p") == distinct(3, 5) and len(again) == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".routes"]
