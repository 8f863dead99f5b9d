"""The trainer: forward passes, losses, gradient accumulation and the optimizer step of the
sessions of one model resource.

A forward-backward of several sessions runs as one shared pass: rows are routed to their
session's trainer adapter (model/lora.py), rows of similar length share a model forward
(buckets.py), and one backward over the sum of the trainable losses fills every session's
gradients (accumulate.py). Gradients accumulate across calls until optim-step; a non-finite
loss or gradient fails its item and leaves that session's accumulated gradients as they were.

On a rank of a trainer group (ResourceState.group) the same code runs data parallel: the rank
forwards only its share of the rows, the others' logprobs are gathered from them, every member
is scored on the whole batch, and the gradients are summed over the ranks before their check
(parallel/data_parallel.py). With sharded parameters (parallel/fsdp.py) every rank runs the
same number of bucket forwards (aligned_forwards), so the ranks meet in the per-layer gathers.

Not here: the session table (hosts/in_process.py), generators (generate/), losses.py, optim/.

Legend: S = samples, T = tokens, B = rows of one bucket, L = longest row of a bucket,
H = hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.config import EngineConfig
from posttrain.engine.images import image_inputs
from posttrain.engine.parallel.fsdp import FsdpShards
from posttrain.engine.state import ResourceState, SessionState
from posttrain.engine.train.accumulate import accumulate_many, frozen
from posttrain.engine.train.batching import (
    PackedBatch,
    at_targets,
    member_loss_batch,
    pack,
    unpack,
)
from posttrain.engine.train.buckets import Routing, assemble, bucket_routing, plan_buckets
from posttrain.engine.train.expert_routes import forced_routes
from posttrain.engine.train.layer_checkpoint import checkpointed_layers
from posttrain.engine.train.logprobs import target_logprobs
from posttrain.engine.train.losses import LOSSES
from posttrain.engine.train.token_gradients import (
    TokenGradient,
    given_gradient,
    needed_by_members,
    token_gradient,
)
from posttrain.errors import NonFiniteLoss, Unsupported
from posttrain.model.logit_head import output_head
from posttrain.model.routing import replay as replay_routes
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimStepRequest,
)


@dataclass(frozen=True)
class _Member:
    """One item of a shared pass that passed its checks."""

    index: int  # its position in the caller's items
    session: SessionState
    request: ForwardBackwardRequest
    first_row: int  # its first row in the merged batch

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + len(self.request.samples))


@dataclass(frozen=True)
class _Scored:
    """A member's finite loss, before its gradients are known to be finite."""

    member: _Member
    loss: float
    metrics: dict[str, float]
    reported_ST: Tensor  # its logprobs (loss axis), 0.0 where excluded (report_all_logprobs)
    elementwise_ST: Tensor  # each token's share of the loss (losses.LossOutput)


def forward_backward_batch(
    config: EngineConfig,
    resource: ResourceState,
    items: list[tuple[SessionState, ForwardBackwardRequest]],
    *,
    checkpointed: bool = False,
) -> list[ForwardBackwardResult | Exception]:
    """Forward-backward of several sessions' requests in one shared pass; `checkpointed`: its
    decoder layers' activations recomputed in the backward (train/layer_checkpoint.py).

    Rows are routed to their session's adapter, so each session's loss and gradients depend
    on its own rows only. Each item succeeds or fails on its own: a non-finite item returns
    its exception and leaves its session's accumulated gradients untouched. At most one item
    per session (the scheduler keeps each session's order). The requests passed their loss
    checks at the API edge (posttrain/loss_specs.py): nothing here validates them again."""
    errors: dict[int, Exception] = {}
    members: list[_Member] = []
    first_row = 0
    for index, (session, request) in enumerate(items):
        members.append(_Member(index, session, request, first_row))
        first_row += len(request.samples)
    assert len({m.session.trainer_key for m in members}) == len(members), "one item per session"
    scored = _shared_pass(config, resource, members, errors, checkpointed) if members else {}
    is_always = config.loss_fn_outputs == "always"
    return [
        errors[index] if index in errors else _result(scored[index], is_always=is_always)
        for index in range(len(items))
    ]


