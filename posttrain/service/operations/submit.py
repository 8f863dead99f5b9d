"""Submitting operations (idempotent on their Idempotency-Key) and reading their state.

A key is scoped to (session, kind, key). The first submission registers the operation
atomically in the store, with its typed request, before any work is queued; a replay with the
same request fingerprint gets the original operation back and never runs it twice; a different
fingerprint is a Conflict. An operation without a key (the seed-era sample route) is never
deduplicated. Operations on a session that is not RUNNING are recorded FAILED at once.

The caller checks the session's owner once (SessionService.get) and hands over the record;
whether a route requires the key is the api layer's rule (api.md 1.4.1, 5.6).

Imports: store, engine.interface.
"""

from __future__ import annotations

import dataclasses
import time

from posttrain.config import LimitsConfig
from posttrain.engine.images import checked_images, checked_prompt_images
from posttrain.engine.optim.step_settings import resolve_step_settings
from posttrain.engine.train.expert_routes import check_routes
from posttrain.errors import Conflict, EngineFailure, InvalidRequest, NotFound, posttrainError
from posttrain.records import OperationRecord, SessionRecord
from posttrain.service.ids import new_id
from posttrain.service.lifecycle.resources import ResourceService
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.scheduling.scheduler import Scheduler
from posttrain.statuses import OperationErrorCode, OperationStatus, SessionStatus
from posttrain.store.repo import Repo
from posttrain.types import (
    MAX_TOPK_PROMPT_LOGPROBS,
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    OperationKind,
    OperationRequest,
    OptimStepRequest,
    SampleRequest,
    TrainingSample,
)

RESTART_MESSAGE = "the server restarted while this operation was pending or running"


def resolved_max_tokens(
    request: SampleRequest, context_length: int, limits: LimitsConfig
) -> SampleRequest:
    """max_tokens None means as many tokens as the request's limits allow: what the context
    length leaves after the longest prompt (prompt + max_tokens <= context_length, the rule
    _checked_sample applies to a given max_tokens), and no more than keeps num_samples x
    (prompt + max_tokens) within the operation token limit. At least 1, so a prompt that
    leaves no room is refused by those same checks, naming sampling_params.max_tokens."""
    params = request.sampling_params
    if params.max_tokens is not None:
        return request
    context_room = context_length - max(len(prompt) for prompt in request.prompts)
    per_sample = limits.max_operation_tokens // request.num_samples  # prompts + completions
    token_room = (per_sample - sum(map(len, request.prompts))) // len(request.prompts)
    max_tokens = max(1, min(context_room, token_room))
    return dataclasses.replace(
        request, sampling_params=dataclasses.replace(params, max_tokens=max_tokens)
    )


