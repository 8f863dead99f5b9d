"""What every wire model shares: strict and lenient bases, int64 as integer or numeric string,
and the fields a client actually sent.

Imports: nothing from posttrain.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema


def _int64(value: Any) -> Any:
    """int64 arrives as a JSON integer or a numeric string."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    return value


# Seeds and ids go to torch, whose generators take int64: a larger number is a 400 here, not a
# failure later.
Int64 = Annotated[
    int,
    BeforeValidator(_int64),
    Field(ge=-(2**63), lt=2**63),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
                {"type": "string", "pattern": "^-?[0-9]{1,18}$"},
            ]
        }
    ),
]


def _int64_list(value: Any) -> Any:
    """A token list: plain JSON integers pass without a Python call per token (the common
    case, checked in C); otherwise each item is converted as Int64 is, its index named."""
    if not isinstance(value, list) or set(map(type, value)) <= {int}:
        return value
    out = []
    for index, item in enumerate(value):
        try:
            out.append(_int64(item))
        except ValueError as exc:
            raise ValueError(f"[{index}]: {exc}") from None
    return out


Int64List = Annotated[list[int], BeforeValidator(_int64_list)]


class Wire(BaseModel):
    """Request objects reject unknown fields, so a typo is a 400 naming it, and non-finite
    numbers (JSON's 1e400 reads as inf) likewise."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Lenient(BaseModel):
    """Objects whose unknown fields are ignored (api.md 5.5 for optim-step)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def given_fields(model: BaseModel | None) -> dict[str, Any]:
    """The fields the client set (nulls mean absent, api.md 0.3); {} for a missing object."""
    return {} if model is None else model.model_dump(exclude_none=True)


class JsonObject(Lenient):
    """Any JSON object: an uploaded payload, parsed when the operation naming it is."""
