"""How a ServerConfig field declares itself a `posttrain serve` flag: `flag(...)`, the field's
`json_schema_extra`. config.py declares the fields; config_sources.py turns these declarations
into flags and environment variables. Imports nothing from posttrain.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, cast

# The groups of `posttrain serve --help` (config_sources.FLAG_GROUPS says what each holds).
FlagGroup = Literal["basics", "models", "limits and auth", "scale-out", "performance"]


class FlagSpec(TypedDict):
    """What `flag(...)` declares for a field: its arguments, as `flag` describes them."""

    group: FlagGroup
    name: str | None
    hidden: bool
    env: bool | str
    metavar: str | None
    default: str | None
    switch: bool


def flag(
    group: FlagGroup,
    *,
    name: str | None = None,
    hidden: bool = False,
    env: bool | str = False,
    metavar: str | None = None,
    default: str | None = None,
    switch: bool = False,
) -> dict[str, Any]:
    """The `json_schema_extra` of a field `posttrain serve` takes as a flag in help `group`.

    `name`: the flag when not `--` plus the field's name with dashes; `hidden`: kept out of
    --help (test knobs); `env`: also read from POSTTRAIN_<FIELD NAME> (a str: that variable);
    `default`: what --help says for the default when the value alone would not tell a user;
    `switch`: a bool given as a bare `--flag` (bools are otherwise `on|off`)."""
    spec = FlagSpec(
        group=group,
        name=name,
        hidden=hidden,
        env=env,
        metavar=metavar,
        default=default,
        switch=switch,
    )
    return {"flag": spec}


def declared_flag(json_schema_extra: object) -> FlagSpec | None:
    """The FlagSpec that `flag(...)` put in a field's `json_schema_extra`; None for a field
    that is not a flag."""
    spec = json_schema_extra.get("flag") if isinstance(json_schema_extra, dict) else None
    # Only `flag` writes this key, so a dict here has FlagSpec's keys and types.
    return cast(FlagSpec, spec) if isinstance(spec, dict) else None
