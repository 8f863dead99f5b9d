"""How a ServerConfig field declares itself a `posttrain serve` flag: `flag(...)`, the field's
`json_schema_extra`. config.py declares the fields; config_sources.py turns these declarations
into flags and environment variables. Imports nothing from posttrain.
"""

from __future__ import annotations

from typing import Any, Literal

# The groups of `posttrain serve --help` (config_sources.FLAG_GROUPS says what each holds).
FlagGroup = Literal["basics", "models", "limits and auth", "scale-out", "performance"]


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
    spec = {"group": group, "name": name, "hidden": hidden, "env": env, "metavar": metavar}
    return {"flag": {**spec, "default": default, "switch": switch}}
