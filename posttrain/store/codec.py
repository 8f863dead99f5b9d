"""Domain values <-> the JSON the store keeps: records, operation outputs, typed requests.

A dataclass is written as the object of its fields (the wire's field names), an enum as its
value, a tuple as a list and bytes (expert routes) as URL-safe base64. Reading back rebuilds
the type a field's annotation names, so a value round-trips to an equal one. Two things an
annotation cannot tell are looked up: an operation's output and request types follow its kind
(types.OPERATION_TYPES), and a loss's params type follows the loss type (loss_specs).

Typed requests are what a restart replays (service/operations/submit.py,
service/durability/durable_sessions.py): the service reads them back itself, whichever layer parsed
them at first. Every operation's request is written at submit, so it is written by pydantic's
serializer: a forward-backward of 64 samples x 300 tokens took 104 ms with json.dumps (float repr)
and 3 ms so, more than parsing the request costs. It is read back only after a restart.

Imports: types, loss_specs.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import types
import typing
from enum import Enum
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ConfigDict, create_model

from posttrain.loss_specs import LOSS_SPECS
from posttrain.records import OperationRecord
from posttrain.types import OPERATION_TYPES, LossConfig, LossType, OperationKind, OperationRequest

T = TypeVar("T")


def _plain(value: object) -> Any:
    """json.dumps' fallback for what it cannot write itself: one level of a dataclass (the
    encoder recurses into the fields), or bytes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return base64.urlsafe_b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} has no stored form")


def to_json(value: object) -> str:
    """A record, output or request as compact JSON (StrEnums are strings, so write as such)."""
    return json.dumps(value, default=_plain, separators=(",", ":"))


def _convert(hint: Any, value: Any) -> Any:
    """Rebuild a value of type `hint` from its JSON form (dataclasses, enums, tuples, unions)."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:  # X | None
            return _convert(options[0], value)
        for option in options:
            if dataclasses.is_dataclass(option) and isinstance(value, dict):
                return _convert(option, value)
            if isinstance(option, type) and issubclass(option, Enum):
                try:
                    return option(value)
                except ValueError:
                    continue
        return value
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        if item in (int, float, str):
            return tuple(value)
        return tuple(_convert(item, v) for v in value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item) or isinstance(item, type) and issubclass(item, Enum):
            return [_convert(item, v) for v in value]
        return value  # lists of plain JSON values (tokens, logprobs) as they are
    if origin is dict:
        _, item = typing.get_args(hint)
        if typing.get_origin(item) is tuple:  # a sample's loss_fn_inputs
            return {k: _convert(item, v) for k, v in value.items()}
        return value
    if hint is bytes:
        return base64.urlsafe_b64decode(value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value)
    return value


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a record class: get_type_hints re-evaluates every string
    annotation, and it ran on each row read (85% of an operation GET's handler time)."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    if cls is LossConfig:
        return cast(T, _loss_config(data))  # the checker does not narrow T by `cls is`
    # As a plain `type`: mypy checks a type[T] against functools.cache's Hashable with an
    # unbound __hash__, and refuses it.
    record_type: type = cls
    hints = _field_hints(record_type)
    kwargs = {
        f.name: _convert(hints[f.name], data[f.name])
        # T has no bound, so the checker cannot know that every record type is a dataclass.
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name in data
    }
    return cls(**kwargs)


def _loss_config(data: dict[str, Any]) -> LossConfig:
    """The params' type follows the loss type: PPO's and CISPO's have the same fields."""
    loss_type = LossType(data["type"])
    params_type = LOSS_SPECS[loss_type].params_type
    params = data.get("params")
    if params is None or params_type is None:
        return LossConfig(loss_type)
    return LossConfig(loss_type, from_dict(params_type, params))


def operation_from_dict(data: dict[str, Any]) -> OperationRecord:
    """An operation record; its output is rebuilt as the type of its kind."""
    output = data.get("output")
    op = from_dict(OperationRecord, {**data, "output": None})
    if output is None:
        return op
    return dataclasses.replace(op, output=output_from_dict(op.kind, output))


def output_from_dict(kind: OperationKind, data: dict[str, Any]) -> Any:
    return from_dict(OPERATION_TYPES[kind].output, data)


@functools.cache
def _kept(request_type: type) -> type[BaseModel]:
    """A model holding one request of `request_type`: pydantic serializes the dataclass (bytes
    as base64, where its default would be UTF-8)."""
    config = ConfigDict(ser_json_bytes="base64", arbitrary_types_allowed=True)
    return create_model(f"Kept{request_type.__name__}", __config__=config, request=request_type)


def request_to_json(request: OperationRequest) -> str:
    """`{"request": <its dataclass fields>}`; values are written as they are (no coercion)."""
    request_type: type = type(request)  # a plain `type` for functools.cache (from_dict says why)
    wrapped = _kept(request_type).model_construct(request=request)
    return wrapped.model_dump_json(warnings=False)


def request_from_json(kind: OperationKind, text: str) -> OperationRequest:
    """A typed request stored with request_to_json, read back as the request type of its kind."""
    data = json.loads(text)["request"]
    request: OperationRequest = from_dict(OPERATION_TYPES[kind].request, data)
    return request