class OperationService:
    def __init__(
        self,
        repo: Repo,
        scheduler: Scheduler,
        sessions: SessionService,
        resources: ResourceService,
        limits: LimitsConfig | None = None,
    ) -> None:
        self.limits = limits or LimitsConfig()
        self.repo = repo
        self.scheduler = scheduler
        self.sessions = sessions
        self.resources = resources

    def submit(
        self,
        user: str,
        session: SessionRecord,
        kind: OperationKind,
        *,
        idempotency_key: str | None,
        fingerprint: str,
        request: OperationRequest,
    ) -> OperationRecord:
        """Register and queue an operation on `session` (`user`'s: SessionService.get);
        without an Idempotency-Key it is not deduplicated. The request is kept until the
        operation finishes, so that it runs again after a restart (resume_after_restart)."""
        session_id = session.id
        kept = request  # as sent: a restart prepares it again, as here
        request = self._prepared(user, session, request)
        now = time.time()
        active = session.status == SessionStatus.RUNNING
        op = OperationRecord(
            id=new_id("op"),
            session_id=session_id,
            kind=kind,
            status=OperationStatus.PENDING if active else OperationStatus.FAILED,
            created_at=now,
            updated_at=now,
            idempotency_key=idempotency_key,
            fingerprint=fingerprint,
            created_by=user,
            error_code=None if active else OperationErrorCode.SESSION_NOT_ACTIVE,
            error_message=None if active else f"session {session_id} is {session.status}",
        )
        stored = self.repo.insert_operation(op, kept if active else None)
        if stored.id != op.id:  # a concurrent submission with the same key won the insert
            assert idempotency_key is not None, "only a keyed operation finds another"
            return self.replay(session_id, kind, idempotency_key, fingerprint) or stored
        if active:
            self.resources.touch(session.resource_id)
            self.scheduler.enqueue(session.resource_id, op.id, request)
            # A deferred weights-sync may have completed inside enqueue
            # (service/scheduling/publishing.py).
            return self.repo.get_operation(op.id) or op
        return op

    def resume_after_restart(self) -> None:
        """Operations that had not finished when the process died run again, in submission
        order, on the sessions that came back (service/durability/durable_sessions.py), their kept
        requests checked as at submit. The others fail, saying why."""
        for op, kept in self.repo.unfinished_with_requests():
            session = self.repo.get_session(op.session_id)
            outcome: Exception | None = None
            if kept is None or session is None:
                outcome = EngineFailure(RESTART_MESSAGE)
            elif session.status != SessionStatus.RUNNING:
                message = f"{RESTART_MESSAGE}; session {session.id} is {session.status}"
                outcome = EngineFailure(message)
            else:
                try:
                    request = self._prepared(session.created_by, session, kept)
                except posttrainError as exc:
                    outcome = exc
            if outcome is not None:
                self.scheduler.recorder.finish([(op, outcome)])
                continue
            assert session is not None, "a missing session sets the outcome above"
            self.repo.put_operation(dataclasses.replace(op, status=OperationStatus.PENDING))
            self.scheduler.enqueue(session.resource_id, op.id, request)

    def wire_bodies(self) -> list[tuple[OperationRecord, bytes]]:
        """Unfinished or journaled operations an older server kept as the HTTP body they
        arrived with: only the api layer can parse those (keep_request)."""
        return self.repo.wire_bodies()

    def keep_request(self, operation_id: str, request: OperationRequest) -> None:
        """Keep an operation's typed request in place of its wire body, before the recovery."""
        self.repo.put_request(operation_id, request)

    def _prepared(
        self, user: str, session: SessionRecord, request: OperationRequest
    ) -> OperationRequest:
        """The checks that need the session and the model, and routed-experts keys resolved."""
        session_id = session.id
        if isinstance(request, SampleRequest):
            resource = self.resources.get(user, session.resource_id)
            if resource.num_generator_replicas == 0:
                raise InvalidRequest(
                    "this model resource has no generator (num_generator_replicas = 0)",
                    param="compute_config.num_generator_replicas",
                )
            request = self._checked_sample(session.base_model, request)
            if any(request.prompt_images):
                model_dir = self.resources.model_info(session.base_model).tokenizer_dir
                assert model_dir is not None, "the service fills in a served model's directory"
                request = checked_prompt_images(
                    model_dir, request, max_image_pixels=self.limits.max_image_pixels
                )
        if isinstance(request, ForwardBackwardRequest | CustomForwardBackwardRequest):
            # Keys become the routes they name now: a key that expires while the operation
            # is queued cannot fail it later.
            samples = self.scheduler.routed_experts.resolved(session_id, request.samples)
            if any(sample.images for sample in samples):
                model_dir = self.resources.model_info(session.base_model).tokenizer_dir
                assert model_dir is not None, "the service fills in a served model's directory"
                samples = checked_images(
                    model_dir, samples, max_image_pixels=self.limits.max_image_pixels
                )
            request = dataclasses.replace(request, samples=samples)
            self._check_samples(session.base_model, request.samples)
        if isinstance(request, OptimStepRequest):
            # muon_params on an Adam resource (or adam_params on a Muon one) is a 400 here,
            # before anything is recorded (api.md 1.4.4).
            resource = self.resources.get(user, session.resource_id)
            resolve_step_settings(request, resource.muon_scaling)
        return request

    def replay(
        self, session_id: str, kind: OperationKind, idempotency_key: str, fingerprint: str
    ) -> OperationRecord | None:
        """The operation already registered under this key, if any, before any work on the
        request; a different request under the same key is a Conflict (api.md 7.1)."""
        stored = self.repo.find_operation(session_id, kind, idempotency_key)
        if stored is not None and stored.fingerprint != fingerprint:
            raise Conflict(
                f"Idempotency-Key {idempotency_key!r} was used for a different"
                f" {kind} request (operation {stored.id}); use a new key for a new request",
                param="Idempotency-Key",
            )
        return stored

    def _check_samples(self, base_model: str, samples: tuple[TrainingSample, ...]) -> None:
        """Limits that need the model: batch size, sequence length, vocabulary."""
        engine = self.resources.engine
        info = engine.model_info(base_model)
        tokens = sum(len(sample.tokens) for sample in samples)
        if tokens > self.limits.max_operation_tokens:
            raise InvalidRequest(
                f"samples hold {tokens} tokens; one operation may hold at most"
                f" {self.limits.max_operation_tokens}",
                param="samples",
            )
        if len(samples) > info.max_batch_size:
            raise InvalidRequest(
                f"samples has {len(samples)} entries; the maximum is {info.max_batch_size}",
                param="samples",
            )
        for index, sample in enumerate(samples):
            if len(sample.tokens) + 1 > info.max_seq_length:
                raise InvalidRequest(
                    f"samples[{index}] has {len(sample.tokens) + 1} tokens; the maximum is"
                    f" {info.max_seq_length}",
                    param=f"samples[{index}].model_input",
                )
            engine.check_tokens(base_model, sample.tokens, f"samples[{index}].model_input")
            targets = tuple(map(int, sample.loss_fn_inputs["target_tokens"]))
            engine.check_tokens(
                base_model, targets, f"samples[{index}].loss_fn_inputs.target_tokens"
            )
            if sample.routed_experts is not None:
                # A key's routes, or the seed-era buffer (api.md 5.2).
                field = (
                    "routed_experts_key"
                    if sample.routed_experts_key
                    else "loss_inputs.routed_experts"
                )
                check_routes(
                    sample.routed_experts, info.moe, len(sample.tokens), f"samples[{index}].{field}"
                )

    def _checked_sample(self, base_model: str, request: SampleRequest) -> SampleRequest:
        """The request with max_tokens None resolved (resolved_max_tokens), checked against
        the limits and the model."""
        engine = self.resources.engine
        info = engine.model_info(base_model)
        if request.topk_prompt_logprobs > MAX_TOPK_PROMPT_LOGPROBS:
            raise InvalidRequest(
                f"topk_prompt_logprobs is {request.topk_prompt_logprobs}; the maximum is"
                f" {MAX_TOPK_PROMPT_LOGPROBS}",
                param="topk_prompt_logprobs",
            )
        for name, why in info.refused_sample_fields:
            if getattr(request, name):
                raise InvalidRequest(f"{name} is not available on this server: {why}", param=name)
        request = resolved_max_tokens(request, info.context_length, self.limits)
        max_tokens = request.sampling_params.max_tokens
        assert max_tokens is not None, "resolved_max_tokens gives every request a number"
        engine.check_tokens(
            base_model, request.sampling_params.stop_token_ids, "sampling_params.stop"
        )
        sequences = len(request.prompts) * request.num_samples
        if sequences > self.limits.max_sequences:
            raise InvalidRequest(
                f"{len(request.prompts)} prompts x num_samples {request.num_samples} is"
                f" {sequences} sequences; one operation may generate at most"
                f" {self.limits.max_sequences}",
                param="num_samples",
            )
        tokens = request.num_samples * sum(len(prompt) + max_tokens for prompt in request.prompts)
        if tokens > self.limits.max_operation_tokens:
            raise InvalidRequest(
                f"num_samples x (prompt + max_tokens) is {tokens} tokens; one operation may"
                f" hold at most {self.limits.max_operation_tokens}",
                param="sampling_params.max_tokens",
            )
        for index, prompt in enumerate(request.prompts):
            engine.check_tokens(base_model, prompt, f"model_inputs[{index}]")
            total = len(prompt) + max_tokens
            if total > info.context_length:
                raise InvalidRequest(
                    f"model_inputs[{index}] has {len(prompt)} tokens; with max_tokens"
                    f" {max_tokens} that exceeds the context length"
                    f" {info.context_length}",
                    param="sampling_params.max_tokens",
                )
        return request

    def get(self, user: str, session_id: str, kind: OperationKind, op_id: str) -> OperationRecord:
        self.sessions.get(user, session_id)
        op = self.repo.get_operation(op_id)
        if op is None or op.session_id != session_id or op.kind != kind:
            raise NotFound(f"{kind} operation {op_id} not found", param="operation_id")
        return op