def _shared_pass(
    config: EngineConfig,
    resource: ResourceState,
    members: list[_Member],
    errors: dict[int, Exception],
    checkpointed: bool,
) -> dict[int, _Scored]:
    """Forward every member's rows at once, score each with its loss, and back-propagate the
    trainable ones; a member that fails goes into `errors` instead of the result."""
    device = resource.loaded.device
    # The one packing of the request's samples: the members' loss inputs are views of it.
    merged = pack(tuple(s for m in members for s in m.request.samples), device)
    # A lone member needs no row selection: its adapter applies to every row.
    routing: Routing = [
        (m.session.trainer_key, m.rows if len(members) > 1 else None) for m in members
    ]
    train = any(not m.request.forward_only for m in members)
    scoring_only = [m.session for m in members if m.request.forward_only]
    scored: dict[int, _Scored] = {}
    gradient = None
    needed_ST = needed_by_members(merged, [(m.first_row, m.request) for m in members])
    if len(members) == 1 and train and resource.group is None:
        (lone,) = members
        loss_batch = member_loss_batch(merged, lone.rows, lone.request.samples)
        gradient = token_gradient(lone.request.loss, loss_batch)
    with (
        resource.sharded_operation(),
        torch.set_grad_enabled(train),
        frozen([p for s in scoring_only for _, p in s.optimizer.named_params] if train else []),
    ):
        logprobs_ST = _batch_logprobs(
            config, resource, merged, routing, gradient, needed_ST, checkpointed=checkpointed
        )
        trainable: list[tuple[_Member, Tensor]] = []
        for member in members:
            samples = member.request.samples
            loss_batch = member_loss_batch(merged, member.rows, samples)
            width = loss_batch.valid_ST.shape[1]
            rows_ST = logprobs_ST[member.first_row : member.rows.stop, :width]
            loss = member.request.loss
            output = LOSSES[loss.type](rows_ST, loss_batch, loss.params)
            loss_value = float(output.loss.detach())
            if not math.isfinite(loss_value):
                errors[member.index] = NonFiniteLoss(
                    f"loss is {loss_value}; nothing was accumulated"
                )
                continue
            shown_ST = loss_batch.valid_ST if member.request.report_all_logprobs else None
            shown_ST = output.included_ST if shown_ST is None else shown_ST
            reported_ST = torch.where(shown_ST, rows_ST.detach(), 0.0)
            scored[member.index] = _Scored(
                member, loss_value, output.metrics, reported_ST, output.elementwise_ST
            )
            if not member.request.forward_only:
                trainable.append((member, output.loss))
        if trainable:
            failed = accumulate_many(
                [(m.session, loss) for m, loss in trainable],
                group=resource.group,
                reduced=resource.reduced_in_backward(),
            )
            for (member, _), error in zip(trainable, failed, strict=True):
                if error is not None:
                    errors[member.index] = error
                    del scored[member.index]
    return scored


def _result(scored: _Scored, *, is_always: bool) -> ForwardBackwardResult:
    """The item's result; its per-token outputs when the server or the request asks for them."""
    member = scored.member
    if not (is_always or member.request.return_loss_fn_outputs):
        return ForwardBackwardResult(scored.loss, scored.metrics)
    lengths_S = [sample.loss_length for sample in member.request.samples]
    outputs = [
        unpack(values_ST, lengths_S) for values_ST in (scored.reported_ST, scored.elementwise_ST)
    ]
    return ForwardBackwardResult(scored.loss, scored.metrics, *outputs)


def custom_forward_backward(
    config: EngineConfig,
    resource: ResourceState,
    session: SessionState,
    request: CustomForwardBackwardRequest,
    *,
    checkpointed: bool = False,
) -> None:
    """Back-propagate sum_i sum_t g_it * logp_it (api.md 1.4.3); weights/mask not applied.
    `checkpointed`: as forward_backward_batch's."""
    device = resource.loaded.device
    packed = pack(request.samples, device)
    width = packed.targets_ST.shape[1]
    gradients_ST = torch.zeros(len(request.samples), width, device=device)
    for index, gradients_T in enumerate(request.gradients):
        gradients_ST[index, : len(gradients_T)] = torch.tensor(gradients_T)
    routing: Routing = [(session.trainer_key, None)]
    valid_ST = packed.loss_batch.valid_ST
    with resource.sharded_operation():
        if resource.group is None:
            gradient = given_gradient(gradients_ST, valid_ST)
            logprobs_ST = forward_logprobs(
                config, resource, packed, routing, gradient=gradient, checkpointed=checkpointed
            )
        else:  # the surrogate is a sum over rows: each rank back-propagates its own
            rows = resource.group.shares(packed.lengths_S)[resource.group.rank]
            forwards = aligned_forwards(config, resource, packed.lengths_S)
            logprobs_ST = forward_logprobs(
                config,
                resource,
                packed,
                routing,
                rows=rows,
                forwards=forwards,
                checkpointed=checkpointed,
            )
            gradients_ST, valid_ST = gradients_ST[rows], valid_ST[rows]
        surrogate = torch.where(valid_ST, gradients_ST * logprobs_ST, 0.0).sum()
        (error,) = accumulate_many(
            [(session, surrogate)], group=resource.group, reduced=resource.reduced_in_backward()
        )
    if error is not None:
        raise error


