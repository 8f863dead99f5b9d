"""The ServerConfig tree: built once by cli.py from flags and POSTTRAIN_* env, then passed down.

Every field has a default or is required, and a description. This is the only module that reads
os.environ. Imports: errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.errors import ConfigError

ENV_PREFIX = "POSTTRAIN_"

# The built-in models, shipped as package data (built by scripts/build_tiny_model.py): id ->
# directory. Every server offers all of them; BUILTIN_MODEL_ID (the dense one) is the default
# of the demo, the examples and the tests.
BUILTIN_MODELS: dict[str, Path] = {
    f"posttrain/{name}": Path(__file__).parent / "model" / "builtin" / name
    for name in ("tiny-qwen3", "tiny-qwen3-moe")
}
BUILTIN_MODEL_ID = "posttrain/tiny-qwen3"
BUILTIN_MODEL_DIR = BUILTIN_MODELS[BUILTIN_MODEL_ID]


# Unit suffixes of a byte count (`--memory-limit 8GiB`): binary and decimal prefixes.
BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """A byte count with an optional unit suffix: `8GiB`, `512MiB`, `1.5GB`, `4096`."""
    stripped = text.strip()
    number = stripped.rstrip("BbIiKkMmGgTt ")
    unit = stripped[len(number) :].strip().upper()
    if unit not in BYTE_UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB .. TiB)")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of bytes with a unit, e.g. 8GiB") from None
    return int(value * BYTE_UNITS[unit])


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(description="base_model id clients pass to model-resources create")
    path: Path = Field(description="local Hugging Face causal-LM directory")


def builtin_model_specs() -> tuple[ModelSpec, ...]:
    """One ModelSpec per built-in model, the default first."""
    return tuple(ModelSpec(id=model_id, path=path) for model_id, path in BUILTIN_MODELS.items())


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    device: str = Field("auto", description="torch device: auto (cuda if present), cpu, cuda")
    # Why half the cores and not torch's one per core: engine/threads.py (measured in
    # docs/benchmarks.md, "Beside a busy process").
    threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each engine process; None: half the cores the"
        " process may use, split between a trainer group's ranks, at least one (keeps a busy"
        " neighbour from stalling every operator; fixed per machine, so runs reproduce)",
    )
    # Measured (bench/process_boundary.py, docs/benchmarks.md): the pipe costs about 0.5 ms a
    # call, within the noise of every operation but a publish; a worker process costs a start
    # (spawn, import torch, load the model: seconds) and its own copy of the libraries. Threads
    # stay the default until the trainer and generators run apart (issue 15).
    workers: Literal["thread", "process"] = Field(
        "thread",
        description="where each model resource's engine runs: a thread of the API process, or"
        " a worker process of its own (engine/process.py: a crash or out-of-memory there fails"
        " that resource's operations, not the server, and its sessions are restored)",
    )
    # Measured (bench/scale_out.py, docs/benchmarks.md): a replica process costs a start
    # (spawn, import torch, load the model: seconds) and a copy of the model, and each
    # weights-sync pickles the published tensors across a pipe. It pays where samples are long
    # and several sessions train while others sample; on the built-in model and in the tests
    # the inline generator is faster, so it stays the default.
    generators: Literal["inline", "process"] = Field(
        "inline",
        description="where each model resource's generators run: inline, on the trainer's"
        " model and lane (a sample waits for the trainer and the trainer for it), or as"
        " compute_config.num_generator_replicas replica processes that sample beside the"
        " trainer (engine/replicas.py)",
    )
    # Measured (bench/scale_out.py, docs/benchmarks.md): on one CPU host a broadcast and the
    # pipes move an adapter alike; a broadcast sends a bucket's bytes once for all replicas
    # instead of pickling them down each pipe, and is what crosses machines under --ray.
    weights_transport: Literal["broadcast", "pipe"] = Field(
        "broadcast",
        description="how a weights-sync's bytes reach --generators process replicas: one gloo"
        " broadcast per 64 MiB bucket in a torch.distributed group of the resource's replicas"
        " (engine/weights_broadcast.py; down the pipes when the group cannot form), or down each"
        " replica's pipe",
    )
    # Built, tested eagerly on the CPU (the same static passes) and by `-m gpu` tests, but not
    # yet measured on a GPU: a layout's graph is captured per generate call, and whether its
    # replays win back the capture on short generations is what bench/gpu_check.py's "decode
    # paths" line measures. Until then CUDA decodes in dynamic blocks of 8 passes (one host
    # read per block), which needs no capture.
    cuda_graphs: bool = Field(
        False,
        description="on CUDA, decode in static-shape passes captured in CUDA graphs and"
        " replayed (engine/decode_graph.py); off: dynamic passes in blocks of 8, one host read"
        " per block. No effect on other devices",
    )
    ray: str | None = Field(
        None,
        min_length=1,
        description="place each model resource's processes (its --workers process trainer,"
        " its --generators process replicas) as Ray actors in a placement group of its own:"
        " 'local' starts a Ray instance on this machine, anything else is the address of a"
        " Ray cluster to join (engine/ray_placement.py; pip install 'posttrain[ray]');"
        " None: local processes, and nothing imports Ray",
    )
    ray_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description="how a resource's placement group lays out its processes on the Ray"
        " cluster's nodes: PACK (as few nodes as possible) or SPREAD (across nodes)",
    )
    # Data parallel (engine/trainer_group.py): each rank holds the whole model and forwards its
    # share of a batch's rows; a full-weight session's gradients and optimizer state are
    # sharded over the ranks (engine/sharding.py). Measured (bench/trainer_ranks.py,
    # docs/benchmarks.md): on the 2-core CPU two ranks are slower than one (a 38M full-weight
    # step, 10-15 ms more per small command), so one process is the default.
    trainer_ranks: int = Field(
        1,
        ge=1,
        description="processes each model resource's trainer runs on: 1 (in the engine of"
        " --workers) or a torch.distributed group of N rank processes that split each"
        " forward-backward's rows and all-reduce its gradients (engine/trainer_group.py)",
    )
    # ZeRO-3 (engine/param_shards.py): on trainer_ranks > 1 a full-weight session's
    # parameters are sharded too, each rank holding only the parameters it owns between
    # operations and gathering a layer's just before its forward and backward, and rank 0
    # alone the generator's copy. The default: on the 2-core CPU its step time equals
    # ZeRO-2's (0.89-1.04x), and a 38M session's ranks hold 439 and 293 MiB against ZeRO-2's
    # 512 each (docs/benchmarks.md, "ZeRO-3"), so a model whose weights and AdamW state do not
    # fit one device trains on N. Off: ZeRO-2, parameters replicated.
    shard_parameters: bool = Field(
        True,
        description="on a trainer group, shard a full-weight session's parameters over the"
        " ranks as well as its gradients and optimizer state (ZeRO-3; engine/param_shards.py)",
    )
    max_generator_replicas: int = Field(
        8,
        ge=1,
        description="the most compute_config.num_generator_replicas a model resource may ask for",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="base weights' dtype: auto = bfloat16 on CUDA, float32 on CPU; float32 on"
        " CUDA makes sampler and trainer logprobs agree to float32 rounding",
    )
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
    # Measured on a 2-core CPU (38M-parameter Qwen3, bench/forward_backward.py): one more forward
    # costs 10-35 tokens of work, and 256 pads that script's 64..1024 batch by 6% (32: by 1%).
    # On a GPU (estimated, not measured yet) the fixed cost is a forward's hundreds of kernel
    # launches, some milliseconds: a few hundred tokens of a 0.2B model at the 43k tokens/s of
    # docs/benchmarks.md. 256 suits the GPU, where serving runs, and costs the CPU little.
    bucket_overhead_tokens: int = Field(
        256,
        ge=0,
        description="fixed cost of one model forward, in tokens of work: a training batch's rows"
        " are grouped by length into forwards that minimise padded tokens plus this per forward"
        " (engine/buckets.py); 0 gives one forward per distinct length, a huge value one padded"
        " forward for the whole batch",
    )
    prefix_cache_mib: int = Field(
        512,
        ge=0,
        description="memory budget (MiB) per model resource for the sampler's cache of prompt"
        " prefix KV, evicted least recently used first; 0 disables the prefix cache",
    )
    memory_limit: int | None = Field(
        None,
        ge=1,
        description="bytes the server's process (on CUDA: torch's allocations on the device)"
        " may use, e.g. 8GiB: an operation whose estimated peak does not fit under it fails"
        " RESOURCE_EXHAUSTED before it runs; None: only the machine's free memory (and"
        " RLIMIT_AS) bound it",
    )
    loss_fn_outputs: Literal["requested", "always"] = Field(
        "requested",
        description="when a forward-backward returns its per-sample loss_fn_outputs (logprobs):"
        " requested = only when the request sets return_loss_fn_outputs (api.md); always = on"
        " every forward-backward, for Tinker-style loops (tinker-cookbook) that read them"
        " without asking through the tinker shim",
    )

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory_limit_with_unit(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _ray_places_processes(self) -> EngineConfig:
        # A ConfigError, not a ValueError: pydantic passes it through, naming the field.
        processes = self.workers == "process" or self.generators == "process"
        if self.ray is not None and not processes and self.trainer_ranks == 1:
            raise ConfigError(
                "--ray places worker processes: give --workers process, --generators process"
                " or --trainer-ranks N",
                param="engine.ray",
            )
        return self


class SamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tokens: int = Field(100, ge=1, description="default sampling max_tokens (api.md 7.11)")
    temperature: float = Field(1.0, ge=0, description="default sampling temperature")
    num_samples: int = Field(1, ge=1, description="default num_samples")


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch: int = Field(
        8, ge=1, description="most forward-backward operations (of as many sessions) in one pass"
    )
    max_sample_rows: int = Field(
        256, ge=1, description="most sequences (prompts x num_samples) in one shared sample pass"
    )
    sample_gather_s: float = Field(
        0.5,
        ge=0,
        description="how long a sample pass waits at most for sample POSTs still being received",
    )


class LimitsConfig(BaseModel):
    """What one request may ask for, checked before anything runs (400 or 413 naming it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # The SDK offloads any operation body over 0.5 MiB to a payload upload (api.md 1.6), so
    # inline bodies stay small; other clients may send whole batches inline.
    max_body_mib: int = Field(
        64, ge=1, description="largest request body, except payload uploads (MiB)"
    )
    # The SDK refuses payloads over 4.995 GiB; 1 GiB holds a 256 x 32k-token batch with its
    # loss inputs as JSON several times over.
    max_payload_mib: int = Field(
        1024, ge=1, description="largest payload upload (PUT of a signed URL, MiB)"
    )
    max_sequences: int = Field(
        4096,
        ge=1,
        description="most sequences one sample operation generates (prompts x num_samples)",
    )
    max_operation_tokens: int = Field(
        1 << 21,
        ge=1,
        description="most tokens one operation processes: a forward-backward's sample tokens,"
        " or a sample operation's sequences x (prompt + max_tokens)",
    )


class RoutedExpertsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # An RL step samples, then trains on what it sampled within seconds to minutes; an hour
    # covers slow off-policy loops too. 256 MiB holds about 5,000 sequences of 1,000 tokens
    # on a 48-layer top-8 model (2 bytes per token, layer and expert slot).
    ttl_s: float = Field(
        3600.0, gt=0, description="how long a routed_experts_key stays usable after sampling"
    )
    memory_mib: int = Field(
        256,
        ge=0,
        description="memory for recorded expert routes, all sessions together; the least"
        " recently used keys are forgotten first when it is full",
    )


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one)")
    data_dir: Path = Field(Path("posttrain-data"), description="SQLite store and large files")
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="bearer API key -> user id (created_by of that caller's objects); empty"
        " accepts any non-empty key as `user_id` (single user)",
    )
    user_id: str = Field("user_local", description="the user of single-user mode and of --api-key")
    models: tuple[ModelSpec, ...] = Field(
        default_factory=builtin_model_specs, description="base models this server can train"
    )
    signing_key: str = Field(
        "",
        description="HMAC key for signed URLs; empty = a random key kept in data_dir/signing.key,"
        " so URLs survive restarts",
    )
    url_ttl_s: int = Field(3600, ge=1, description="lifetime of signed download/upload URLs")
    persist_every: int = Field(
        10,
        ge=1,
        description="a full-weight session's state is written every this many optimizer steps;"
        " the operations between are journaled and replayed after a crash (1: every step)",
    )
    min_inactive_timeout_s: int = Field(
        300,
        ge=1,
        description="smallest inactive_timeout a resource may ask for (api.md 1.2: 300); lower"
        " only for tests",
    )
    expiry_check_interval_s: float = Field(
        30.0, gt=0, description="how often idle model resources are checked for expiry"
    )
    # 10 s sits well under the SDK's shortest read timeout (60 s, api.md 2.6), so a held GET
    # never times out on the client; 0 answers every poll at once.
    poll_hold_seconds: float = Field(
        10.0,
        ge=0,
        le=50,
        description="how long an operation GET of a PENDING or RUNNING operation (or a sample"
        " POST sent beside others of its session) waits for it to finish before answering the"
        " current status; 0 turns holding off",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="engine settings")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="sample defaults")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="how queued operations share engine passes"
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="what one request may ask for"
    )
    routed_experts: RoutedExpertsConfig = Field(
        default_factory=RoutedExpertsConfig,
        description="the store of expert routes behind routed_experts_key (MoE routing replay)",
    )


