"""Shared-prefix attention (model/attention.py, model/fanout_kv_cache.py) against attention
over each row's full sequence, and the attention implementation it installs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import BUILTIN_MODEL_DIR
from posttrain.model import attention
from posttrain.model.fanout_kv_cache import FanoutKVCache
from posttrain.model.kv_cache import KVCache

LAYERS, KV_HEADS, QUERY_HEADS, HEAD_DIM = 2, 2, 6, 8


def kv_cache(
    rows: int,
    capacity: int,
    *,
    layers: int = LAYERS,
    heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
) -> KVCache:
    return KVCache(
        num_layers=layers,
        num_rows=rows,
        capacity=capacity,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


class Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index


def reference(query, keys, values, positions, window):
    """One row: query [Hq, Q, D] at absolute positions [Q] over keys/values [Hkv, T, D] at
    positions 0..T-1, causal (and windowed), grouped-query heads."""
    repeat = QUERY_HEADS // KV_HEADS
    keys = keys.repeat_interleave(repeat, 0)
    values = values.repeat_interleave(repeat, 0)
    scores = query @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    columns = torch.arange(keys.shape[1])
    visible = columns[None, :] <= positions[:, None]
    if window is not None:
        visible &= columns[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # [Q, Hq, D]


@pytest.mark.parametrize(
    "group_of_row",
    [
        [0, 2, 0, 1, 2, 0],  # groups of 3, 1 and 2 rows, interleaved: slots are gathered
        [0, 0, 1, 1, 2, 2],  # full groups in order: the group layout is a view of the rows
    ],
)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fused", [True, False])  # the CPU flash kernel / explicit matmuls
def test_rows_over_shared_prefixes_equal_attention_over_their_full_sequences(
    window, group_of_row, fused
):
    generator = torch.Generator().manual_seed(0)
    prompt_lengths = [7, 3, 11]
    own_before = [2, 0, 5, 1, 3, 4]  # tokens each row already generated
    new = [3, 1, 2, 3, 1, 2]  # a multi-token pass with right padding

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    prompts = [rand(LAYERS, 2, KV_HEADS, n, HEAD_DIM) for n in prompt_lengths]
    own_kv = [rand(LAYERS, 2, KV_HEADS, n, HEAD_DIM) for n in own_before]
    prefix = kv_cache(3, max(prompt_lengths))
    for row, kv in enumerate(prompts):
        prefix.write_span(row, 0, kv)
    own = kv_cache(len(group_of_row), 12)
    for row, kv in enumerate(own_kv):
        own.write_span(row, 0, kv)
    # Prefix ids need not be row numbers.
    cache = FanoutKVCache(prefix, [10, 11, 12], own, [10 + g for g in group_of_row])
    positions = cache.begin(torch.tensor(new))
    layer_type = "sliding_attention" if window else "full_attention"
    mask = cache.attention_masks(positions, [layer_type], window)[layer_type]
    # A window can hide a whole prompt, which only the explicit path handles.
    assert mask.fused == (window is None)
    mask = dataclasses.replace(mask, fused=fused and window is None)
    width = max(new)
    new_kv = rand(LAYERS, 2, len(new), KV_HEADS, width, HEAD_DIM)
    queries = rand(LAYERS, len(new), QUERY_HEADS, width, HEAD_DIM)
    outputs = []
    for layer in range(LAYERS):
        keys, values = cache.update(new_kv[layer, 0], new_kv[layer, 1], layer)
        out, _ = attention.attention_forward(
            Layer(layer), queries[layer], keys, values, mask, scaling=HEAD_DIM**-0.5
        )
        outputs.append(out)
    cache.commit()
    for row, group in enumerate(group_of_row):
        start = prompt_lengths[group] + own_before[row]
        assert positions[row, : new[row]].tolist() == list(range(start, start + new[row]))
        for layer in range(LAYERS):
            full = torch.cat(
                [prompts[group][layer], own_kv[row][layer], new_kv[layer, :, row, :, : new[row]]],
                dim=2,
            )  # [2, Hkv, T, D]
            expected = reference(
                queries[layer, row, :, : new[row]],
                full[0],
                full[1],
                positions[row, : new[row]],
                window,
            )
            torch.testing.assert_close(
                outputs[layer][row, : new[row]], expected, rtol=1e-5, atol=1e-5
            )
    assert cache.own.lengths_B.tolist() == [b + n for b, n in zip(own_before, new, strict=True)]
    # The Cache protocol's length counts the prefix too.
    assert cache.get_seq_length() == max(
        prompt_lengths[g] + b + n for g, b, n in zip(group_of_row, own_before, new, strict=True)
    )
    assert cache.longest_own() == max(b + n for b, n in zip(own_before, new, strict=True))


def test_keep_frees_prefixes_no_row_reads_and_keeps_the_rest_intact():
    prefix = kv_cache(3, 4, layers=1, heads=1, head_dim=2)
    for row in range(3):
        prefix.write_span(row, 0, torch.full((1, 2, 1, row + 2, 2), float(row)))
    own = kv_cache(4, 2, layers=1, heads=1, head_dim=2)
    cache = FanoutKVCache(prefix, [0, 1, 2], own, [0, 1, 2, 2])
    cache.keep(torch.tensor([3, 2]))  # the rows of prompt 0 and 1 ended
    assert cache.group_ids_B == [2, 2]
    assert prefix.num_rows == 1 and cache.prefix_row == {2: 0}
    assert prefix.lengths_B[0] == 4
    assert bool((prefix.kv[:, :, 0, :, :4] == 2.0).all())
    slot_B, rows_per_group, prefix_lengths_B = cache._group_layout()
    assert slot_B is None and rows_per_group == 2  # one full group: rows are its slots
    assert prefix_lengths_B.tolist() == [4, 4]


def test_keep_fills_a_dead_prompts_row_from_the_end_and_leaves_the_others_in_place():
    # A stream frees a prompt at almost every block: the rows after it must not all shift.
    prefix = kv_cache(5, 3, layers=1, heads=1, head_dim=2)
    for row in range(5):
        prefix.write_span(row, 0, torch.full((1, 2, 1, 3, 2), float(row)))
    own = kv_cache(5, 2, layers=1, heads=1, head_dim=2)
    cache = FanoutKVCache(prefix, [10, 11, 12, 13, 14], own, [10, 11, 12, 13, 14])
    assert cache._group_layout()[0] is None
    cache.keep(torch.tensor([0, 4, 2, 3]))  # the row of prompt 11 ended: the last fills it
    assert cache.group_ids_B == [10, 14, 12, 13]
    assert cache.prefix_row == {10: 0, 14: 1, 12: 2, 13: 3}
    assert prefix.num_rows == 4
    # Prompts 12 and 13 stayed in their rows (shifting them down copied every later prompt).
    for row, value in enumerate([0.0, 4.0, 2.0, 3.0]):
        assert bool((prefix.kv[:, :, row, :, :3] == value).all())
    slot_B, rows_per_group, _ = cache._group_layout()
    assert slot_B is None and rows_per_group == 1  # prompt b still serves row b


def test_the_installed_implementation_is_sdpa_for_ordinary_masks():
    model = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32).eval()
    ids = torch.randint(3, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    padding = torch.tensor([[1] * 10, [0] * 3 + [1] * 7])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=padding).logits
        attention.install(model)
        assert model.config._attn_implementation == attention.IMPLEMENTATION
        after = model(input_ids=ids, attention_mask=padding).logits
    assert torch.equal(before, after)
    attention.install(model)  # idempotent
    # A model sdpa cannot serve (eager attention, e.g. Gemma 2's soft-capped scores) gets the
    # generic path: its own eager attention, unchanged outside sampler passes.
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager_before = model(input_ids=ids, attention_mask=padding).logits
        attention.install(model)
        assert model.config._attn_implementation == attention.EAGER_IMPLEMENTATION
        eager_after = model(input_ids=ids, attention_mask=padding).logits
    assert torch.equal(eager_before, eager_after)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="cannot be served"):
        attention.install(model)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_uniform_decode_passes_give_the_masks_positions_and_placeholder_of_plain_ones(layer_type):
    """begin(..., uniform=(1, longest)) (the sampler's decode passes: every row holds the same
    own length) reads nothing back from the device and changes nothing it computes, over
    passes that reuse what the cache keeps per layout."""
    prompt_lengths, own_length = [5, 2, 7], 3
    group_of_row = [0, 2, 0, 1]

    def fanout() -> FanoutKVCache:
        generator = torch.Generator().manual_seed(3)
        prefix = kv_cache(3, max(prompt_lengths))
        for row, n in enumerate(prompt_lengths):
            prefix.write_span(
                row, 0, torch.randn(LAYERS, 2, KV_HEADS, n, HEAD_DIM, generator=generator)
            )
        own = kv_cache(len(group_of_row), 8)
        for row in range(len(group_of_row)):
            own.write_span(row, 0, torch.zeros(LAYERS, 2, KV_HEADS, own_length, HEAD_DIM))
        return FanoutKVCache(prefix, [0, 1, 2], own, group_of_row)

    ones = torch.ones(len(group_of_row), dtype=torch.int64)
    passes: dict[bool, list] = {False: [], True: []}
    for hinted in (False, True):
        cache = fanout()
        for step in range(3):
            uniform = (1, own_length + step + 1) if hinted else None
            positions = cache.begin(ones, uniform)
            mask = cache.attention_masks(positions, [layer_type], 3)[layer_type]
            passes[hinted].append((positions, mask, cache.placeholder_columns(positions)))
            assert cache.own.visible_columns() == own_length + step + 1
            cache.commit()
    for (positions, plain, columns), (hinted_positions, hinted, hinted_columns) in zip(
        passes[False], passes[True], strict=True
    ):
        assert torch.equal(positions, hinted_positions)
        assert columns == hinted_columns == int(positions.max()) + 1
        for name in ("prefix_bias_BQP", "own_bias_BQS"):
            a, b = getattr(plain, name), getattr(hinted, name)
            # A plain pass finds every own column visible too (None) unless a window hides some.
            assert (a is None and b is None) or torch.equal(a, b), name
        assert plain.fused == hinted.fused and torch.equal(plain.prefix_kv, hinted.prefix_kv)
