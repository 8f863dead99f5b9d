"""GET /v1/rl/supported-models: each base model's one compute config, on the engine's device.

Every model trains either way here, so trainer_config has both `lora` and `full`; both use the
engine's limits (a full-weight resource hosts one session, api.md 1.2).
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter

from posttrain.api.contract import documented
from posttrain.api.deps import ServicesDep, UserDep
from posttrain.api.schemas import objects as o
from posttrain.config import SamplerConfig

router = APIRouter()


class ModelLimits(Protocol):
    """What a supported model's reply reads of the engine's ModelInfo (which the api layer
    does not import: it reaches the engine through the service only)."""

    @property
    def context_length(self) -> int: ...
    @property
    def max_seq_length(self) -> int: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...


def supported_model(
    base_model: str, info: ModelLimits, sampler: SamplerConfig, device: str
) -> o.SupportedModel:
    """`info`: the engine's ModelInfo for `base_model` (its limits and context length)."""
    generator = o.GeneratorConfig.model_construct(
        context_length=info.context_length,
        sampling_defaults=o.SamplingDefaults.model_construct(
            logprobs=1,
            max_tokens=sampler.max_tokens,
            n=sampler.num_samples,
            temperature=sampler.temperature,
        ),
    )
    trainer = o.TrainerConfig.model_construct(
        full=o.TrainerLimits.model_construct(
            max_batch_size=info.max_batch_size, max_seq_length=info.max_seq_length
        ),
        lora=o.LoraTrainerLimits.model_construct(
            max_batch_size=info.max_batch_size,
            max_seq_length=info.max_seq_length,
            max_rank=info.max_lora_rank,
        ),
    )
    compute = o.SupportedComputeConfig.model_construct(
        gpu_type=o.SUPPORTED_MODELS_GPU_TYPE,
        device=device,
        generator_config=generator,
        trainer_config=trainer,
    )
    return o.SupportedModel.model_construct(
        base_model=base_model,
        default_gpu_type=o.SUPPORTED_MODELS_GPU_TYPE,
        compute_configs=[compute],
    )


@router.get("/v1/rl/supported-models", **documented(o.SupportedModels))
def supported_models(*, svc: ServicesDep, user: UserDep) -> dict[str, Any]:
    sampler = svc.config.sampler
    device = svc.resources.device_name()
    data = [
        supported_model(base_model, info, sampler, device)
        for base_model, info in svc.resources.supported_models()
    ]
    return o.SupportedModels.model_construct(data=data).wire()
