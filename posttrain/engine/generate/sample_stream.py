"""Sample operations decoded as a stream on one resource: operations join a running generation
between decode blocks and leave it, each as soon as its every sequence ended.

A SampleStream is a sampler.Decoding in terms of sample operations ((session, SampleRequest)
items, as generator.sample_batch takes them): `admit` turns an operation's prompts into
GenerationRequests routed to its session's generator, `block` runs one decode block, and
`take_finished` hands over the operations completed since (one result per prompt, as
sample_batch gives). Its caller (the scheduler's sample pass, not wired yet) decides what
joins when, and may run other work between blocks.

One generation runs on one model: a full-weight session samples its own model copy, so only
operations whose sessions sample the stream's model may join (`can_join`).
"""

from __future__ import annotations

from torch import nn

from posttrain.config import EngineConfig
from posttrain.engine.generate.generator import generator_model, sampling_model, served
from posttrain.engine.generate.sampler import Decoding, GenerationRequest
from posttrain.engine.state import ResourceState, SessionState
from posttrain.types import SampleRequest, SampleResult


class SampleStream:
    """Sample operations of one resource sharing decode passes as they come and go."""

    def __init__(
        self,
        config: EngineConfig,
        resource: ResourceState,
        model: nn.Module,
        *,
        block_steps: int | None = None,
    ) -> None:
        """An idle stream sampling `model` (generator.sampling_model of its sessions)."""
        self.resource = resource
        self.model = model
        self.decoding = Decoding(
            generator_model(config, resource, model), [], resource.served, block_steps
        )
        self._item_of_request: list[int] = []
        self._results: list[list[SampleResult | None]] = []  # per item, per prompt
        self._open: list[int] = []  # per item, prompts not finished
        self._first_request: list[int] = []  # per item, its first request's index

    @property
    def running(self) -> bool:
        return bool(self.decoding.running)

    def can_join(self, session: SessionState) -> bool:
        return sampling_model(self.resource, session) is self.model

    def admit(self, items: list[tuple[SessionState, SampleRequest]]) -> list[int]:
        """Operations joining at this block boundary; returns their ids in this stream (in
        order from 0, as take_finished names them)."""
        ids, requests = [], []
        for session, request in items:
            assert self.can_join(session), "one generation runs on one model"
            served(self.resource, session)
            item = len(self._results)
            ids.append(item)
            self._results.append([None] * len(request.prompts))
            self._open.append(len(request.prompts))
            self._first_request.append(len(self._item_of_request))
            for prompt in request.prompts:
                self._item_of_request.append(item)
                requests.append(
                    GenerationRequest(
                        prompt,
                        request.num_samples,
                        request.sampling_params,
                        session.generator_key,
                        prompt_logprobs=request.prompt_logprobs,
                        topk_prompt_logprobs=request.topk_prompt_logprobs,
                        return_routed_experts=request.return_routed_experts,
                    )
                )
        self.decoding.admit(requests)
        return ids

    def weights_published(self, served_changed: bool) -> None:
        """After a PIPELINE weights-sync between blocks (sampler.Decoding.weights_published)."""
        if self.running:
            self.decoding.weights_published(served_changed)

    def block(self) -> None:
        """One decode block of every running sequence."""
        self.decoding.block()

    def take_finished(self) -> list[tuple[int, list[SampleResult]]]:
        """(id, one result per prompt) of the operations completed since the last call."""
        done = []
        for index, result in self.decoding.take_finished():
            item = self._item_of_request[index]
            self._results[item][index - self._first_request[item]] = result
            self._open[item] -= 1
            if self._open[item] == 0:
                results = self._results[item]
                assert all(r is not None for r in results)
                done.append((item, [r for r in results if r is not None]))
        return done
