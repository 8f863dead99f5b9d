"""The Engine calls a host of generators apart (hosts/replicas/engine.py, hosts/vllm/engine.py)
leaves to its trainer engine unchanged: model facts, training, checkpoints, limits and persistence.
A subclass owns resources, sessions, publishing and sampling (and may refine model_info).

Imports: engine.interface, types.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor

from posttrain.engine.interface import Engine, ModelInfo
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    OptimStepRequest,
)

T = TypeVar("T")


class TrainerForwarding(Engine):
    """Everything but generators, answered by `self.trainer`; the trainer calls that change
    what a session's generator serves go through the subclass's `_changing`, which stages the
    new weights for its generators."""

    trainer: Engine

    @abstractmethod
    def _changing(self, resource_id: str, session_id: str, change: Callable[[], T]) -> T:
        """`change()`, a trainer call that changes what the session's generator serves; then
        the new weights staged for the generators."""

    def restore_session(
        self, resource_id: str, session_id: str, directory: Path, *, version: int
    ) -> dict[str, Any]:
        return self._changing(
            resource_id,
            session_id,
            lambda: self.trainer.restore_session(
                resource_id, session_id, directory, version=version
            ),
        )

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None:
        self._changing(
            resource_id,
            session_id,
            lambda: self.trainer.load_training_state(
                resource_id, session_id, directory, load_optimizer=load_optimizer
            ),
        )

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None:
        self._changing(
            resource_id,
            session_id,
            lambda: self.trainer.load_adapter(resource_id, session_id, directory),
        )

    def device_name(self) -> str:
        return self.trainer.device_name()

    def model_info(self, base_model: str) -> ModelInfo:
        return self.trainer.model_info(base_model)

    def is_loaded(self, resource_id: str) -> bool:
        return self.trainer.is_loaded(resource_id)

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        self.trainer.check_tokens(base_model, tokens, param)

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        return self.trainer.forward_backward_batch(resource_id, items)

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        self.trainer.custom_forward_backward(resource_id, session_id, request)

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        self.trainer.optim_step(resource_id, session_id, request)

    def generator_state(self, resource_id: str, session_id: str) -> tuple[dict[str, Tensor], int]:
        return self.trainer.generator_state(resource_id, session_id)

    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None:
        self.trainer.persist_session(resource_id, session_id, directory, parts, record)

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        self.trainer.save_training_state(resource_id, session_id, directory)

    def save_adapter(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        *,
        lora: LoraConfig,
        base_model: str,
    ) -> None:
        self.trainer.save_adapter(
            resource_id, session_id, directory, lora=lora, base_model=base_model
        )

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        self.trainer.save_full_model(resource_id, session_id, directory, base_model=base_model)

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None:
        self.trainer.export_merged(base_model, adapter_dir, output_dir)
