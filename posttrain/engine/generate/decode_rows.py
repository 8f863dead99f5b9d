"""The live rows of the sampler's decode loop (generate/sampler.py) and what a decode step
needs of them, kept ready between steps so a step does no per-row Python beyond recording tokens.

- Settings as tensors, and the batch's sampling kind decided once on the host (all greedy,
  all plain temperature-1, or mixed), so choose_tokens needs no device-side checks per step.
- Seeded uniforms drawn ahead: row j's torch.Generator gives the same stream whether it is
  asked for one float at a time or for a block (the CPU generator fills a block in order), so
  drawing DRAWS_AHEAD uniforms per row at once and handing out one column per step gives every
  row exactly the uniforms one draw per step gave. Every live row takes one uniform per step
  (greedy rows none; their column is 0 and unused), so one column index serves the whole
  block. Draws stay on the CPU generator (a seed means the same on every device); a block goes
  to the device in one copy. The generator is the row's own, so draws past a row's end are
  never seen.
- The last sampled token of every live row stays on the device for the next pass.
- One device-to-host transfer per block of decode steps (tokens and logprobs of every step
  together, through a pinned buffer on CUDA), instead of one sync per tensor or per step.

Legend: R = rows of the call, B = live rows, C = uniforms drawn ahead per row, K = steps of a
block, W = K * B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.engine.generate.sampling_math import GREEDY, batch_kind
from posttrain.types import SamplingParams, StopReason

# Uniforms drawn per row at a time: one torch.rand call per row per DRAWS_AHEAD steps instead
# of one per step (each call costs far more than the floats it makes).
DRAWS_AHEAD = 64


def max_tokens_of(params: SamplingParams) -> int:
    """A request's max_tokens: a number in the engine, since the service resolves None at
    submit (service/operations.py resolved_max_tokens)."""
    assert params.max_tokens is not None, "max_tokens None is resolved before the engine"
    return params.max_tokens


@dataclass
class SampledRow:
    """One sampled sequence."""

    request: int
    group: int
    adapter_key: str
    params: SamplingParams
    generator: torch.Generator | None  # None: greedy, draws nothing
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: StopReason | None = None
    # return_routed_experts: the experts of each generated token fed back, [L, K] each.
    routes: list[Tensor] | None = None

    @property
    def max_tokens(self) -> int:
        """The row's max_tokens (max_tokens_of its params)."""
        return max_tokens_of(self.params)


