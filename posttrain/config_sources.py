"""Where a ServerConfig's values come from: POSTTRAIN_* environment variables, `posttrain
serve` flags (`settings()`: the fields config.py declares as flags), the keys file and the
model directories a user names, directly or by Hugging Face Hub id.

The only module that reads or writes os.environ. Imports: config, config_flags, errors,
model.hub (the snapshot directory of a hub id).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from posttrain.config import BUILTIN_MODELS, ModelSpec, ServerConfig, builtin_model_specs
from posttrain.config_flags import declared_flag
from posttrain.errors import ConfigError
from posttrain.model.hub import parse_hub_id, snapshot_dir

ENV_PREFIX = "POSTTRAIN_"

# `posttrain serve --help` shows its flags in these groups, in this order.
FLAG_GROUPS: dict[str, str] = {
    "basics": "where the server listens and keeps its data",
    "models": "the base models served, and how they compute",
    "limits and auth": "who may call, and how much one request or the server may take",
    "scale-out": "worker processes, trainer ranks, generator replicas and Ray",
    "performance": "trade-offs that do not change results",
}


@dataclass(frozen=True)
class Setting:
    """One field of the ServerConfig tree that `posttrain serve` takes as a flag."""

    path: tuple[str, ...]  # ("engine", "device")
    info: FieldInfo
    flag: str
    group: str
    hidden: bool
    env: str | None
    metavar: str | None
    default: str | None
    switch: bool


def settings(
    model: type[BaseModel] | None = None, prefix: tuple[str, ...] = ()
) -> Iterator[Setting]:
    """Every flagged field of `model` (ServerConfig) and of its sub-configs, in field order."""
    for field_name, info in (model or ServerConfig).model_fields.items():
        path = (*prefix, field_name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from settings(info.annotation, path)
            continue
        spec = declared_flag(info.json_schema_extra)
        if spec is None:
            continue
        yield Setting(
            path=path,
            info=info,
            flag=spec["name"] or "--" + field_name.replace("_", "-"),
            group=spec["group"],
            hidden=spec["hidden"],
            env=_env_name(spec["env"], path),
            metavar=spec["metavar"],
            default=spec["default"],
            switch=spec["switch"],
        )


def stay_offline() -> None:
    """Every model is a local directory by now (a hub id was resolved to its snapshot while
    the config was built): transformers must never reach for a hub, and a server's output is
    its log lines, not download or loading progress bars. Set before transformers is imported
    (it reads both then); worker processes inherit them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def hub_is_offline() -> bool:
    """huggingface_hub's offline mode, read as it reads it (constants.HF_HUB_OFFLINE)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value or "").upper() in {"1", "ON", "YES", "TRUE"}


def model_spec_from_path(path: str | Path, *, given: str | None = None) -> ModelSpec:
    """`--model PATH` adds a local HF directory, listed under its directory name. `given`:
    the whole `--model` value, which an error names (PATH alone by default)."""
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        where = path if given else "that directory"
        raise ConfigError(f"--model {given or path}: no config.json in {where}", param="models")
    return ModelSpec(id=directory.name, path=directory)


def model_spec_from_flag(value: str) -> ModelSpec:
    """One `--model` value: `PATH` (served under its directory name), `ORG/NAME[@REVISION]`
    (a Hugging Face Hub id: its snapshot in the HF cache, downloaded unless offline, served
    under ORG/NAME), or `NAME=PATH` and `NAME=BUILTIN` (PATH, or a built-in model's
    directory, served as base_model NAME: a hub name such as `Qwen/Qwen3-8B`, which clients
    that look models up by name know).

    A value that is itself a directory is a PATH, even with a `=` in it; one that names
    nothing on disk and reads `ORG/NAME` is a hub id."""
    given = Path(value).expanduser()
    if value in BUILTIN_MODELS:  # read as ORG/NAME, it would send the user to the hub
        raise ConfigError(f"--model {value}: built in and always served", param="models")
    if not given.exists() and (hub_id := parse_hub_id(value)):
        path = snapshot_dir(hub_id, is_offline=hub_is_offline())
        return ModelSpec(id=hub_id.repo_id, path=path)
    if "=" not in value or given.is_dir():
        return model_spec_from_path(value)
    name, _, target = value.partition("=")
    # Tinker clients cut a model name at `:` (`name:checkpoint`), so a NAME holds none.
    if not name or any(c.isspace() or c == ":" for c in name):
        raise ConfigError(
            f"--model {value}: NAME in NAME=PATH must be non-empty, without spaces or `:`",
            param="models",
        )
    if not target:
        raise ConfigError(f"--model {value}: no PATH after `{name}=`", param="models")
    if target in BUILTIN_MODELS:
        return ModelSpec(id=name, path=BUILTIN_MODELS[target])
    return ModelSpec(id=name, path=model_spec_from_path(target, given=value).path)


def model_specs_from_flags(values: list[str]) -> tuple[ModelSpec, ...]:
    """The built-in models, then one per `--model` value; a base_model name served twice is
    refused, naming the value that repeats it."""
    specs = list(builtin_model_specs())
    for value in values:
        spec = model_spec_from_flag(value)
        if any(spec.id == other.id for other in specs):
            raise ConfigError(
                f"--model {value}: base_model {spec.id!r} is already served; give this one"
                " another name with --model NAME=PATH",
                param="models",
            )
        specs.append(spec)
    return tuple(specs)


def load_keys_file(path: str | Path) -> dict[str, str]:
    """API key -> user id from a keys file: one `KEY USER_ID` pair per line, separated by
    whitespace; blank lines and lines starting with `#` are skipped.

    A malformed line, a repeated key or a file without keys raises ConfigError naming the
    line: an empty map would silently mean single-user mode, which accepts any key."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"--keys-file {path}: {exc.strerror}", param="api_keys") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2:
            raise ConfigError(
                f"--keys-file {path}:{number}: expected `KEY USER_ID`, got {len(fields)} fields",
                param="api_keys",
            )
        key, user = fields
        if key in keys:
            raise ConfigError(
                f"--keys-file {path}:{number}: this key already appears above", param="api_keys"
            )
        keys[key] = user
    if not keys:
        raise ConfigError(f"--keys-file {path}: the file holds no keys", param="api_keys")
    return keys


