"""GET /v1/rl/supported-models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from posttrain.api.deps import ServicesDep, UserDep

router = APIRouter()


@router.get("/v1/rl/supported-models")
def supported_models(*, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    sampler = svc.config.sampler
    data = []
    for base_model, info in svc.resources.supported_models():
        limits = {"max_batch_size": info.max_batch_size, "max_seq_length": info.max_seq_length}
        data.append(
            {
                "base_model": base_model,
                "default_gpu_type": svc.resources.gpu_type(),
                "compute_configs": [
                    {
                        "gpu_type": svc.resources.gpu_type(),
                        "generator_config": {
                            "context_length": info.context_length,
                            "sampling_defaults": {
                                "logprobs": 1,
                                "max_tokens": sampler.max_tokens,
                                "n": sampler.num_samples,
                                "temperature": sampler.temperature,
                            },
                        },
                        "trainer_config": {"lora": {**limits, "max_rank": info.max_lora_rank}},
                    }
                ],
            }
        )
    return {"data": data}
