"""GET /v1/rl/supported-models: each base model's one compute config, on the engine's device.

Every model trains either way here, so trainer_config has both `lora` and `full`; both use the
engine's limits (a full-weight resource hosts one session, api.md 1.2).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from posttrain.api.contract import documented
from posttrain.api.deps import ServicesDep, UserDep
from posttrain.api.responses import SUPPORTED_MODELS_GPU_TYPE
from posttrain.api.schemas import objects as o

router = APIRouter()


@router.get("/v1/rl/supported-models", **documented(o.SupportedModels))
def supported_models(*, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    sampler = svc.config.sampler
    device = svc.resources.device_name()
    data = []
    for base_model, info in svc.resources.supported_models():
        limits = {"max_batch_size": info.max_batch_size, "max_seq_length": info.max_seq_length}
        data.append(
            {
                "base_model": base_model,
                "default_gpu_type": SUPPORTED_MODELS_GPU_TYPE,
                "compute_configs": [
                    {
                        "gpu_type": SUPPORTED_MODELS_GPU_TYPE,
                        "device": device,
                        "generator_config": {
                            "context_length": info.context_length,
                            "sampling_defaults": {
                                "logprobs": 1,
                                "max_tokens": sampler.max_tokens,
                                "n": sampler.num_samples,
                                "temperature": sampler.temperature,
                            },
                        },
                        "trainer_config": {
                            "full": limits,
                            "lora": {**limits, "max_rank": info.max_lora_rank},
                        },
                    }
                ],
            }
        )
    return {"data": data}
