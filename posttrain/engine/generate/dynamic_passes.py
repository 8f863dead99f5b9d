"""The sampler's decode passes whose shapes follow the rows (generate/sampler.py): each pass
runs the live rows through the FanoutKVCache at the own length they reached, so it reads only
the columns in use and finished rows have already left. The static-shape counterpart, whose
pass a CUDA graph can replay, is decode_graph.py.

Legend: B = rows in a pass, K = passes of a block.
"""

from __future__ import annotations

from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.draws import draw
from posttrain.engine.generate.prefill import GeneratorModel, forward_rows, head_logits
from posttrain.model.fanout_kv_cache import FanoutKVCache


def dynamic_block(
    gm: GeneratorModel,
    batch: LiveRows,
    cache: FanoutKVCache,
    steps: int,
    own_positions: int,
    ragged: bool,
    routes_K: list[Tensor] | None,
) -> tuple[list[Tensor], list[Tensor]]:
    """`steps` passes of every row of the batch, shapes following the rows' lengths; each
    step's tokens and logprobs [B] stay on the device (routes appended to routes_K).
    `own_positions`: what every row holds, or with `ragged` (rows that joined) the longest."""
    tokens_KB: list[Tensor] = []
    logprobs_KB: list[Tensor] = []
    for k in range(steps):
        assert batch.last_tokens_B is not None
        routes_out = [] if routes_K is not None else None
        hidden_B1H = forward_rows(
            gm,
            cache,
            batch.last_tokens_B[:, None],
            batch.ones_B,
            batch.keys,
            routes_out,
            uniform=(1, own_positions + k + 1),
            ragged=ragged,
        )
        if routes_K is not None:
            assert routes_out is not None
            routes_K.append(routes_out[0])
        tokens_B, logprobs_B = draw(batch, head_logits(gm, hidden_B1H[:, -1], batch.keys))
        tokens_KB.append(tokens_B)
        logprobs_KB.append(logprobs_B)
    return tokens_KB, logprobs_KB
