"""Checkpoint service: a save killed midway leaves no record and its files are removed at
startup; a finished save is recorded and listed; resume plans check compatibility. The engine
is a small fake here: it is the collaborator that writes files, not the thing under test."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.errors import InvalidRequest, NotFound
from posttrain.records import CheckpointRecord, ResourceRecord, SessionRecord
from posttrain.service.durability.checkpoints import (
    PARTIAL_PREFIX,
    CheckpointService,
    ResumePlan,
    plan_resume,
)
from posttrain.service.signing import UrlSigner
from posttrain.statuses import ResourceStatus, SessionStatus
from posttrain.store.db import connect
from posttrain.store.repo import Repo
from posttrain.types import CheckpointType, LoraConfig, MuonScaling

SESSION = SessionRecord(
    id="ts-1",
    resource_id="mr-1",
    base_model="posttrain/tiny-qwen3",
    created_by="user_local",
    created_at=1.0,
    updated_at=1.0,
    status=SessionStatus.RUNNING,
    step=3,
    lora_config=LoraConfig(rank=4),
)


class FileWritingEngine:
    """Writes one file per save; `fail` makes the save raise after writing it."""

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        (directory / "trainable.safetensors").write_bytes(b"x" * 1000)
        if self.fail:
            raise OSError("disk full")


def service(data_dir: Path, engine: object) -> CheckpointService:
    repo = Repo(connect(data_dir))
    return CheckpointService(data_dir, repo, engine, UrlSigner("k", 60))  # type: ignore[arg-type]


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_checkpoint_service import SESSION, service
    from posttrain.types import CheckpointType

    class KilledMidSave:
        def save_training_state(self, resource_id, session_id, directory):
            (directory / "trainable.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)

    svc = service(Path({data_dir!r}), KilledMidSave())
    svc.repo.put_session(SESSION)
    svc.save(SESSION, CheckpointType.TRAINING)
    """
)


def test_a_save_killed_midway_is_never_listed_and_is_removed_at_startup(tmp_path):
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), data_dir=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    leftovers = list((tmp_path / "checkpoints").iterdir())
    assert [p.name.startswith(PARTIAL_PREFIX) for p in leftovers] == [True]
    restarted = service(tmp_path, FileWritingEngine())
    assert (
        restarted.list("user_local", base_model=None, session_id=None, checkpoint_type=None) == []
    )
    assert restarted.remove_partial() == 1
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert restarted.repo.get_session(SESSION.id).training_checkpoints == ()


def test_a_finished_save_is_recorded_on_the_session_and_listed(tmp_path):
    svc = service(tmp_path, FileWritingEngine())
    svc.repo.put_session(SESSION)
    output = svc.save(SESSION, CheckpointType.TRAINING)
    checkpoint_id = output.checkpoint.id
    assert output.checkpoint.step == 3
    record = svc.get("user_local", checkpoint_id)
    assert record.lora_rank == 4 and record.lora_config == LoraConfig(rank=4)
    assert (Path(record.path) / "trainable.safetensors").stat().st_size == 1000
    listed = svc.list("user_local", base_model=None, session_id="ts-1", checkpoint_type=None)
    assert [c.id for c in listed] == [checkpoint_id]
    refs = svc.repo.get_session(SESSION.id).training_checkpoints
    assert [(r.id, r.step) for r in refs] == [(checkpoint_id, 3)]
    # Startup cleanup keeps recorded checkpoints and drops directories no record points at
    # (a kill between the rename and the store write) and half-built merged exports.
    orphan = tmp_path / "checkpoints" / "ckpt-orphan"
    orphan.mkdir()
    half_merged = Path(record.path) / f"{PARTIAL_PREFIX}merged-1"
    half_merged.mkdir()
    assert svc.remove_partial() == 2
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [checkpoint_id]
    assert not half_merged.exists()


def test_a_failed_save_leaves_no_files_and_no_record(tmp_path):
    svc = service(tmp_path, FileWritingEngine(fail=True))
    svc.repo.put_session(SESSION)
    with pytest.raises(OSError, match="disk full"):
        svc.save(SESSION, CheckpointType.TRAINING)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert svc.list("user_local", base_model=None, session_id=None, checkpoint_type=None) == []


def test_listing_rejects_an_unknown_type_naming_the_field(tmp_path):
    svc = service(tmp_path, FileWritingEngine())
    with pytest.raises(ValueError) as info:
        svc.list("user_local", base_model=None, session_id=None, checkpoint_type="TRAINING")
    assert info.value.param == "type"


