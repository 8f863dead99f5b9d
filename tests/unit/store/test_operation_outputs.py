"""Operation outputs are stored as the JSON of their dataclass and read back typed by kind;
a record written while outputs were plain dicts (the same JSON) reads back the same way."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from posttrain.api.kinds import WIRE_KINDS
from posttrain.records import OperationRecord
from posttrain.statuses import OperationStatus
from posttrain.store.db import connect
from posttrain.store.repo import Repo, to_json
from posttrain.types import (
    CheckpointOutput,
    CheckpointRef,
    CustomForwardBackwardOutput,
    ForwardBackwardResult,
    OperationKind,
    OperationOutput,
    OptimStepOutput,
    PolicySegment,
    SampledSequence,
    SampleOutput,
    SampleResult,
    StopReason,
    TopkPromptLogprobs,
    WeightsSyncOutput,
)

OUTPUTS: dict[OperationKind, OperationOutput] = {
    OperationKind.FORWARD_BACKWARD: ForwardBackwardResult(1.5, {"n": 2.0}, [[-0.5, -1.0]]),
    OperationKind.CUSTOM_FORWARD_BACKWARD: CustomForwardBackwardOutput(),
    OperationKind.OPTIM_STEP: OptimStepOutput(step=3),
    OperationKind.WEIGHTS_SYNC: WeightsSyncOutput(weights_version=2),
    OperationKind.SAMPLE: SampleOutput(
        (
            SampleResult(
                [SampledSequence([4, 5], [-0.1, -0.2], StopReason.STOP, 1)],
                [PolicySegment(0, 1)],
                prompt_logprobs=[-0.3],
                topk_prompt_logprobs=[TopkPromptLogprobs([7], [-0.4])],
            ),
        )
    ),
    OperationKind.TRAINING_CHECKPOINT: CheckpointOutput(CheckpointRef("ckpt-1", 1.0e9, 3)),
}


def record(kind: OperationKind, output: OperationOutput | None) -> OperationRecord:
    return OperationRecord(
        f"op-{kind}", "ts-1", kind, OperationStatus.COMPLETED, 1.0, 2.0, kind, "f", "u", output
    )


def test_every_output_type_round_trips_through_the_store(tmp_path: Path):
    repo = Repo(connect(tmp_path))
    for kind, output in OUTPUTS.items():
        repo.insert_operation(record(kind, output))
        assert repo.get_operation(f"op-{kind}") == record(kind, output)


def test_a_record_with_a_dict_output_written_before_reads_back_typed(tmp_path: Path):
    connection = connect(tmp_path)
    repo = Repo(connection)
    sample = record(OperationKind.SAMPLE, None)
    data = json.loads(to_json(sample))
    # The dict the scheduler stored before outputs were typed.
    data["output"] = {
        "results": [
            {
                "sequences": [
                    {
                        "tokens": [4, 5],
                        "logprobs": [-0.1, -0.2],
                        "stop_reason": "STOP_REASON_STOP",
                        "prompt_cache_hit_tokens": 1,
                    }
                ],
                "policy_segments": [{"start_token": 0, "version": 1}],
                "prompt_logprobs": [-0.3],
                "topk_prompt_logprobs": [{"token_ids": [7], "logprobs": [-0.4]}],
            }
        ]
    }
    connection.execute(
        "INSERT INTO operations (id, session_id, kind, idempotency_key, status, data)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (sample.id, "ts-1", "sample", "k", sample.status.value, json.dumps(data)),
    )
    stored = repo.get_operation(sample.id)
    assert stored is not None
    assert stored.output == OUTPUTS[OperationKind.SAMPLE]
    assert WIRE_KINDS[stored.kind].reply.of(stored).wire()["output"] == {
        "results": [
            {
                "policy_segments": [{"start_token": 0, "version": 1}],
                "sequences": [
                    {
                        "tokens": [4, 5],
                        "logprobs": [-0.1, -0.2],
                        "stop_reason": "STOP_REASON_STOP",
                        "prompt_cache_hit_tokens": 1,
                    }
                ],
                "prompt_logprobs": [-0.3],
                "topk_prompt_logprobs": [{"token_ids": [7], "logprobs": [-0.4]}],
            }
        ]
    }


def test_a_store_whose_keys_were_required_takes_operations_without_one(tmp_path: Path):
    """A store made when every operation had an Idempotency-Key (NOT NULL) is relaxed on
    open, its rows and their order kept; operations without a key are never deduplicated."""
    legacy = sqlite3.connect(tmp_path / "posttrain.sqlite3")
    legacy.execute(
        "CREATE TABLE operations (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL"
        " UNIQUE, session_id TEXT NOT NULL, kind TEXT NOT NULL, idempotency_key TEXT NOT NULL,"
        " status TEXT NOT NULL, data TEXT NOT NULL, UNIQUE (session_id, kind, idempotency_key))"
    )
    keyed = record(OperationKind.SAMPLE, None)
    legacy.execute(
        "INSERT INTO operations (id, session_id, kind, idempotency_key, status, data)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (keyed.id, "ts-1", "sample", keyed.idempotency_key, keyed.status.value, to_json(keyed)),
    )
    legacy.commit()
    legacy.close()
    repo = Repo(connect(tmp_path))
    assert repo.get_operation(keyed.id) == keyed
    unkeyed = [
        dataclasses.replace(
            keyed, id=f"op-{i}", idempotency_key=None, status=OperationStatus.PENDING
        )
        for i in range(2)
    ]
    assert [repo.insert_operation(op) for op in unkeyed] == unkeyed
    assert [op.id for op in repo.unfinished_operations("ts-1")] == ["op-0", "op-1"]
    assert repo.insert_operation(dataclasses.replace(keyed, id="op-again")) == keyed
