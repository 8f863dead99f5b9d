"""A sample stream's pool (sampler.Decoding.pool_rows, engine/generate/sample_stream.py): its
decode cache is allocated at the start for the rows that may join, so a join within the pool
leaves the running rows' KV where it was (the same tensors, the same values) and needs no
memory beyond its own estimate; a join past the pool reallocates (a copy admission reserves).
Either way every operation gets what it gets alone. The built-in model on the CPU, prefix cache
off; dynamic and static passes."""

from __future__ import annotations

import pytest
import torch
from test_stream_joins import assert_same, engine_for

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.engine.generate import sampler
from posttrain.engine.generate.joins import PREFIX_POOL_POSITIONS
from posttrain.engine.generate.sample_stream import SampleStream, pool_row_bytes
from posttrain.model.kv_cache import KVCache
from posttrain.types import SampleRequest, SamplingParams

RUNNING = SampleRequest(
    ((5, 6, 7, 8), (9, 10)),
    2,
    SamplingParams(max_tokens=20, temperature=0.9, seed=5, stop_at_eos=False),
)
JOINING = SampleRequest(
    ((11, 12, 13),), 3, SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=3)
)


def running_kv(stream: SampleStream) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(the data pointers of the own and prompt parts, copies of the running rows' KV in each
    and of their prompts'). The running rows and their prompts come first (a static layout's
    placeholder rows, and their prompts, after them)."""
    cache = stream.decoding.cache
    assert cache is not None
    own, prefix = cache.own, cache.prefix
    rows = len(stream.decoding.running)
    prompts = len(set(cache.group_ids_B[:rows]))
    own_used = int(own.lengths_B[:rows].max())
    prefix_used = int(prefix.lengths_B[:prompts].max())
    return (
        [own.kv.data_ptr(), prefix.kv.data_ptr()],
        own.kv[:, :, :rows, :, :own_used].clone(),
        prefix.kv[:, :, :prompts, :, :prefix_used].clone(),
    )


def run_with_join(pool: int) -> tuple[SampleStream, dict[int, list], bool]:
    """RUNNING (4 rows), JOINING (3 rows) at the third boundary, on a stream whose pool has
    `pool` rows; returns the stream, each operation's results, and whether the join left the
    running rows' storage and values as they were."""
    engine = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    resource = engine._resource("r")
    s, t = engine._session("r", "s")[1], engine._session("r", "t")[1]
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.reserve_rows(pool)
    stream.admit([(s, RUNNING)])
    finished: dict[int, list] = {}
    for _ in range(3):
        stream.block()
    assert stream.running_rows() == 4
    reserve = stream.join_reserve_bytes([(t, JOINING)])
    pointers, own_before, prefix_before = running_kv(stream)
    stream.admit([(t, JOINING)])
    # Beside dynamic passes the joining rows enter the cache in the next block's first pass
    # (joining_pass.py); the running rows' first positions are the ones to compare.
    stream.block()
    after, own_after, prefix_after = running_kv(stream)
    untouched = after == pointers and (
        torch.equal(own_after[:, :, :4, :, : own_before.shape[4]], own_before)
        and torch.equal(prefix_after[:, :, :2, :, : prefix_before.shape[4]], prefix_before)
    )
    assert (reserve == 0) == (pool >= 7), (pool, reserve)
    while stream.running:
        stream.block()
        finished.update(stream.take_finished())
    for item, (session, op) in enumerate([("s", RUNNING), ("t", JOINING)]):
        (alone,) = engine.sample_batch("r", [(session, op)])
        for ours, theirs in zip(finished[item], alone, strict=True):
            assert_same(ours, theirs)
    return stream, finished, untouched


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_join_within_the_pool_leaves_the_running_rows_kv_where_it_was(static, monkeypatch):
    monkeypatch.setattr(sampler, "CPU_STATIC_DECODE", static)
    stream, finished, untouched = run_with_join(pool=8)
    assert stream.decoding.static == static
    assert untouched
    assert sorted(finished) == [0, 1]
    cache = stream.decoding.cache
    assert cache is not None and cache.own.kv.shape[2] == 8  # the pool, not twice the rows


