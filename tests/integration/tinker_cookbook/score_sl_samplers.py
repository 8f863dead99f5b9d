"""Score token sequences with the samplers a cookbook run left behind, through the tinker SDK.

`python score_sl_samplers.py URL BASE_MODEL SEQUENCES_JSON [PATH ...]` prints one JSON object:
{"base": [...], "<tinker path>": [...]}, each value the `compute_logprobs` of every sequence
(the base model's, then each sampler checkpoint's). The tests compare checkpoints of different
runs with it: equal logprobs mean equal weights.
"""

from __future__ import annotations

import json
import sys

import tinker


def score(client: tinker.SamplingClient, sequences: list[list[int]]) -> list[list[float | None]]:
    futures = [client.compute_logprobs(tinker.ModelInput.from_ints(s)) for s in sequences]
    return [future.result() for future in futures]


if __name__ == "__main__":
    url, base_model, sequences_json, *paths = sys.argv[1:]
    sequences = json.loads(sequences_json)
    with tinker.ServiceClient(base_url=url) as service:
        out = {"base": score(service.create_sampling_client(base_model=base_model), sequences)}
        for path in paths:
            out[path] = score(service.create_sampling_client(model_path=path), sequences)
    print(json.dumps(out))
