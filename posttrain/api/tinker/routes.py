"""The Tinker wire routes (`/api/v1/...`): the tinker 0.38 SDK's handshake, training runs,
samplers and futures, each a thin adapter over the services (service/tinker/).

Every request that runs work answers a future (`{"request_id"}`); the SDK then POSTs
retrieve_future, which is held until the operation finishes (up to HOLD_S, under the SDK's
45 s read timeout) and answers `try_again` only after the hold, so the SDK, which re-polls at
once, sends one retrieve per result in the common case. Parsing, store reads and rendering run
on worker threads, never on the event loop.

Imports: api, service, types.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from posttrain.api.deps import RawBodyDep, ServicesDep, loads_strict, parse
from posttrain.api.tinker import wire as w
from posttrain.api.tinker.codec import decode_forward_backward
from posttrain.api.tinker.handshake import DYNAMIC_CONFIG, client_config, tinker_user
from posttrain.api.tinker.results import PROTO, failure, rendered
from posttrain.api.tinker.sampling import sample_request
from posttrain.api.tinker.training import (
    forward_backward_request,
    in_tinker_terms,
    optim_step_request,
)
from posttrain.errors import InvalidRequest, posttrainError
from posttrain.service.tinker.records import ClientRecord, FutureRecord, RunRecord, SamplerRecord
from posttrain.service.tinker.runs import LORA_ALPHA
from posttrain.statuses import OPERATION_TERMINAL, OperationStatus
from posttrain.types import LoraConfig, OperationKind

# The Tinker protocol is the SDK's (protobuf bodies, futures): /openapi.json documents the
# Together surface, which schemathesis fuzzes; the tinker SDK is this surface's contract.
router = APIRouter(prefix="/api/v1", include_in_schema=False)
HOLD_S = 30.0  # under the SDK's 45 s retrieve_future timeout

TinkerUser = Depends(tinker_user)


def _json(body: dict[str, Any]) -> Response:
    return Response(content=json.dumps(body), media_type="application/json")


def _future(future: FutureRecord, **extra: Any) -> dict[str, Any]:
    return {"request_id": future.id, **extra}


# ------------------------------------------------------------------ handshake


@router.post("/client/config")
async def client_flags(svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    return client_config(svc.config)


@router.post("/client/dynamic_config")
async def client_dynamic_config(user: str = TinkerUser) -> dict[str, Any]:
    return DYNAMIC_CONFIG


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry(user: str = TinkerUser) -> dict[str, str]:
    return {"status": "accepted"}  # the SDK's telemetry is acknowledged and dropped


@router.get("/get_server_capabilities")
async def capabilities(svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    models = [
        {
            "model_name": name,
            # Tinker's one length for a model: what it both trains on and samples.
            "max_context_length": min(info.context_length, info.max_seq_length),
            "trainable": True,
            "sampleable": True,
        }
        for name, info in svc.resources.supported_models()
    ]
    return {"supported_models": models}


@router.post("/create_session")
def create_session(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.CreateSession, loads_strict(body))
    client = svc.tinker.runs.create_client(user, request.tags, request.user_metadata)
    return {"type": "create_session", "session_id": client.id}


@router.post("/session_heartbeat")
def session_heartbeat(
    body: RawBodyDep, svc: ServicesDep, response: Response, user: str = TinkerUser
) -> dict[str, Any]:
    request = parse(w.SessionRef, loads_strict(body))
    if not svc.tinker.runs.heartbeat(user, request.session_id):
        response.status_code = 410
        return {"error": f"session {request.session_id} has finished"}
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    svc.tinker.runs.finish(user, session_id)
    return {}


@router.get("/sessions")
def list_sessions(
    svc: ServicesDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    user: str = TinkerUser,
) -> dict[str, Any]:
    clients = sorted(svc.tinker.registry.all(ClientRecord, user), key=lambda c: -c.created_at)
    return {"sessions": [c.id for c in clients[offset : offset + limit]]}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    client = svc.tinker.registry.get(ClientRecord, session_id, user)
    runs = [
        r.model_id for r in svc.tinker.registry.all(RunRecord, user) if r.client_id == client.id
    ]
    samplers = [
        s.id for s in svc.tinker.registry.all(SamplerRecord, user) if s.client_id == client.id
    ]
    metadata = client.user_metadata
    return {
        "training_run_ids": runs,
        "sampler_ids": samplers,
        "user_metadata": {k: str(v) for k, v in metadata.items()} if metadata else None,
    }


# ------------------------------------------------------------------ training runs


def _lora(request: w.CreateModel) -> LoraConfig:
    lora = request.lora_config or w.LoraIn(rank=32)
    if not (lora.train_mlp and lora.train_attn):
        raise InvalidRequest(
            "posttrain adapts every attention and MLP projection; train_mlp and train_attn"
            " must be true",
            param="lora_config.train_mlp" if not lora.train_mlp else "lora_config.train_attn",
        )
    seed = lora.seed if lora.seed is not None else int(time.time_ns() % 2**31)
    return LoraConfig(rank=lora.rank, alpha=LORA_ALPHA, seed=seed, train_unembed=lora.train_unembed)


def _check_optimizer(config: w.OptimizerConfigIn | None, param: str) -> None:
    if config is not None and config.type != "adamw":
        raise InvalidRequest(
            f"optimizer {config.type!r} is not served; posttrain's Tinker surface runs adamw",
            param=f"{param}.type",
        )


@router.post("/create_model")
def create_model(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.CreateModel, loads_strict(body))
    _check_optimizer(request.optimizer_config, "optimizer_config")
    svc.resources.check_base_model(request.base_model)
    future = svc.tinker.runs.create_run(
        user,
        request.session_id,
        request.model_seq_id,
        request.base_model,
        _lora(request),
        request.user_metadata,
    )
    return _future(future, model_id=(future.result or {}).get("model_id"))


@router.post("/get_info")
def get_info(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.ModelRef, loads_strict(body))
    run = svc.tinker.runs.run(user, request.model_id)
    return {
        "type": "get_info",
        "model_id": run.model_id,
        "model_data": {
            "arch": None,
            "model_name": run.base_model,
            "tokenizer_id": str(svc.resources.model_info(run.base_model).tokenizer_dir),
        },
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "model_name": run.base_model,
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/forward_backward")
async def forward_backward(
    request: Request,
    svc: ServicesDep,
    user: str = TinkerUser,
    content_encoding: str | None = Header(None),
) -> dict[str, Any]:
    raw = await request.body()

    def submit() -> dict[str, Any]:
        decoded = decode_forward_backward(raw, content_encoding)
        domain, shapes = forward_backward_request(decoded)
        with in_tinker_terms():
            future = svc.tinker.runs.submit(
                user,
                decoded.model_id,
                decoded.seq_id,
                "forward_backward",
                OperationKind.FORWARD_BACKWARD,
                domain,
                extra={"shapes": [list(s) for s in shapes]},
            )
        return _future(future, model_id=decoded.model_id)

    return await run_in_threadpool(submit)


@router.post("/optim_step")
def optim_step(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.OptimStep, loads_strict(body))
    domain = optim_step_request(request)
    future = svc.tinker.runs.submit(
        user, request.model_id, request.seq_id, "optim_step", OperationKind.OPTIM_STEP, domain
    )
    return _future(future, model_id=request.model_id)


@router.post("/save_weights")
def save_weights(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.SaveWeights, loads_strict(body))
    name = request.path or f"step-{request.seq_id}"
    future = svc.tinker.weights.save(
        user,
        request.model_id,
        request.seq_id,
        name,
        sampler=False,
        ttl_seconds=request.ttl_seconds,
        overwrite=request.overwrite,
        user_metadata=request.user_metadata,
    )
    return _future(future, model_id=request.model_id)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser
) -> dict[str, Any]:
    request = parse(w.SaveWeightsForSampler, loads_strict(body))
    if request.path is not None:
        future = svc.tinker.weights.save(
            user,
            request.model_id,
            request.seq_id,
            request.path,
            sampler=True,
            ttl_seconds=request.ttl_seconds,
            overwrite=False,
            user_metadata=request.user_metadata,
        )
    elif request.sampling_session_seq_id is not None:
        future = svc.tinker.weights.save_for_sampler(
            user, request.model_id, request.seq_id, request.sampling_session_seq_id, request.kind
        )
    else:
        raise InvalidRequest("send path or sampling_session_seq_id", param="path")
    return _future(future, model_id=request.model_id)


@router.post("/load_weights")
def load_weights(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    """A run resumed from a saved state: a new run (create-via-load, session_id and
    model_seq_id; the SDK 0.38 derives its id itself) or an existing run that goes on from it
    (load_state, model_id and seq_id)."""
    request = parse(w.LoadWeights, loads_strict(body))
    is_new = request.session_id is not None and request.model_seq_id is not None
    if not is_new and request.model_id is None:
        raise InvalidRequest("send session_id and model_seq_id, or model_id", param="model_id")
    _check_optimizer(request.optimizer_config, "optimizer_config")
    checkpoint_id, owner = svc.tinker.weights.resolve_with_owner(user, request.path)
    checkpoint = svc.checkpoints.get(owner, checkpoint_id)
    if request.base_model is not None and request.base_model != checkpoint.base_model:
        raise InvalidRequest(
            f"path {request.path} was trained from {checkpoint.base_model}", param="base_model"
        )
    if request.optimizer and checkpoint.type.value.endswith("INFERENCE"):
        raise InvalidRequest(
            f"{request.path} holds sampler weights only; load it without the optimizer",
            param="optimizer",
        )
    assert checkpoint.lora_config is not None
    if not is_new:
        assert request.model_id is not None
        future = svc.tinker.runs.load_into_run(
            user,
            request.model_id,
            request.seq_id,
            checkpoint,
            load_optimizer=request.optimizer,
            shared=owner != user,
        )
        return _future(future, model_id=request.model_id)
    assert request.session_id is not None and request.model_seq_id is not None
    future = svc.tinker.runs.create_run(
        user,
        request.session_id,
        request.model_seq_id,
        checkpoint.base_model,
        checkpoint.lora_config,
        request.user_metadata,
        resume_from=checkpoint_id,
        load_optimizer=request.optimizer,
        shared=owner != user,
    )
    if future.result is not None:
        future = svc.tinker.registry.find(FutureRecord, future.id) or future
    return _future(future, model_id=(future.result or {}).get("model_id"))


# ------------------------------------------------------------------ samplers


@router.post("/create_sampling_session")
def create_sampling_session(
    body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser
) -> dict[str, Any]:
    request = parse(w.CreateSamplingSession, loads_strict(body))
    sampler = svc.tinker.weights.create_sampler(
        user,
        request.session_id,
        request.sampling_session_seq_id,
        base_model=request.base_model,
        model_path=request.model_path,
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    sampler = svc.tinker.registry.get(SamplerRecord, sampler_id, user)
    return {
        "sampler_id": sampler.id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


@router.post("/asample")
def asample(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> dict[str, Any]:
    request = parse(w.Sample, loads_strict(body))
    if request.sampling_session_id is None:
        raise InvalidRequest(
            "sampling_session_id is required (create a sampling client first)",
            param="sampling_session_id",
        )
    sampler = svc.tinker.registry.get(SamplerRecord, request.sampling_session_id, user)
    domain = sample_request(request)
    future = svc.tinker.weights.sample(user, sampler.id, request.seq_id, domain)
    ids = [f"{future.id}:{i}" for i in range(request.num_samples)]
    return _future(future, sample_sequence_ids=ids)


# ------------------------------------------------------------------ futures


@router.post("/retrieve_future")
async def retrieve_future(body: RawBodyDep, svc: ServicesDep, user: str = TinkerUser) -> Response:
    request = await run_in_threadpool(lambda: parse(w.RetrieveFuture, loads_strict(body)))
    future = await run_in_threadpool(svc.tinker.future, user, request.request_id)
    if future.operation_id is None:
        if future.error is not None:
            return _json({"error": future.error, "category": future.category})
        return _json({"type": future.type, **(future.result or {})})
    assert future.session_id is not None and future.operation_kind is not None
    answer = await svc.polls.settled(
        user,
        future.session_id,
        OperationKind(future.operation_kind),
        future.operation_id,
        hold_s=HOLD_S,
    )
    op = answer.op
    if op.status not in OPERATION_TERMINAL:
        return _json({"type": "try_again", "request_id": future.id, "queue_state": "active"})
    if op.status != OperationStatus.COMPLETED:
        return _json(failure(op))

    def finish() -> Response:
        try:
            svc.tinker.weights.finished(future, op)
        except posttrainError as exc:
            return _json({"error": exc.message, "category": "server"})
        content, media = rendered(future, op)
        if media == PROTO:
            assert isinstance(content, bytes)
            return Response(content=content, media_type=PROTO)
        assert isinstance(content, dict)
        return _json(content)

    return await run_in_threadpool(finish)