def optim_step(session: SessionState, request: OptimStepRequest) -> None:
    """Apply the accumulated gradients and clear them (optim/optimizer.py)."""
    session.optimizer.step(request)


def _batch_logprobs(
    config: EngineConfig,
    resource: ResourceState,
    merged: PackedBatch,
    routing: Routing,
    gradient: TokenGradient | None,
    needed_ST: Tensor | None,
    *,
    checkpointed: bool,
) -> Tensor:
    """The shared pass's [S, T] logprobs: forwarded here, or by a trainer group's ranks each
    forwarding its share of the rows (parallel/data_parallel.py). `gradient`: a lone member's
    per-token loss gradient (train/token_gradients.py), None otherwise; `needed_ST`: the
    positions any member's loss reads (None: all)."""
    if resource.group is None:
        return forward_logprobs(
            config,
            resource,
            merged,
            routing,
            gradient=gradient,
            needed_ST=needed_ST,
            checkpointed=checkpointed,
        )
    forwards = aligned_forwards(config, resource, merged.lengths_S)
    return resource.group.logprobs(
        lambda rows: forward_logprobs(
            config,
            resource,
            merged,
            routing,
            rows=rows,
            needed_ST=needed_ST,
            forwards=forwards,
            checkpointed=checkpointed,
        ),
        merged.lengths_S,
        merged.targets_ST.shape[1],
        resource.loaded.device,
    )


def forward_logprobs(
    config: EngineConfig,
    resource: ResourceState,
    packed: PackedBatch,
    routing: Routing,
    *,
    rows: list[int] | None = None,
    gradient: TokenGradient | None = None,
    needed_ST: Tensor | None = None,
    forwards: int | None = None,
    checkpointed: bool = False,
) -> Tensor:
    """float32 [S, T] logprob of each target (T on the loss axis), 0.0 at padding, each adapter of
    `routing` applied to its rows (positions in `packed`; None: every row). With `rows`, only
    those rows of `packed`, in that order: [len(rows), T].

    Rows of similar length share a forward (train/buckets.py), each padded only to its own
    longest row; the result has the layout of one padded forward over the whole batch.

    `forwards` (aligned_forwards): run exactly that many model forwards, the missing ones
    padding forwards of one batch row whose logprobs enter the result times 0, so the result
    and every gradient are exactly those without them. `checkpointed`: the decoder layers
    checkpointed (train/layer_checkpoint.py)."""
    valid_ST = packed.loss_batch.valid_ST
    if rows == [] and forwards is None:  # a trainer group's rank with no share of a batch
        return torch.zeros(0, valid_ST.shape[1], device=valid_ST.device)
    if rows is None:
        buckets = plan_buckets(packed.lengths_S, config.bucket_overhead_tokens)
        chosen = buckets
    else:  # buckets of positions in `rows`, forwarded as the batch rows they name
        buckets = plan_buckets([packed.lengths_S[r] for r in rows], config.bucket_overhead_tokens)
        chosen = [[rows[i] for i in bucket] for bucket in buckets]
        valid_ST = valid_ST[rows]
    pieces_BL = [
        _bucket_logprobs(
            config,
            resource,
            packed,
            bucket,
            bucket_routing(routing, bucket),
            gradient,
            needed_ST,
            checkpointed=checkpointed,
        )
        for bucket in chosen
    ]
    if not pieces_BL:  # a rank with no rows, forwarding padding alone
        return _padding_forwards(
            config,
            resource,
            packed,
            routing,
            forwards or 0,
            torch.zeros(valid_ST.shape, device=valid_ST.device),
            checkpointed=checkpointed,
        )
    logprobs_ST = assemble(pieces_BL, buckets, packed.targets_ST.shape[1])
    # Padding is computed inside a bucket but belongs to no sample: make it the same zeros
    # whichever bucket a row landed in.
    logprobs_ST = torch.where(valid_ST, logprobs_ST, 0.0)
    missing = (forwards or 0) - len(pieces_BL)
    return _padding_forwards(
        config, resource, packed, routing, missing, logprobs_ST, checkpointed=checkpointed
    )