def api_keys_from(
    api_key: str | None, keys_file: str | Path | None, user_id: str
) -> dict[str, str]:
    """The key -> user map of `--keys-file` plus `--api-key` (which belongs to `user_id`)."""
    keys = load_keys_file(keys_file) if keys_file else {}
    if api_key:
        if keys.get(api_key, user_id) != user_id:
            raise ConfigError(
                f"--api-key is also in --keys-file for user {keys[api_key]!r}", param="api_keys"
            )
        keys[api_key] = user_id
    return keys


def _place(values: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    """Set `value` at `path` in the nested dict of ServerConfig arguments."""
    *parents, last = path
    for name in parents:
        inner = values.get(name)
        values[name] = inner = inner.model_dump() if isinstance(inner, BaseModel) else inner or {}
        values = inner
    values[last] = value


def _env_name(env: bool | str, path: tuple[str, ...]) -> str | None:
    """The variable a setting is read from: its own name, POSTTRAIN_<PATH>, or none."""
    if isinstance(env, str):
        return env
    return ENV_PREFIX + "_".join(path).upper() if env else None


def build_config(
    *,
    api_key: str | None = None,
    keys_file: str | Path | None = None,
    flags: dict[tuple[str, ...], object] | None = None,
    **overrides: object,
) -> ServerConfig:
    """ServerConfig from POSTTRAIN_* env (the settings declared with `env=True`, and API_KEY,
    KEYS_FILE), then `overrides` (top-level fields or sub-configs), then `flags` (setting path
    -> value as given on the command line; `models`: the `--model` values, `[NAME=]PATH`,
    served beside the built-ins).

    Later sources win; an invalid value raises ConfigError naming the flag, variable or field."""
    values: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    for setting in settings():
        if setting.env and (env_value := os.environ.get(setting.env)) is not None:
            _place(values, setting.path, env_value)
            origins[setting.path] = f"{setting.env}={env_value}"
    values.update({k: v for k, v in overrides.items() if v is not None})
    named = {setting.path: setting.flag for setting in settings()}
    for path, given in (flags or {}).items():
        value = given
        if path == ("models",):
            assert isinstance(given, list)
            value = model_specs_from_flags(given)
        _place(values, path, value)
        origins[path] = f"{named[path]} {given}"
    api_key = api_key or os.environ.get(ENV_PREFIX + "API_KEY") or None
    keys_file = keys_file or os.environ.get(ENV_PREFIX + "KEYS_FILE") or None
    if api_key or keys_file:
        user_id = str(values.get("user_id") or ServerConfig.model_fields["user_id"].default)
        values["api_keys"] = api_keys_from(api_key, keys_file, user_id)
    try:
        return ServerConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(str(part) for part in first["loc"])
        field = ".".join(loc)
        message = first["msg"].removeprefix("Value error, ")
        origin = next(
            (origins[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in origins), None
        )
        where = origin or f"config {field}"
        raise ConfigError(f"{where}: {message}", param=field) from exc
