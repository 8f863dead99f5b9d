"""Wire models of model resources and training sessions (api.md 1.2, 1.3).

Imports: api.schemas.wire, types, errors.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from posttrain.api.schemas.wire import Int64, Wire
from posttrain.errors import InvalidRequest, Unsupported
from posttrain.types import (
    LoraConfig,
    MuonScaling,
)


def status_filter(values: list[str] | None, statuses: type[StrEnum]) -> set[str] | None:
    """A list endpoint's `status` query: comma lists, repeated keys too (api.md 0.4); None when
    absent (every status). An unknown value is a 400, not an empty page."""
    wanted = {part for value in values or () for part in value.split(",") if part}
    known = {status.value for status in statuses}
    if unknown := sorted(wanted - known):
        raise InvalidRequest(
            f"status: unknown value {unknown[0]!r}; known: {', '.join(sorted(known))}",
            param="status",
        )
    return wanted or None


# The wire's ceiling, which keeps a typo from being recorded as a billion replicas; the
# server's own bound (--max-generator-replicas, service/lifecycle/resources.py) is at most this.
MAX_GENERATOR_REPLICAS = 64


class ComputeConfigIn(Wire):
    gpu_type: str | None = None
    num_generator_replicas: int | None = Field(None, ge=0, le=MAX_GENERATOR_REPLICAS)


class MuonConfigIn(Wire):
    scaling_strategy: str | None = None


class OptimizerConfigIn(Wire):
    adam: dict[str, Any] | None = None
    muon: MuonConfigIn | None = None


class ResourceCreateIn(Wire):
    base_model: str
    base_weights_ref: str | None = None
    compute_config: ComputeConfigIn | None = None
    # Range checked by ResourceService against config.min_inactive_timeout_s (api.md 1.2).
    inactive_timeout: int | None = None
    lora_enabled: bool | None = None
    optimizer_config: OptimizerConfigIn | None = None

    def check_supported(self) -> None:
        """Refuse what this server cannot honour rather than drop it (api.md 7.20)."""
        if self.base_weights_ref is not None:
            raise Unsupported(
                "base_weights_ref: this server has no model registry to resolve it from;"
                " omit it to train the base model's own weights",
                param="base_weights_ref",
            )

    def muon_scaling(self) -> MuonScaling | None:
        config = self.optimizer_config
        if config is None or config.muon is None:
            return None
        if config.adam is not None:
            raise InvalidRequest(
                "optimizer_config sets both adam and muon; choose one",
                param="optimizer_config",
            )
        strategy = config.muon.scaling_strategy or "MUON_SCALING_STRATEGY_UNSPECIFIED"
        spellings = {
            "MUON_SCALING_STRATEGY_UNSPECIFIED": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_MATCH_ADAM": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_MATCH_ADAMW": MuonScaling.MATCH_ADAM,
            "MUON_SCALING_STRATEGY_ORIGINAL": MuonScaling.ORIGINAL,
        }
        if strategy not in spellings:
            raise InvalidRequest(
                f"unknown scaling_strategy {strategy!r}",
                param="optimizer_config.muon.scaling_strategy",
            )
        return spellings[strategy]


class ExtendExpiryIn(Wire):
    seconds: int = Field(ge=60, le=86400)


class LoraConfigIn(Wire):
    rank: int | None = Field(None, ge=1)
    alpha: float | None = Field(None, gt=0)
    dropout: float | None = Field(None, ge=0, lt=1)
    seed: Int64 | None = None
    train_unembed: bool | None = None

    def to_domain(self, default_seed: int) -> LoraConfig:
        defaults = LoraConfig()
        rank = self.rank if self.rank is not None else defaults.rank
        return LoraConfig(
            rank=rank,
            alpha=self.alpha if self.alpha is not None else defaults.alpha,
            dropout=self.dropout if self.dropout is not None else defaults.dropout,
            seed=self.seed if self.seed is not None else default_seed,
            train_unembed=self.train_unembed if self.train_unembed is not None else True,
        )


class WandbIn(Wire):
    entity: str | None = None
    group: str | None = None
    project: str | None = None
    run_id: str | None = None
    run_name: str | None = None
    url: str | None = None


class MetadataIn(Wire):
    wandb: WandbIn | None = None

    def to_domain(self) -> dict[str, dict[str, str]]:
        if self.wandb is None:
            return {}
        return {"wandb": self.wandb.model_dump(exclude_none=True)}


class SessionCreateIn(Wire):
    model_resources_id: str
    display_name: str | None = None
    load_optimizer: bool | None = None
    lora_config: LoraConfigIn | None = None
    metadata: MetadataIn | None = None
    resume_from_checkpoint_id: str | None = None


class SessionUpdateIn(Wire):
    display_name: str | None = None
    metadata: MetadataIn | None = None