def aligned_forwards(
    config: EngineConfig, resource: ResourceState, lengths_S: Sequence[int]
) -> int | None:
    """On a trainer group whose parameters are sharded (parallel/fsdp.py), the number of
    model forwards every rank runs: the most buckets of any rank's share, so the ranks meet in
    the same per-layer collectives, a rank with fewer buckets (or no rows) padding the rest.
    None (each rank its own buckets) otherwise."""
    group = resource.group
    if group is None or resource.param_shards is None:
        return None
    overhead = config.bucket_overhead_tokens
    counts = [
        len(plan_buckets([lengths_S[r] for r in share], overhead)) if share else 0
        for share in group.shares(lengths_S)
    ]
    return max(counts)


def _padding_forwards(
    config: EngineConfig,
    resource: ResourceState,
    packed: PackedBatch,
    routing: Routing,
    count: int,
    logprobs_ST: Tensor,
    *,
    checkpointed: bool,
) -> Tensor:
    """`logprobs_ST` after `count` forwards of the batch's shortest row whose logprobs it
    takes times 0: every value and every gradient stays exactly as it was (the logprobs are
    finite, so the products are zeros), but the forwards (and their backward) run, through
    every layer, as on the ranks with more buckets. The result depends on them even where
    `logprobs_ST` has no rows, so the backward reaches them on every rank."""
    if count <= 0:
        return logprobs_ST
    lengths_S = packed.lengths_S
    shortest = min(range(len(lengths_S)), key=lambda r: (lengths_S[r], r))
    one = [shortest]
    routed = bucket_routing(routing, one)
    zero = sum(
        _bucket_logprobs(config, resource, packed, one, routed, checkpointed=checkpointed).sum()
        * 0.0
        for _ in range(count)
    )
    return logprobs_ST + zero