def test_a_join_past_the_pool_reallocates_and_reserves_the_copy():
    _, finished, untouched = run_with_join(pool=5)
    assert not untouched  # 4 running + 3 joining > 5: a new tensor of twice the rows
    assert sorted(finished) == [0, 1]


def test_a_joins_reserve_is_nothing_within_the_pool_and_twice_the_cache_past_it():
    engine = engine_for({BUILTIN_MODEL_ID: BUILTIN_MODEL_DIR}, BUILTIN_MODEL_ID)
    resource = engine._resource("r")
    s, t = engine._session("r", "s")[1], engine._session("r", "t")[1]
    stream = SampleStream(engine.config, resource, resource.loaded.model, block_steps=2)
    stream.reserve_rows(6)
    assert stream.join_reserve_bytes([(t, JOINING)]) == 0  # idle: a start, nothing to copy
    stream.admit([(s, RUNNING)])
    assert stream.join_reserve_bytes([(t, JOINING)]) == 2 * stream.kv_bytes()  # 4 + 3 > 6
    one = SampleRequest(((11, 12),), 2, JOINING.sampling_params)
    assert stream.join_reserve_bytes([(t, one)]) == 0  # 4 + 2 rows
    longer_prompt = SampleRequest(((3,) * (PREFIX_POOL_POSITIONS + 1),), 1, JOINING.sampling_params)
    assert stream.join_reserve_bytes([(t, longer_prompt)]) == 2 * stream.kv_bytes()
    # Decoding longer than the pool was sized for: the pool's growth to that length.
    long = SampleRequest(((11, 12),), 1, SamplingParams(max_tokens=300))
    per_position = stream._kv_per_position()
    growth = 6 * (pool_row_bytes(per_position, 0, 300) - pool_row_bytes(per_position, 0, 20))
    assert stream.join_reserve_bytes([(t, long)]) == growth
    assert growth == 6 * per_position * (2 * 512 - 2 * 20)
    # A pool row: a prompt row rounded up to the pool's width, the generated part twice.
    assert pool_row_bytes(10, 32, 100) == 10 * (PREFIX_POOL_POSITIONS + 2 * 100)
    assert stream.pool_row_bytes([(s, RUNNING)]) == per_position * (PREFIX_POOL_POSITIONS + 40)


def test_a_pool_keeps_its_rows_as_positions_grow_and_hands_out_zeroed_rows():
    cache = KVCache(
        num_layers=1,
        num_rows=2,
        capacity=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        pool_rows=6,
    )
    assert (cache.kv.shape[2], cache.free_rows) == (6, 4)
    assert torch.equal(cache.kv[:, :, :2], torch.zeros_like(cache.kv[:, :, :2]))
    cache.kv[:, :, 2:] = float("nan")  # what uninitialised pool rows may hold
    cache.kv[0, 0, :2, 0, :3] = torch.tensor([[1.0, 2.0, 3.0]] * 2)[:, :, None]
    cache.lengths_B[:2] = 3
    cache.grow(8)
    assert (cache.kv.shape[2], cache.capacity, cache.free_rows) == (6, 8, 4)
    assert cache.kv[0, 0, :2, 0, :3, 0].tolist() == [[1.0, 2.0, 3.0]] * 2
    assert cache.lengths_B[:2].tolist() == [3, 3]
    cache.kv[:, :, 2:] = float("nan")
    pointer = cache.kv.data_ptr()
    cache.add_rows(3)
    assert cache.kv.data_ptr() == pointer and cache.num_rows == 5
    assert torch.equal(cache.kv[:, :, 2:5], torch.zeros_like(cache.kv[:, :, 2:5]))
    assert cache.lengths_B[:5].tolist() == [3, 3, 0, 0, 0]
