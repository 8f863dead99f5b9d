"""One decode step's tokens: drawn on the device for every live row, then recorded on the host.

`draw` samples one token per live row from its logits (sampling_math.py: temperature, top-k,
top-p, one inverse-CDF draw from the row's own random stream) with its untempered float32
logprob (train/logprobs.py), reading nothing back. `record_steps` takes a block's read-back
tokens and appends each row's up to its stop (a stop token id, EOS unless the row's params turn
it off, a stop string, max_tokens), dropping what a row computed past it. The decode loop that
calls them is sampler.py.

Legend: B = rows in a pass, V = vocab, K = passes in a block.
"""

from __future__ import annotations

import math

from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows, SampledRow
from posttrain.engine.generate.prefill import GeneratorModel
from posttrain.engine.generate.sampling_math import choose_tokens, hit_stop_string
from posttrain.engine.train.logprobs import log_softmax_float32
from posttrain.errors import NonFiniteLoss
from posttrain.types import StopReason


def record(gm: GeneratorModel, row: SampledRow, token: int, logprob: float) -> None:
    """Append a sampled token; set the row's stop reason when it ends here (the rule is
    SamplingParams's: a stop token id, EOS unless stop_at_eos is off, or a completed stop
    string ends it with STOP, the token kept; else max_tokens with LENGTH)."""
    row.tokens.append(token)
    row.logprobs.append(logprob)
    params = row.params
    if (
        token in params.stop_token_ids
        or (params.stop_at_eos and token in gm.eos_token_ids)
        or hit_stop_string(gm.tokenizer, row.tokens, params.stop)
    ):
        row.stop_reason = StopReason.STOP
    elif len(row.tokens) >= row.max_tokens:
        row.stop_reason = StopReason.LENGTH


def draw(batch: LiveRows, logits_BV: Tensor) -> tuple[Tensor, Tensor]:
    """One token per live row and its logprob ([B] each), on the device: nothing read back."""
    logprobs_BV = log_softmax_float32(logits_BV)
    tokens_B = choose_tokens(
        logprobs_BV,
        batch.temperature_B,
        batch.top_k_B,
        batch.top_p_B,
        batch.uniforms(),
        batch.kind,
    )
    batch.last_tokens_B = tokens_B
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def record_steps(
    gm: GeneratorModel,
    batch: LiveRows,
    tokens_KB: list[list[int]],
    logprobs_KB: list[list[float]],
    routes_K: list[Tensor] | None = None,
) -> list[int]:
    """Record the K steps' tokens of every live row in order, each row up to its stop (the
    tokens a row computed after it stopped are dropped: its random stream is its own, so no
    other row saw them); returns the batch positions still live. `routes_K`: step k's
    routes [B, 1, L, K], kept for the rows that were live when step k fed their last token."""
    rows = batch.rows
    for k, (tokens, logprobs) in enumerate(zip(tokens_KB, logprobs_KB, strict=True)):
        for i, (r, token, logprob) in enumerate(zip(batch.live, tokens, logprobs, strict=True)):
            row = rows[r]
            if row.stop_reason is not None:
                continue
            if not math.isfinite(logprob):
                # Finite logits give finite logprobs for every token the draw can pick (it
                # never picks a zero-probability token), so only non-finite logits get here:
                # NaN or infinite generator weights, or a forward that overflowed. No sample
                # answers null.
                raise NonFiniteLoss(
                    "the generator's logits are not finite (non-finite weights?): a sampled"
                    " token would have no logprob, so no sample of this pass is returned"
                )
            if routes_K is not None and row.routes is not None:
                row.routes.append(routes_K[k][i, 0])
            record(gm, row, token, logprob)
    return [i for i, r in enumerate(batch.live) if rows[r].stop_reason is None]
