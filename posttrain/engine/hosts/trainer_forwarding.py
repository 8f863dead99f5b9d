"""The Engine calls a host of generators apart (hosts/replicas/engine.py, hosts/vllm/engine.py)
leaves to its trainer engine unchanged: model facts, training, checkpoints, limits and persistence.
A subclass (hosts/lanes.py's GeneratorLanes) owns resources, sessions, publishing and sampling.

Every call into the trainer here holds `trainer_lock`: a VllmEngine's RLock, which it also
takes around its own calls, since its mismatch scoring samples on the trainer from generator
lanes and must never interleave with a training step (hosts/vllm/scoring.py); a nullcontext
for a ReplicatedEngine, whose replicas never call into the trainer beside its lane (a
replica's rebuild reads what the generators serve under the resource's staging lock, as every
change of it is made).

Imports: engine.interface, types.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
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
    """Everything but generators, answered by `self.trainer` under `self.trainer_lock`; the
    trainer calls that change what a session's generator serves go through the subclass's
    `_changing`, which stages the new weights for its generators."""

    trainer: Engine
    trainer_lock: AbstractContextManager[object]  # held around each call into the trainer

    @abstractmethod
    def _changing(self, resource_id: str, session_id: str, change: Callable[[], T]) -> T:
        """`change()`, a trainer call that changes what the session's generator serves; then
        the new weights staged for the generators."""

    def restore_session(
        self, resource_id: str, session_id: str, directory: Path, *, version: int
    ) -> dict[str, Any]:
        def restore() -> dict[str, Any]:
            with self.trainer_lock:
                return self.trainer.restore_session(
                    resource_id, session_id, directory, version=version
                )

        return self._changing(resource_id, session_id, restore)

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None:
        def load() -> None:
            with self.trainer_lock:
                self.trainer.load_training_state(
                    resource_id, session_id, directory, load_optimizer=load_optimizer
                )

        self._changing(resource_id, session_id, load)

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None:
        def load() -> None:
            with self.trainer_lock:
                self.trainer.load_adapter(resource_id, session_id, directory)

        self._changing(resource_id, session_id, load)

    def device_name(self) -> str:
        with self.trainer_lock:
            return self.trainer.device_name()

    def model_info(self, base_model: str) -> ModelInfo:
        with self.trainer_lock:
            return self.trainer.model_info(base_model)

    def is_loaded(self, resource_id: str) -> bool:
        with self.trainer_lock:
            return self.trainer.is_loaded(resource_id)

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        with self.trainer_lock:
            self.trainer.check_tokens(base_model, tokens, param)

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        with self.trainer_lock:
            return self.trainer.forward_backward_batch(resource_id, items)

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        with self.trainer_lock:
            self.trainer.custom_forward_backward(resource_id, session_id, request)

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        with self.trainer_lock:
            self.trainer.optim_step(resource_id, session_id, request)

    def generator_state(self, resource_id: str, session_id: str) -> tuple[dict[str, Tensor], int]:
        with self.trainer_lock:
            return self.trainer.generator_state(resource_id, session_id)

    def persist_session(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        parts: Collection[str],
        record: dict[str, Any],
    ) -> None:
        with self.trainer_lock:
            self.trainer.persist_session(resource_id, session_id, directory, parts, record)

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        with self.trainer_lock:
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
        with self.trainer_lock:
            self.trainer.save_adapter(
                resource_id, session_id, directory, lora=lora, base_model=base_model
            )

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        with self.trainer_lock:
            self.trainer.save_full_model(resource_id, session_id, directory, base_model=base_model)

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None:
        with self.trainer_lock:
            self.trainer.export_merged(base_model, adapter_dir, output_dir)
