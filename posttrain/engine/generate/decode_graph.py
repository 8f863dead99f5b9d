"""One decode pass of the sampler (generate/sampler.py) over persistent tensors, run eagerly
or replayed from a CUDA graph: the forward of every row's last token through a
StaticDecodeCache (model/static_decode_cache.py), the output head, and the draw.

Everything the pass reads or writes that changes from pass to pass lives in a tensor made
once per batch layout and updated in place: the last tokens (the pass overwrites them with
the new ones), this pass's uniforms (copied in before it runs), its logprobs, the cache's
own length and KV, the adapters' row routing (made once here, not per pass). So the pass's
kernels and addresses are the same every time: on CUDA it is captured once (after one
warm-up pass on a side stream, whose effects on the persistent tensors are undone) and
replayed, one launch instead of the hundreds of small kernels of a small model's step. On
other devices the same code runs eagerly, which is how the CPU tests check it.

Unsupported, left to the dynamic passes (sampler.py decides): sliding-window layers, MoE
models (expert dispatch sizes its work on the host, and routes are returned per pass), and
eager-attention families (Gemma 2's soft-capping; their shared prefixes are materialised
per pass).

Legend: B = rows of the layout, V = vocab.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from posttrain.engine.generate.decode_rows import LiveRows
from posttrain.engine.generate.prefill import (
    GeneratorModel,
    forward_rows,
    head_logits,
    layer_types,
    routing_of,
)
from posttrain.engine.generate.sampling_math import choose_tokens_static
from posttrain.engine.train.logprobs import log_softmax_float32
from posttrain.model import attention
from posttrain.model.static_decode_cache import StaticDecodeCache, static_decode_supported

log = logging.getLogger("posttrain")


def static_passes_supported(gm: GeneratorModel) -> bool:
    """Whether DecodeStep can run this model's decode passes (see the module docstring)."""
    config = gm.model.config.get_text_config()  # a vision-language model: its language model
    # A vision-language model's prompts prefill with its vision tower (generate/prefill.py),
    # which the static prefill steps do not run.
    return (
        gm.moe is None
        and gm.vision is None
        and config._attn_implementation == attention.IMPLEMENTATION
        and static_decode_supported(layer_types(config))
    )


class DecodeStep:
    """The decode pass of one batch layout; `run` advances every row of it by one token."""

    def __init__(
        self, gm: GeneratorModel, cache: StaticDecodeCache, batch: LiveRows, graph: bool
    ) -> None:
        assert batch.last_tokens_B is not None
        self.gm = gm
        self.cache = cache
        self.keys = batch.keys
        self.routing = routing_of(batch.keys, batch.device)
        # Copies: a join into padding rows (padding_joins.py) writes new rows' settings here.
        self.settings: tuple[Tensor, Tensor, Tensor] = (
            batch.temperature_B.clone(),
            batch.top_k_B.clone(),
            batch.top_p_B.clone(),
        )
        self.kind = batch.kind
        # Persistent inputs and outputs: the last tokens (overwritten with the new ones), the
        # uniforms, the new tokens' logprobs.
        self.tokens_B = batch.last_tokens_B.clone()
        self.uniforms_B = torch.zeros(len(batch.live), device=batch.device)
        self.logprobs_B = torch.zeros(len(batch.live), device=batch.device)
        self.graph = self._captured() if graph else None

    def run(self, uniforms_B: Tensor) -> None:
        """One pass: tokens_B and logprobs_B become the new tokens and their logprobs."""
        self.uniforms_B.copy_(uniforms_B)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._pass()

    def block(self, batch: LiveRows, steps: int) -> tuple[list[Tensor], list[Tensor]]:
        """`steps` passes (replayed graphs on CUDA): each step's tokens and logprobs [B],
        on the device."""
        tokens_KB: list[Tensor] = []
        logprobs_KB: list[Tensor] = []
        for _ in range(steps):
            self.run(batch.uniforms())
            tokens_KB.append(self.tokens_B.clone())
            logprobs_KB.append(self.logprobs_B.clone())
        batch.last_tokens_B = self.tokens_B
        return tokens_KB, logprobs_KB

    def refill(self, batch: LiveRows, restarted: list[tuple[list[int], int]]) -> None:
        """Rows joined into padding rows of this layout (padding_joins.py): `batch` holds
        them now, and each (positions, prompt length) of `restarted` names rows that restart
        empty on a prompt of that length. The persistent tensors take the new rows' settings
        in place (their last tokens LiveRows.refill wrote), so the captured pass replays on."""
        # A block of this layout ran (`block`), so the new rows' tokens went in place.
        assert batch.last_tokens_B is self.tokens_B
        for mine, theirs in zip(
            self.settings, (batch.temperature_B, batch.top_k_B, batch.top_p_B), strict=True
        ):
            mine.copy_(theirs)
        for positions, prompt_length in restarted:
            self.cache.refill(positions, prompt_length)

    def _pass(self) -> None:
        hidden_B1H = forward_rows(
            self.gm,
            self.cache,
            self.tokens_B[:, None],
            None,
            self.keys,
            adapter_routing=self.routing,
        )
        logits_BV = head_logits(self.gm, hidden_B1H[:, -1], self.keys, self.routing)
        logprobs_BV = log_softmax_float32(logits_BV)
        tokens_B = choose_tokens_static(logprobs_BV, *self.settings, self.uniforms_B, self.kind)
        self.logprobs_B.copy_(logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1))
        self.tokens_B.copy_(tokens_B)

    def _captured(self) -> torch.cuda.CUDAGraph | None:
        """The captured pass, or None (eager passes) when capture fails: an operation of the
        model that synchronises with the host or is otherwise not capturable. Nothing runs
        during a capture, so the persistent tensors are as before it."""
        try:
            return self._capture()
        except RuntimeError as error:
            log.warning("decode pass not captured in a CUDA graph, running it eagerly: %s", error)
            return None

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (lazy kernel and workspace set-up must not happen inside
        a capture), undo what that pass advanced, then capture one pass."""
        own_lengths_B = self.cache.fanout.own.lengths_B
        saved = [t.clone() for t in (self.tokens_B, self.cache.own_length_B, own_lengths_B)]
        # torch.cuda.Stream.__new__ carries no annotations in torch.
        side = torch.cuda.Stream(self.tokens_B.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.tokens_B.device))
        with torch.cuda.stream(side):
            self._pass()
        torch.cuda.current_stream(self.tokens_B.device).wait_stream(side)
        # The warm-up's KV write sits at the column the first real pass overwrites.
        for target, value in zip(
            (self.tokens_B, self.cache.own_length_B, own_lengths_B), saved, strict=True
        ):
            target.copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._pass()
        return graph