def _bucket_logprobs(
    config: EngineConfig,
    resource: ResourceState,
    packed: PackedBatch,
    rows: list[int],
    routing: list[tuple[str, list[int] | None]],
    gradient: TokenGradient | None = None,
    needed_ST: Tensor | None = None,
    *,
    checkpointed: bool,
    in_root: bool = False,
) -> Tensor:
    """float32 [B, L] logprobs of one bucket's rows, L its longest row on the loss axis;
    `routing` in bucket positions; `gradient` in batch rows. Positions outside `needed_ST` get
    0, and the head runs only at the needed ones. A model sharded with FSDP2 runs it inside
    its root's forward, an untied head on each rank's vocabulary slice (parallel/fsdp.py).
    `checkpointed`: the decoder layers checkpointed, recomputed under this bucket's routing."""
    shards = resource.param_shards
    if isinstance(shards, FsdpShards) and not in_root:
        args = (config, resource, packed, rows, routing, gradient, needed_ST)
        return shards.forward(
            lambda: _bucket_logprobs(*args, checkpointed=checkpointed, in_root=True)
        )
    device = resource.loaded.device
    index_B = torch.tensor(rows, device=device)
    width = max(packed.lengths_S[row] for row in rows)
    loss_width = max(packed.loss_lengths_S[row] for row in rows)

    def take(values_ST: Tensor, columns: int = width) -> Tensor:
        return values_ST.index_select(0, index_B)[:, :columns]

    assignments = [
        (key, None if local is None else torch.tensor(local, device=device))
        for key, local in routing
    ]
    model, lora = resource.loaded.model, resource.lora
    forced = None
    if resource.loaded.moe is not None:
        routes_B = [packed.routes_S[row] for row in rows]
        forced = forced_routes(routes_B, width, resource.loaded.moe, device)
    layers = (
        checkpointed_layers(model, lambda: lora.route(assignments))
        if checkpointed
        else nullcontext()
    )
    with lora.route(assignments), replay_routes(forced) if forced else nullcontext():
        ids = take(packed.tokens_ST)  # sharded: embedded on each rank's rows (parallel/fsdp.py)
        inputs = shards.embedding_inputs(ids) if shards is not None else {"input_ids": ids}
        # Images enter through the model's own forward: its vision tower, the placement of
        # its embeddings and its position ids (M-RoPE) are the family's code.
        images = [image for row in rows for image in packed.images_S[row]]
        if images:
            if shards is not None:  # the sharded embedding gives inputs_embeds, not ids
                raise Unsupported(
                    "image chunks with a sharded model (--trainer-ranks) are not served",
                    param="model_input",
                )
            inputs.update(image_inputs(resource.loaded, images, ids))
        # No KV cache: a training forward reads none, and a checkpointed layer's recompute
        # would write it twice. No attention mask: rows are right-padded, so causal attention
        # alone keeps every real position from seeing padding (padded positions' outputs are
        # never read), and without a mask the model attends with the fused causal kernel
        # instead of building a [B, 1, L, L] mask (quadratic memory in a long row).
        with layers:
            hidden_BLH = model.base_model(**inputs, attention_mask=None, use_cache=False)
        hidden_BLH = hidden_BLH.last_hidden_state
        hidden_BLH = at_targets(packed, rows, loss_width, hidden_BLH)  # the loss axis
        # The backward of all buckets runs after this block: a head chunk recomputed then
        # must see this bucket's routing again.
        targets_BL = take(packed.targets_ST, loss_width)
        # The head's adapters select rows of the bucket: picked positions form one row, so
        # they are picked only when one adapter applies to every row. Not yet with the
        # token gradients of a trained head: that pair moved the two-rank test's gradients by
        # 3e-5 relative (tests/unit/engine/test_trainer_group.py allows 1e-5), not understood.
        is_one_adapter = len(assignments) == 1 and assignments[0][1] is None
        is_pickable = is_one_adapter and gradient is None
        needed_BL = take(needed_ST, loss_width) if needed_ST is not None and is_pickable else None
        # All needed, or none (the loss must still depend on the logprobs): every position.
        if needed_BL is None or bool(needed_BL.all()) or not bool(needed_BL.any()):
            rows_B1 = index_B.unsqueeze(1)
            hidden_1NH, targets_1N = hidden_BLH, targets_BL

            def at(start: int, logprobs_BC: Tensor) -> tuple[Tensor, Tensor]:
                columns = torch.arange(start, start + logprobs_BC.shape[1], device=device)
                return rows_B1, columns.unsqueeze(0)
        else:  # only the needed positions, as one row
            picked_b, picked_l = needed_BL.nonzero(as_tuple=True)
            hidden_1NH = hidden_BLH[picked_b, picked_l].unsqueeze(0)
            targets_1N = targets_BL[picked_b, picked_l].unsqueeze(0)
            rows_1N, columns_1N = index_B[picked_b].unsqueeze(0), picked_l.unsqueeze(0)

            def at(start: int, logprobs_BC: Tensor) -> tuple[Tensor, Tensor]:
                end = start + logprobs_BC.shape[1]
                return rows_1N[:, start:end], columns_1N[:, start:end]

        chunk_gradient = None
        if gradient is not None:
            chunk_gradient = lambda start, logprobs: gradient(*at(start, logprobs), logprobs)  # noqa: E731
        # Sharded with an untied head: on each rank's vocabulary slice (parallel/fsdp.py).
        chunk = config.logprob_chunk_tokens
        logprobs_1N = None
        if shards is not None:
            logprobs_1N = shards.head_logprobs(hidden_1NH, targets_1N, chunk)
        if logprobs_1N is None:
            logprobs_1N = target_logprobs(
                output_head(model),
                hidden_1NH,
                targets_1N,
                chunk_tokens=chunk,
                recompute_context=lambda: lora.route(assignments),
                gradient=chunk_gradient,
            )
    if hidden_1NH is hidden_BLH:
        return logprobs_1N
    zeros_BL = torch.zeros(targets_BL.shape, device=device)
    return zeros_BL.index_put((picked_b, picked_l), logprobs_1N[0])
