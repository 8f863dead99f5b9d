"""The tinker 0.38 SDK's RestClient over one training run's checkpoints: reads, TTL, publish
and delete as a user's script does them; prints one JSON object on its last stdout line for
tests/integration/test_tinker_checkpoints.py to check.

Run with the tinker 0.38 interpreter (tests/tinker_env.py): `python rest_checkpoints.py URL KEY`.
Nothing here imports posttrain.
"""

from __future__ import annotations

import json
import sys

import tinker


def main(url: str, key: str) -> dict:
    seen: dict = {}
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(
            base_model="posttrain/tiny-qwen3", rank=4, seed=1, user_metadata={"renderer": "qwen3"}
        )
        state = training.save_state("s1").result().path
        weights = training.save_weights_for_sampler("w1").result().path
        rest = client.create_rest_client()
        # What the cookbook reads back from a checkpoint path (checkpoint_utils).
        run = rest.get_training_run_by_tinker_path(state).result()
        seen["run"] = {
            "id": run.training_run_id,
            "base_model": run.base_model,
            "lora_rank": run.lora_rank,
            "user_metadata": run.user_metadata,
            "last": run.last_checkpoint.tinker_path if run.last_checkpoint else None,
            "last_sampler": (
                run.last_sampler_checkpoint.tinker_path if run.last_sampler_checkpoint else None
            ),
        }
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        seen["listed"] = [[c.checkpoint_id, c.checkpoint_type, c.size_bytes] for c in listed]
        page = rest.list_user_checkpoints(limit=1, offset=0).result()
        seen["page"] = [len(page.checkpoints), page.cursor.total_count if page.cursor else None]
        runs = rest.list_training_runs().result()
        seen["runs"] = [[r.training_run_id for r in runs.training_runs], runs.cursor.total_count]
        info = rest.get_weights_info_by_tinker_path(weights).result()
        seen["info"] = [info.base_model, info.is_lora, info.lora_rank, info.optimizer_config.type]
        rest.set_checkpoint_ttl_from_tinker_path(weights, 7200).result()
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        seen["ttl_s"] = [
            None if c.expires_at is None else (c.expires_at - c.time).total_seconds()
            for c in listed
        ]
        rest.publish_checkpoint_from_tinker_path(weights).result()
        seen["public"] = [
            c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints
        ]
        rest.unpublish_checkpoint_from_tinker_path(weights).result()
        rest.delete_checkpoint_from_tinker_path(state).result()
        listed = rest.list_checkpoints(training.model_id).result().checkpoints
        seen["after_delete"] = [c.tinker_path for c in listed]
        try:
            rest.delete_checkpoint_from_tinker_path(state).result()
            seen["deleted_again"] = "no error"
        except tinker.NotFoundError as exc:
            seen["deleted_again"] = str(exc)
        seen["paths"] = [state, weights]
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