def model_spec_from_path(path: str | Path) -> ModelSpec:
    """`--model PATH` adds a local HF directory, listed under its directory name."""
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise ConfigError(f"--model {path}: no config.json in that directory", param="models")
    return ModelSpec(id=directory.name, path=directory)


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


def build_config(
    *, api_key: str | None = None, keys_file: str | Path | None = None, **overrides: object
) -> ServerConfig:
    """ServerConfig from POSTTRAIN_* env (HOST, PORT, DATA_DIR, API_KEY, KEYS_FILE,
    MIN_INACTIVE_TIMEOUT_S, EXPIRY_CHECK_INTERVAL_S, POLL_HOLD_SECONDS, SIGNING_KEY,
    PERSIST_EVERY) and explicit
    arguments.

    Explicit arguments win; an invalid value raises ConfigError naming the field."""
    values: dict[str, object] = {}
    env_fields = {
        "HOST": "host",
        "PORT": "port",
        "DATA_DIR": "data_dir",
        "MIN_INACTIVE_TIMEOUT_S": "min_inactive_timeout_s",
        "EXPIRY_CHECK_INTERVAL_S": "expiry_check_interval_s",
        "POLL_HOLD_SECONDS": "poll_hold_seconds",
        "SIGNING_KEY": "signing_key",
        "PERSIST_EVERY": "persist_every",
    }
    for env_name, field_name in env_fields.items():
        if (value := os.environ.get(ENV_PREFIX + env_name)) is not None:
            values[field_name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    api_key = api_key or os.environ.get(ENV_PREFIX + "API_KEY") or None
    keys_file = keys_file or os.environ.get(ENV_PREFIX + "KEYS_FILE") or None
    if api_key or keys_file:
        user_id = str(values.get("user_id") or ServerConfig.model_fields["user_id"].default)
        values["api_keys"] = api_keys_from(api_key, keys_file, user_id)
    try:
        return ServerConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"config {field}: {first['msg']}", param=field) from exc