class LiveRows:
    """The live rows in cache order, with their per-row settings and uniforms."""

    def __init__(
        self, rows: list[SampledRow], live: list[int], device: torch.device, vocab: int
    ) -> None:
        self.rows = rows
        self.live = live
        self.device = device
        self.vocab = vocab
        self.last_tokens_B: Tensor | None = None  # set by the sampler after each draw
        self._ahead_BC: Tensor | None = None
        self._column = 0
        # Uniforms a row drew before it joined beyond the batch's columns: they come first at
        # its next draw ahead (join). Keyed by row (index into rows).
        self._carry: dict[int, Tensor] = {}
        self._host: Tensor | None = None  # pinned result buffer (CUDA only)
        self._refresh()

    def _refresh(self) -> None:
        params = [self.rows[r].params for r in self.live]
        self.temperature_B = torch.tensor([p.temperature for p in params], device=self.device)
        self.top_k_B = torch.tensor([p.top_k for p in params], device=self.device)
        self.top_p_B = torch.tensor([p.top_p for p in params], device=self.device)
        self.kind = batch_kind(params, self.vocab)
        self.keys = [self.rows[r].adapter_key for r in self.live]
        self.wants_routes = any(self.rows[r].routes is not None for r in self.live)
        self.ones_B = torch.ones(len(self.live), dtype=torch.int64, device=self.device)

    def keep(self, positions: list[int]) -> None:
        """Batch position i becomes old position positions[i]; the others leave."""
        self.live = [self.live[i] for i in positions]
        if self._carry:
            self._carry = {r: self._carry[r] for r in self.live if r in self._carry}
        index = torch.tensor(positions, dtype=torch.int64, device=self.device)
        if self._ahead_BC is not None:
            self._ahead_BC = self._ahead_BC.index_select(0, index)
        if self.last_tokens_B is not None:
            self.last_tokens_B = self.last_tokens_B.index_select(0, index)
        self._refresh()

    def join(self, other: LiveRows) -> None:
        """Append the live rows of `other` (rows of the same call that started apart: a
        request joining at a block boundary) after this batch's. Each row keeps its own
        stream: the running rows keep the columns they drew ahead; a joining row's unused
        uniforms fill the same columns, topped up from its own generator if it has fewer
        (exactly what it would have drawn next alone) and, if it has more, the rest wait in
        its carry for the next draw ahead. So a join costs a step per joining row, not per
        running row: a stream joins at almost every block beside hundreds of rows."""
        assert other.rows is self.rows, "rows of one call"
        width = self._columns_left()
        joining_NC = self._joining_columns(other, width)
        if width:
            assert self._ahead_BC is not None
            running_BC = self._ahead_BC[:, self._column :]
            self._ahead_BC = torch.cat([running_BC, joining_NC.to(self.device)])
        else:
            self._ahead_BC = None
        self._column = 0
        self.live = self.live + other.live
        assert self.last_tokens_B is not None and other.last_tokens_B is not None
        self.last_tokens_B = torch.cat([self.last_tokens_B, other.last_tokens_B])
        self._refresh()

    def refill(self, positions: list[int], other: LiveRows) -> None:
        """The live rows of `other` take batch positions `positions` (padding rows of a
        static layout: rows that ended; engine/generate/padding_joins.py), in order, keeping
        their own streams as in `join`; nothing else moves."""
        assert other.rows is self.rows, "rows of one call"
        assert self.last_tokens_B is not None and other.last_tokens_B is not None
        width = self._columns_left()
        joining_NC = self._joining_columns(other, width)
        index = torch.tensor(positions, dtype=torch.int64, device=self.device)
        if width:
            assert self._ahead_BC is not None
            self._ahead_BC[index, self._column :] = joining_NC.to(self.device)
        else:  # all used, or a greedy batch (none drawn): every row draws afresh next
            self._ahead_BC = None
        self.live = list(self.live)
        for b, r in zip(positions, other.live, strict=True):
            self._carry.pop(self.live[b], None)
            self.live[b] = r
        self.last_tokens_B[index] = other.last_tokens_B
        self._refresh()

    def _joining_columns(self, other: LiveRows, width: int) -> Tensor:
        """The next `width` uniforms of each of `other`'s live rows [N, width] (on the CPU):
        its uniforms drawn and not used, topped up from its own generator if it has fewer (what
        it would have drawn next alone); if it has more, the rest wait in its carry."""
        joining_NC = torch.zeros(len(other.live), width)
        for j, (r, pending) in enumerate(zip(other.live, other._pending(), strict=True)):
            taken = min(width, len(pending))
            joining_NC[j, :taken] = pending[:taken]
            if len(pending) > width:
                self._carry[r] = pending[width:]
            elif taken < width and (generator := self.rows[r].generator) is not None:
                torch.rand(width - taken, generator=generator, out=joining_NC[j, taken:])
        return joining_NC

    def _columns_left(self) -> int:
        """Columns drawn ahead that the live rows have not used yet (0 for a greedy batch,
        which draws nothing)."""
        if self._ahead_BC is None or self.kind == GREEDY:
            return 0
        return self._ahead_BC.shape[1] - self._column

    def _pending(self) -> list[Tensor]:
        """Each live row's uniforms drawn and not used yet, in order (on the CPU): its
        columns left, then its carry."""
        left_BC = None
        if self._columns_left():
            assert self._ahead_BC is not None, "columns left are columns drawn ahead"
            left_BC = self._ahead_BC[:, self._column :].cpu()
        pending = []
        for i, r in enumerate(self.live):
            parts = [left_BC[i]] if left_BC is not None else []
            if r in self._carry:
                parts.append(self._carry[r])
            pending.append(torch.cat(parts) if parts else torch.zeros(0))
        return pending

    def uniforms(self) -> Tensor:
        """This step's uniform of every live row [B] (0 for greedy rows, unused)."""
        if self.kind == GREEDY:
            return self.ones_B.new_zeros((), dtype=torch.float32).expand(len(self.live))
        if self._ahead_BC is None or self._column == self._ahead_BC.shape[1]:
            self._draw_ahead()
        assert self._ahead_BC is not None
        column = self._ahead_BC[:, self._column]
        self._column += 1
        return column

    def _draw_ahead(self) -> None:
        """The next C uniforms of every live row's generator, C no more than any row can use."""
        rows = [self.rows[r] for r in self.live]
        count = min(DRAWS_AHEAD, max(r.max_tokens - len(r.tokens) for r in rows))
        block_BC = torch.zeros(len(rows), count)
        for i, (r, row) in enumerate(zip(self.live, rows, strict=True)):
            drawn = 0
            if (carry := self._carry.pop(r, None)) is not None:
                drawn = min(count, len(carry))
                block_BC[i, :drawn] = carry[:drawn]
                if len(carry) > count:
                    self._carry[r] = carry[count:]
            if row.generator is not None and drawn < count:
                torch.rand(count - drawn, generator=row.generator, out=block_BC[i, drawn:])
        self._ahead_BC = block_BC.to(self.device, non_blocking=True)
        self._column = 0

    def to_host(
        self, tokens_KB: Tensor, logprobs_KB: Tensor
    ) -> tuple[list[list[int]], list[list[float]]]:
        """K steps' tokens and float32 logprobs of every row as Python lists [K][B]: one
        transfer for all (float64 holds every token id and float32 value exactly), through a
        pinned buffer on CUDA."""
        steps, rows = tokens_KB.shape
        both_2W = torch.stack(
            [tokens_KB.reshape(-1).to(torch.float64), logprobs_KB.reshape(-1).to(torch.float64)]
        )
        if both_2W.device.type == "cuda":
            if self._host is None or self._host.shape[1] < both_2W.shape[1]:
                self._host = torch.empty(both_2W.shape, dtype=torch.float64, pin_memory=True)
            host_2W = self._host[:, : both_2W.shape[1]]
            host_2W.copy_(both_2W, non_blocking=True)
            torch.cuda.current_stream(both_2W.device).synchronize()
            both_2W = host_2W
        tokens, logprobs = both_2W.tolist()
        return (
            [[int(t) for t in tokens[k * rows : (k + 1) * rows]] for k in range(steps)],
            [logprobs[k * rows : (k + 1) * rows] for k in range(steps)],
        )
