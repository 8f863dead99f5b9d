"""The Tinker surface's training-run and checkpoint views, and delete / TTL / publish, on real
services (SQLite in tmp_path, the tiny model on the CPU): a training run made through
TinkerRuns, checkpoints written by its own save operations."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.config import BUILTIN_MODEL_ID, EngineConfig, ServerConfig
from posttrain.errors import Conflict, InvalidRequest, NotFound
from posttrain.service import Services, build_services
from posttrain.service.tinker.checkpoints import MAX_TTL_S
from posttrain.service.tinker.records import FutureRecord, NameRecord
from posttrain.statuses import OPERATION_TERMINAL, OperationStatus, SessionStatus
from posttrain.types import LoraConfig

USER = "user_local"
OTHER = "user_other"


@pytest.fixture(name="services")
def services_fixture(tmp_path: Path) -> Iterator[Services]:
    config = ServerConfig(
        data_dir=tmp_path, engine=EngineConfig(device="cpu"), expiry_check_interval_s=0.05
    )
    built = build_services(config)
    yield built
    built.close()


def new_run(services: Services, seq: int = 0, metadata: dict | None = None) -> str:
    client = services.tinker.runs.create_client(USER, [], None)
    lora = LoraConfig(rank=4, alpha=32, seed=seq, train_unembed=False)
    future = services.tinker.runs.create_run(USER, client.id, seq, BUILTIN_MODEL_ID, lora, metadata)
    assert future.error is None and future.result is not None
    return future.result["model_id"]


def wait(services: Services, future: FutureRecord) -> OperationStatus:
    """The save's operation status once it ended (a bound for a hung test, not a timing
    assertion)."""
    for _ in range(6000):
        op = services.repo.get_operation(future.operation_id or "")
        if op is not None and op.status in OPERATION_TERMINAL:
            return op.status
        time.sleep(0.01)
    raise AssertionError(f"{future.id} did not finish")


def save(
    services: Services,
    model_id: str,
    seq: int,
    name: str,
    *,
    sampler: bool = False,
    ttl: int | None = None,
    metadata: dict[str, str] | None = None,
) -> str:
    future = services.tinker.weights.save(
        USER,
        model_id,
        seq,
        name,
        sampler=sampler,
        ttl_seconds=ttl,
        overwrite=False,
        user_metadata=metadata,
    )
    assert wait(services, future) == OperationStatus.COMPLETED
    return f"tinker://{model_id}/{'sampler_weights' if sampler else 'weights'}/{name}"


def operation_of(services: Services, path: str) -> str:
    name = services.tinker.registry.find(NameRecord, path)
    future = services.tinker.registry.find(FutureRecord, name.future_id)
    return future.operation_id


def checkpoint_dir(services: Services, path: str) -> Path:
    record = services.repo.get_checkpoint(services.tinker.weights.resolve(USER, path))
    assert record is not None
    return Path(record.path)


def files_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_runs_checkpoints_are_listed_newest_first_with_their_sizes(services):
    model_id = new_run(services, metadata={"renderer_name": "qwen3", "steps": 3})
    before = time.time()
    trained = save(services, model_id, 1, "step-1", metadata={"note": "first"})
    sampler = save(services, model_id, 2, "final", sampler=True, ttl=3600)
    views = services.tinker.checkpoints.run_checkpoints(USER, model_id)
    assert [v.checkpoint_id for v in views] == ["sampler_weights/final", "weights/step-1"]
    assert [v.checkpoint_type for v in views] == ["sampler", "training"]
    assert [v.tinker_path for v in views] == [sampler, trained]
    for view, path in zip(views, (sampler, trained), strict=True):
        assert view.size_bytes == files_size(checkpoint_dir(services, path)) > 0
        assert view.public is False
    assert views[1].user_metadata == {"note": "first"} and views[0].user_metadata is None
    assert views[1].expires_at is None
    assert views[0].expires_at == pytest.approx(before + 3600, abs=60)

    run = services.tinker.checkpoints.training_run(USER, model_id)
    assert run.run.model_id == model_id and run.run.base_model == BUILTIN_MODEL_ID
    assert run.run.lora_rank == 4 and run.corrupted is False
    assert run.run.user_metadata == {"renderer_name": "qwen3", "steps": 3}
    assert run.last_checkpoint == views[1] and run.last_sampler_checkpoint == views[0]
    last_save = services.repo.get_operation(operation_of(services, sampler))
    assert run.last_request_time == last_save.created_at

    info = services.tinker.checkpoints.weights_info(USER, trained)
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed) == (
        BUILTIN_MODEL_ID,
        True,
        4,
        False,
    )


def test_pages_of_runs_and_checkpoints_count_every_item(services):
    first = new_run(services, 0)
    second = new_run(services, 1)
    save(services, first, 1, "a")
    save(services, second, 1, "b")
    save(services, second, 2, "c", sampler=True)
    ck = services.tinker.checkpoints
    page = ck.training_runs(USER, limit=1, offset=0)
    assert [v.run.model_id for v in page.items] == [second]
    assert (page.offset, page.limit, page.total_count) == (0, 1, 2)
    assert [v.run.model_id for v in ck.training_runs(USER, 5, 1).items] == [first]
    assert ck.training_runs(USER, 5, 2).items == []
    page = ck.user_checkpoints(USER, limit=2, offset=1)
    assert [v.checkpoint_id for v in page.items] == ["weights/b", "weights/a"]
    assert page.total_count == 3
    with pytest.raises(InvalidRequest) as bad:
        ck.user_checkpoints(USER, limit=0, offset=0)
    assert bad.value.param == "limit"
    with pytest.raises(InvalidRequest) as bad:
        ck.training_runs(USER, limit=1, offset=-1)
    assert bad.value.param == "offset"
    with pytest.raises(InvalidRequest) as bad:
        ck.training_runs(USER, 1, 0, access_scope="everything")
    assert bad.value.param == "access_scope"


def test_another_users_runs_and_checkpoints_read_as_absent(services):
    model_id = new_run(services)
    path = save(services, model_id, 1, "mine")
    ck = services.tinker.checkpoints
    with pytest.raises(NotFound) as missing:
        ck.training_run(OTHER, model_id)
    assert missing.value.param == "training_run_id"
    with pytest.raises(NotFound) as missing:
        ck.run_checkpoints(OTHER, model_id)
    assert missing.value.param == "training_run_id"
    for change in (
        lambda: ck.delete(OTHER, model_id, "weights/mine"),
        lambda: ck.set_ttl(OTHER, model_id, "weights/mine", 3600),
        lambda: ck.publish(OTHER, model_id, "weights/mine", True),
    ):
        with pytest.raises(NotFound) as missing:
            change()
        assert missing.value.param == "training_run_id"
    with pytest.raises(NotFound) as missing:
        ck.weights_info(OTHER, path)
    assert missing.value.param == "tinker_path"
    assert ck.training_runs(OTHER, 10, 0).total_count == 0
    assert ck.user_checkpoints(OTHER, 10, 0).total_count == 0
    assert checkpoint_dir(services, path).is_dir()  # untouched
    with pytest.raises(NotFound) as missing:
        ck.delete(USER, model_id, "weights/nothing")
    assert missing.value.param == "checkpoint_id"
    with pytest.raises(InvalidRequest) as bad:
        ck.delete(USER, model_id, "snapshots/mine")
    assert bad.value.param == "checkpoint_id"


def test_deleting_a_name_removes_its_checkpoint_record_files_and_session_ref(services):
    model_id = new_run(services)
    kept = save(services, model_id, 1, "kept")
    gone = save(services, model_id, 2, "gone", sampler=True)
    directory = checkpoint_dir(services, gone)
    checkpoint_id = services.tinker.weights.resolve(USER, gone)
    run = services.tinker.runs.run(USER, model_id)
    refs = services.repo.get_session(run.session_id).inference_checkpoints
    assert checkpoint_id in [c.id for c in refs]

    services.tinker.checkpoints.delete(USER, model_id, "sampler_weights/gone")
    assert not directory.exists()
    assert services.repo.get_checkpoint(checkpoint_id) is None
    refs = services.repo.get_session(run.session_id).inference_checkpoints
    assert checkpoint_id not in [c.id for c in refs]
    views = services.tinker.checkpoints.run_checkpoints(USER, model_id)
    assert [v.tinker_path for v in views] == [kept]
    with pytest.raises(NotFound) as missing:
        services.tinker.weights.resolve(USER, gone)
    assert missing.value.param == "path"
    with pytest.raises(NotFound) as missing:  # a retried delete
        services.tinker.checkpoints.delete(USER, model_id, "sampler_weights/gone")
    assert missing.value.param == "checkpoint_id"
    assert checkpoint_dir(services, kept).is_dir()


def test_a_checkpoint_being_written_or_loaded_is_not_deleted(services):
    model_id = new_run(services)
    run = services.tinker.runs.run(USER, model_id)
    loaded = save(services, model_id, 1, "loaded")
    checkpoint_id = services.tinker.weights.resolve(USER, loaded)
    # A session still being set up from it reads its files.
    session = services.repo.get_session(run.session_id)
    services.repo.put_session(
        dataclasses.replace(
            session,
            id="ts-loading",
            status=SessionStatus.CREATING,
            resume_from_checkpoint_id=checkpoint_id,
        )
    )
    with pytest.raises(Conflict) as busy:
        services.tinker.checkpoints.delete(USER, model_id, "weights/loaded")
    assert busy.value.param == "checkpoint_id"
    assert checkpoint_dir(services, loaded).is_dir()
    services.repo.update_session(
        "ts-loading", lambda s: dataclasses.replace(s, status=SessionStatus.RUNNING)
    )
    services.tinker.checkpoints.delete(USER, model_id, "weights/loaded")
    assert services.repo.get_checkpoint(checkpoint_id) is None

    # A save queued behind other work is not written yet: not listed, not deletable.
    release = threading.Event()
    services.scheduler.run_job(run.resource_id, lambda: release.wait(60))
    future = services.tinker.weights.save(
        USER,
        model_id,
        2,
        "pending",
        sampler=False,
        ttl_seconds=None,
        overwrite=False,
        user_metadata=None,
    )
    try:
        assert services.tinker.checkpoints.run_checkpoints(USER, model_id) == []
        with pytest.raises(Conflict) as busy:
            services.tinker.checkpoints.delete(USER, model_id, "weights/pending")
        assert busy.value.param == "checkpoint_id"
    finally:
        release.set()
    assert wait(services, future) == OperationStatus.COMPLETED
    views = services.tinker.checkpoints.run_checkpoints(USER, model_id)
    assert [v.checkpoint_id for v in views] == ["weights/pending"]


def test_a_ttl_sets_expiry_and_the_expiry_thread_deletes_what_passed_it(services):
    model_id = new_run(services)
    path = save(services, model_id, 1, "short")
    lasting = save(services, model_id, 2, "lasting", ttl=3600)
    ck = services.tinker.checkpoints
    now = time.time()
    name = ck.set_ttl(USER, model_id, "weights/short", 7200)
    assert name.expires_at == pytest.approx(now + 7200, abs=60)
    [view] = [v for v in ck.run_checkpoints(USER, model_id) if v.tinker_path == path]
    assert view.expires_at == name.expires_at
    assert ck.set_ttl(USER, model_id, "weights/short", None).expires_at is None
    for bad_ttl in (0, -5, MAX_TTL_S + 1):
        with pytest.raises(InvalidRequest) as bad:
            ck.set_ttl(USER, model_id, "weights/short", bad_ttl)
        assert bad.value.param == "ttl_seconds"
    assert ck.sweep(time.time()) == []  # nothing is due

    directory = checkpoint_dir(services, path)
    ck.set_ttl(USER, model_id, "weights/short", 1)
    # Past its TTL, a name stops resolving at once; the expiry thread deletes it after.
    services.tinker.registry.put(
        dataclasses.replace(
            services.tinker.registry.find(NameRecord, path), expires_at=time.time() - 1
        )
    )
    with pytest.raises(NotFound):
        services.tinker.weights.resolve(USER, path)
    with pytest.raises(NotFound):
        ck.set_ttl(USER, model_id, "weights/short", 3600)
    for _ in range(6000):  # the reaper's thread runs every 0.05 s here
        if services.tinker.registry.find(NameRecord, path) is None:
            break
        time.sleep(0.01)
    assert services.tinker.registry.find(NameRecord, path) is None
    assert not directory.exists()
    assert [v.tinker_path for v in ck.run_checkpoints(USER, model_id)] == [lasting]


def test_a_published_checkpoint_is_readable_by_another_user_until_unpublished(services):
    model_id = new_run(services, metadata={"renderer_name": "qwen3"})
    shared = save(services, model_id, 1, "shared", sampler=True)
    save(services, model_id, 2, "private")
    ck = services.tinker.checkpoints
    with pytest.raises(NotFound):
        ck.training_run(OTHER, model_id, access_scope="accessible")
    assert ck.publish(USER, model_id, "sampler_weights/shared", True).public is True
    assert ck.publish(USER, model_id, "sampler_weights/shared", True).public is True  # again
    info = ck.weights_info(OTHER, shared)
    assert (info.base_model, info.lora_rank) == (BUILTIN_MODEL_ID, 4)
    seen = ck.training_run(OTHER, model_id, access_scope="accessible")
    assert seen.run.user_metadata == {"renderer_name": "qwen3"}
    assert seen.last_checkpoint is None  # the private one stays hidden
    assert seen.last_sampler_checkpoint.tinker_path == shared
    assert seen.last_sampler_checkpoint.public is True
    assert [v.run.model_id for v in ck.training_runs(OTHER, 10, 0, "accessible").items] == [
        model_id
    ]
    with pytest.raises(NotFound):
        ck.training_run(OTHER, model_id)  # owned scope
    ck.publish(USER, model_id, "sampler_weights/shared", False)
    with pytest.raises(NotFound):
        ck.weights_info(OTHER, shared)
    assert ck.training_runs(OTHER, 10, 0, "accessible").total_count == 0
