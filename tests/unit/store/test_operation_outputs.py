"""Operation outputs are stored as the JSON of their dataclass and read back typed by kind;
a record written while outputs were plain dicts (the same JSON) reads back the same way."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.api.responses import operation_json
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
    OperationRecord,
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
    assert operation_json(stored)["output"] == {
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
