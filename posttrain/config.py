"""The ServerConfig tree: built once by cli.py from flags and POSTTRAIN_* env, then passed down.

Every field has a default or is required, and a description. This is the only module that reads
os.environ. Imports: errors.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.errors import InvalidRequest

BUILTIN_MODEL_ID = "posttrain/tiny-qwen3"
BUILTIN_MODEL_DIR = Path(__file__).parent / "model" / "builtin" / "tiny-qwen3"
ENV_PREFIX = "POSTTRAIN_"


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(description="base_model id clients pass to model-resources create")
    path: Path = Field(description="local Hugging Face causal-LM directory")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    device: str = Field("auto", description="torch device: auto (cuda if present), cpu, cuda")
    max_lora_rank: int = Field(64, ge=1, description="largest LoRA rank a client may request")
    max_batch_size: int = Field(256, ge=1, description="most samples in one forward-backward")
    max_seq_length: int = Field(
        2048, ge=2, description="most tokens in one training sample (capped by the model)"
    )
    max_sessions_per_resource: int = Field(
        8, ge=1, description="concurrent LoRA sessions one model resource hosts"
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="tokens per chunk of the float32 log-softmax (bounds memory)"
    )


class SamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tokens: int = Field(100, ge=1, description="default sampling max_tokens (api.md 7.11)")
    temperature: float = Field(1.0, ge=0, description="default sampling temperature")
    num_samples: int = Field(1, ge=1, description="default num_samples")


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one)")
    data_dir: Path = Field(Path("posttrain-data"), description="SQLite store and large files")
    api_keys: tuple[str, ...] = Field(
        (), description="accepted bearer keys; empty accepts any non-empty key (single user)"
    )
    user_id: str = Field("user_local", description="created_by of every object (single user)")
    models: tuple[ModelSpec, ...] = Field(
        (ModelSpec(id=BUILTIN_MODEL_ID, path=BUILTIN_MODEL_DIR),),
        description="base models this server can train",
    )
    signing_key: str = Field("", description="HMAC key for signed URLs; empty = random per run")
    url_ttl_s: int = Field(3600, ge=1, description="lifetime of signed download/upload URLs")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="engine settings")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="sample defaults")


def model_spec_from_path(path: str | Path) -> ModelSpec:
    """`--model PATH` adds a local HF directory, listed under its directory name."""
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise InvalidRequest(f"--model {path}: no config.json in that directory", param="models")
    return ModelSpec(id=directory.name, path=directory)


def build_config(**overrides: object) -> ServerConfig:
    """ServerConfig from POSTTRAIN_* env (HOST, PORT, DATA_DIR, API_KEY) and explicit overrides.

    Overrides win; an invalid value raises InvalidRequest naming the field."""
    values: dict[str, object] = {}
    env_fields = {"HOST": "host", "PORT": "port", "DATA_DIR": "data_dir"}
    for env_name, field_name in env_fields.items():
        if (value := os.environ.get(ENV_PREFIX + env_name)) is not None:
            values[field_name] = value
    if api_key := os.environ.get(ENV_PREFIX + "API_KEY"):
        values["api_keys"] = (api_key,)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServerConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise InvalidRequest(f"config {field}: {first['msg']}", param=field) from exc
