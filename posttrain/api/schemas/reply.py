"""The base of every response model: how a reply is written to the wire.

A reply is built with `model_construct` from values the server holds: validating them would
change the wire (an int in a float field becomes `16.0`). `Reply.wire` writes the fields that
were set, so fields the server always writes are required, and those it writes only sometimes
are optional and never null. It hands values on as they are, which keeps ints ints and leaves
the float text to json.dumps (`1e-05`, where pydantic's JSON mode writes `0.00001`);
`model_dump` would also copy every list, and a large sample output's token and logprob lists
are most of it. Extra fields are allowed, as the SDK's own models allow them (api.md 0.3).

Imports: nothing from posttrain.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Self, cast

from pydantic import BaseModel, ConfigDict, Field

# RFC 3339 in UTC (`timestamp`).
Timestamp = Field(json_schema_extra={"format": "date-time"})


def timestamp(epoch_s: float) -> str:
    """RFC 3339 in UTC with a Z suffix."""
    moment = datetime.fromtimestamp(epoch_s, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Reply(BaseModel):
    """A response object: what the server writes, extras allowed."""

    model_config = ConfigDict(extra="allow")

    @classmethod
    def copied(cls, value: object, **fields: Any) -> Self:
        """The reply of a domain object: each field is `fields[name]` if given, else the
        attribute of `value` of the same name; an optional field that comes out None is left
        out, so it is absent from the wire."""
        out: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            if name in fields:
                item = fields[name]
            else:
                item = getattr(value, name) if field.is_required() else getattr(value, name, None)
            if item is not None or field.is_required():
                out[name] = item
        # The pydantic plugin types model_construct as returning the class that declares the
        # fields (here Reply), not the subclass it is called on, which it returns.
        return cast(Self, cls.model_construct(**out))

    def wire(self) -> dict[str, Any]:
        """The JSON object as sent: the fields that were set, in declared order, nested replies
        as objects, and every other value as it is (module docstring)."""
        fields = self.model_fields_set
        out = {
            name: _wire(getattr(self, name)) for name in type(self).model_fields if name in fields
        }
        out.update((name, _wire(value)) for name, value in (self.__pydantic_extra__ or {}).items())
        return out


def _wire(value: Any) -> Any:
    """A nested reply or list of replies as JSON objects; any other value, a token list
    included, is passed on as the same object rather than copied."""
    if isinstance(value, Reply):
        return value.wire()
    if isinstance(value, list) and value and isinstance(value[0], Reply):
        return [item.wire() for item in value]
    return value


def optional(**schema: Any) -> Any:
    """A field the server writes only sometimes, and never as null: not required, its schema
    its plain type (without the `default: null` that None would write), plus `schema`."""

    def written(generated: dict[str, Any]) -> None:
        generated.pop("default", None)
        generated.update(schema)

    return Field(default=None, json_schema_extra=written)
