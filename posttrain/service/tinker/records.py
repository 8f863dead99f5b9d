"""What the Tinker dialect remembers about its objects, and what each maps to.

- ClientRecord: one SDK process (`ServiceClient`): heartbeats, finish. It owns training runs
  and samplers, whose ids it prefixes (`{client}:train:{n}`, `{client}:sample:{n}`; the SDK
  derives a created-via-load model's id itself, so the shape is forced).
- RunRecord: a Tinker training run ("model") = one posttrain training session on a LoRA model
  resource the dialect provisions per (user, base model).
- SamplerRecord: a sampling session = the posttrain session it samples on: a fresh adapter
  (base model), one loaded from a checkpoint (a saved path, a snapshot), or the training
  session itself (inflight weights). A snapshot's session is made once the checkpoint that
  freezes its weights is written (`checkpoint_future`).
- FutureRecord: a request id. Most name one posttrain operation; create_model and the
  create-via-load answer at once and keep their result.
- NameRecord: a `tinker://` checkpoint path = the future that writes it, then its checkpoint.
- ProvisionedRecord: a model resource the dialect made (find-or-create picks among these).

Imports: nothing from posttrain.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

CLIENT = "client"
RUN = "run"
SAMPLER = "sampler"
FUTURE = "future"
NAME = "name"
PROVISIONED = "provisioned"
SEQ = "seq"  # (run or sampler, seq_id) -> request id: a retried POST answers the same future


@dataclass(frozen=True)
class ClientRecord:
    id: str
    user: str
    created_at: float
    heartbeat_at: float
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    finished: bool = False
    next_sampler: int = 0  # create_sampling_session's own counter is the SDK's


@dataclass(frozen=True)
class RunRecord:
    model_id: str
    user: str
    client_id: str
    session_id: str
    resource_id: str
    base_model: str
    lora_rank: int
    train_unembed: bool
    created_at: float
    user_metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class SamplerRecord:
    id: str
    user: str
    client_id: str
    base_model: str
    kind: str  # "base", "path", "snapshot", "inflight"
    created_at: float
    session_id: str | None = None
    model_path: str | None = None
    checkpoint_future: str | None = None  # a snapshot's checkpoint, until its session exists
    checkpoint_id: str | None = None  # the weights it serves (snapshot, path): rebuilt from it
    last_used: float = 0.0  # its last sample: the least recently used gives its slot up first


class FutureExtra(TypedDict, total=False):
    """What a future's result needs beside its operation's output; the keys its type uses."""

    path: str  # save_weights, save_weights_for_sampler: the tinker:// path written
    sampling_session_id: str  # a snapshot's save_weights_for_sampler: the sampler it makes
    num_samples: int  # sample
    shapes: list[list[int]]  # forward_backward: each datum's target shape


@dataclass(frozen=True)
class FutureRecord:
    id: str
    user: str
    type: str  # the SDK's request type: forward_backward, optim_step, sample, ...
    created_at: float
    session_id: str | None = None
    operation_id: str | None = None
    operation_kind: str | None = None
    result: dict[str, Any] | None = None  # a future that answered at once: its model_id
    error: str | None = None
    category: str = "user"
    extra: FutureExtra = field(default_factory=FutureExtra)


@dataclass(frozen=True)
class NameRecord:
    path: str
    user: str
    model_id: str
    checkpoint_type: str  # "training" or "sampler"
    future_id: str
    created_at: float
    checkpoint_id: str | None = None
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None
    public: bool = False


@dataclass(frozen=True)
class ProvisionedRecord:
    """A model resource this dialect provisioned: its runs and samplers go only on these, never
    on a resource the user made on the Together surface (whose close would find them there)."""

    id: str
    user: str
    base_model: str
    created_at: float


Record = (
    ClientRecord | RunRecord | SamplerRecord | FutureRecord | NameRecord | ProvisionedRecord
)
R = TypeVar("R", bound=Record)


def as_dict(record: Record) -> dict[str, Any]:
    return dataclasses.asdict(record)


def from_dict(cls: type[R], data: dict[str, Any]) -> R:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})