# ---------------------------------------------------------------- resume plans

RESOURCE = ResourceRecord(
    id="mr-1",
    base_model="posttrain/tiny-qwen3",
    created_by="user_local",
    created_at=1.0,
    updated_at=1.0,
    status=ResourceStatus.READY,
)


def saved_checkpoint(tmp_path: Path, kind: CheckpointType = CheckpointType.TRAINING) -> Repo:
    repo = Repo(connect(tmp_path))
    repo.put_resource(RESOURCE)
    repo.put_session(SESSION)
    repo.put_checkpoint(
        CheckpointRecord(
            id="ckpt-1",
            session_id=SESSION.id,
            base_model=RESOURCE.base_model,
            created_by="user_local",
            created_at=2.0,
            type=kind,
            step=3,
            path=str(tmp_path / "ckpt-1"),
            lora_rank=4,
            lora_config=LoraConfig(rank=4, alpha=16, dropout=0.0, seed=7),
        )
    )
    return repo


def plan(repo: Repo, **changes: object) -> ResumePlan:
    args: dict = {
        "resource": RESOURCE,
        "load_optimizer": None,
        "lora": None,
        "lora_given": frozenset(),
    }
    args.update(changes)
    return plan_resume(repo, "user_local", "ckpt-1", **args)


def test_a_resume_takes_the_lora_config_and_step_from_a_training_checkpoint(tmp_path):
    repo = saved_checkpoint(tmp_path)
    resumed = plan(repo, lora=LoraConfig(rank=4, seed=1, dropout=0.1), lora_given={"rank"})
    assert resumed.load_optimizer and resumed.step == 3
    assert resumed.lora == LoraConfig(rank=4, alpha=16, dropout=0.0, seed=7)
    overridden = plan(repo, lora=LoraConfig(rank=4, dropout=0.1), lora_given={"dropout"})
    assert overridden.lora.dropout == 0.1
    weights_only = plan(repo, load_optimizer=False)
    assert (weights_only.load_optimizer, weights_only.step) == (False, 0)


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"resource": replace(RESOURCE, base_model="other/model")}, "resume_from_checkpoint_id"),
        ({"resource": replace(RESOURCE, lora_enabled=False)}, "resume_from_checkpoint_id"),
        ({"lora": LoraConfig(rank=8), "lora_given": {"rank"}}, "lora_config.rank"),
        ({"lora": LoraConfig(rank=4, alpha=4), "lora_given": {"alpha"}}, "lora_config.alpha"),
        (
            {"resource": replace(RESOURCE, muon_scaling=MuonScaling.MATCH_ADAM)},
            "load_optimizer",
        ),
    ],
)
def test_an_incompatible_resume_is_a_400_naming_the_reason(tmp_path, changes, param):
    repo = saved_checkpoint(tmp_path)
    with pytest.raises(InvalidRequest) as info:
        plan(repo, **changes)
    assert info.value.param == param


def test_inference_checkpoints_resume_weights_only(tmp_path):
    repo = saved_checkpoint(tmp_path, CheckpointType.INFERENCE)
    assert plan(repo).load_optimizer is False and plan(repo).step == 0
    with pytest.raises(InvalidRequest) as info:
        plan(repo, load_optimizer=True)
    assert info.value.param == "load_optimizer"


def test_another_users_checkpoint_is_not_found(tmp_path):
    repo = saved_checkpoint(tmp_path)
    with pytest.raises(NotFound):
        plan_resume(
            repo,
            "someone_else",
            "ckpt-1",
            resource=RESOURCE,
            load_optimizer=None,
            lora=None,
            lora_given=frozenset(),
        )


def test_a_full_weight_checkpoint_resumes_on_a_full_weight_resource_only(tmp_path):
    repo = saved_checkpoint(tmp_path)
    record = repo.get_checkpoint("ckpt-1")
    repo.put_checkpoint(replace(record, lora_rank=None, lora_config=None))
    full_weight = replace(RESOURCE, lora_enabled=False)
    resumed = plan(repo, resource=full_weight)
    assert (resumed.lora, resumed.step, resumed.load_optimizer) == (None, 3, True)
    with pytest.raises(InvalidRequest) as info:
        plan(repo)  # onto a LoRA resource
    assert info.value.param == "resume_from_checkpoint_id"
