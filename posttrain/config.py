"""The ServerConfig tree: built once at start-up (config_sources.py), then passed down.

Every field has a default or is required, and a description, which is also the help of its
`posttrain serve` flag: a field is a flag when its `json_schema_extra` is `flag(...)` (its help
group, and where it differs from the rule: its name, hidden, an environment variable). Each
setting is declared here once; config_sources.py turns the declarations into flags, reads the
environment and builds the tree. Imports: config_flags, errors, units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from posttrain.config_flags import flag
from posttrain.errors import ConfigError
from posttrain.units import parse_bytes

# The built-in models, shipped as package data (built by scripts/build_tiny_model.py): id ->
# directory. Every server offers all of them; BUILTIN_MODEL_ID (the dense one) is the default
# of the demo, the examples and the tests.
BUILTIN_MODELS: dict[str, Path] = {
    f"posttrain/{name}": Path(__file__).parent / "model" / "builtin" / name
    for name in ("tiny-qwen3", "tiny-qwen3-moe")
}
BUILTIN_MODEL_ID = "posttrain/tiny-qwen3"
BUILTIN_MODEL_DIR = BUILTIN_MODELS[BUILTIN_MODEL_ID]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(description="base_model id clients pass to model-resources create")
    path: Path = Field(description="local Hugging Face causal-LM directory")


def builtin_model_specs() -> tuple[ModelSpec, ...]:
    """One ModelSpec per built-in model, the default first."""
    return tuple(ModelSpec(id=model_id, path=path) for model_id, path in BUILTIN_MODELS.items())


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    device: str = Field(
        "auto",
        description="torch device: auto (cuda when present, else cpu), cpu, cuda or cuda:N",
        json_schema_extra=flag("basics"),
    )
    # Why all the cores, and why that is safe beside a busy neighbour: engine/hosts/threads.py.
    threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of each engine process; by default every core the"
        " process may use, split between a trainer group's ranks, or one when every model it"
        " serves is narrower than hidden size 256 (idle OpenMP threads sleep after a short"
        " spin, so a busy neighbour costs its share); the count, fixed per machine and models,"
        " keeps runs reproducible",
        json_schema_extra=flag("performance", env=True, metavar="N", default="all the cores"),
    )
    # Measured (bench/process_boundary.py, docs/benchmarks.md): the pipe costs ~0.5 ms a call,
    # noise to every operation but a publish; a worker process costs a start (seconds) and its
    # own libraries. Threads stay the default. The process: engine/hosts/process/worker.py.
    workers: Literal["thread", "process"] = Field(
        "thread",
        description="where each model resource's engine runs: a thread of the server, or a"
        " worker process of its own (a crash or out-of-memory there fails that resource's"
        " operations, not the server, and its sessions are restored)",
        json_schema_extra=flag("scale-out"),
    )
    # Measured (bench/scale_out.py, docs/benchmarks.md): a replica costs a start (seconds), a
    # model copy and a pickled publish per weights-sync; it pays where samples are long while
    # others train, inline is faster on the built-in model. Replicas:
    # engine/hosts/replicas/engine.py.
    generators: Literal["inline", "process", "vllm"] = Field(
        "inline",
        description="where each model resource's generators run: inline, on the trainer's"
        " model (a sample waits for the trainer and the trainer for it), or as"
        " compute_config.num_generator_replicas processes (or vLLM servers) beside it",
        json_schema_extra=flag("scale-out"),
    )
    vllm_python: Path | None = Field(  # vLLM's own venv (engine/hosts/vllm/engine.py)
        None,
        description="the python of a venv with vLLM that runs --generators vllm replicas",
        json_schema_extra=flag("scale-out", env="POSTTRAIN_VLLM_PYTHON", metavar="PATH"),
    )
    vllm_mismatch_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of vLLM samples whose tokens the trainer scores (|logprob diff|)",
        json_schema_extra=flag("scale-out", metavar="P"),
    )
    # Measured (bench/scale_out.py): on one CPU host both move an adapter alike; a broadcast
    # sends each bucket once for all replicas and crosses machines (--ray): weights_broadcast.py.
    weights_transport: Literal["broadcast", "pipe"] = Field(
        "broadcast",
        description="how a weights-sync reaches --generators process replicas: a"
        " torch.distributed (gloo) broadcast in 64 MiB buckets to all replicas at once (each"
        " replica's pipe when the group cannot form), or down each replica's pipe",
        json_schema_extra=flag("scale-out"),
    )
    # On: on an H200 (docs/benchmarks.md) graphs ran 5.95x the dynamic blocks on the RL shape,
    # 3.01x on a 16-token generation, captures included (a failed capture runs eagerly).
    cuda_graphs: bool = Field(
        True,
        description="on CUDA, decode in static-shape passes captured in CUDA graphs and"
        " replayed; off: dynamic passes in blocks of 8, one host read per block. No effect on"
        " other devices",
        json_schema_extra=flag("performance"),
    )
    # Placement: engine/hosts/ray/placement.py.
    ray: str | None = Field(
        None,
        min_length=1,
        description="place each model resource's processes (its --workers process engine,"
        " its --trainer-ranks, its --generators process replicas) as Ray actors in a placement"
        " group of its own: 'local' starts a Ray instance on this machine, anything else is the"
        " address of a Ray cluster to join (needs pip install 'posttrain[ray]')",
        json_schema_extra=flag(
            "scale-out", metavar="local|ADDRESS", default="off: local processes"
        ),
    )
    ray_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description="how a resource's placement group lays out its processes on the Ray"
        " cluster's nodes: PACK (as few nodes as possible) or SPREAD (across nodes)",
        json_schema_extra=flag("scale-out"),
    )
    # Data parallel (engine/hosts/ranks/trainer_group.py): each rank forwards its share of a batch's
    # rows; a LoRA resource's frozen base is replicated, a full-weight session is sharded with
    # FSDP2 (engine/parallel/fsdp.py). Measured (bench/trainer_ranks.py, docs/benchmarks.md):
    # on the 2-core CPU two ranks are slower than one (10-15 ms more per small command), so
    # one process is the default.
    trainer_ranks: int = Field(
        1,
        ge=1,
        description="processes each model resource's trainer runs on: 1 (in the engine of"
        " --workers) or a torch.distributed group of N rank processes that split each"
        " forward-backward's rows and all-reduce its gradients (at most the CPU cores, or the"
        " CUDA devices)",
        json_schema_extra=flag("scale-out", metavar="N"),
    )
    # FSDP2's reshard_after_forward for the decoder layers of a full-weight session on
    # trainer_ranks > 1 (engine/parallel/fsdp.py). Between operations every rank holds 1/N of
    # every parameter, gradient and optimizer moment either way; on (the default) a layer is
    # gathered for its forward and again for its backward, off keeps it gathered in between
    # (one all-gather per layer and bucket fewer, every layer's weights held at the peak).
    shard_parameters: bool = Field(
        True,
        description="with --trainer-ranks N > 1, free a full-weight session's gathered layer"
        " weights after each forward and gather them again for the backward (on: the least"
        " memory; off: one all-gather fewer per layer, every layer's weights at the peak);"
        " between operations each rank holds 1/N of the weights and optimizer state either"
        " way",
        json_schema_extra=flag("scale-out"),
    )
    max_generator_replicas: int = Field(
        8,
        ge=1,
        description="the most compute_config.num_generator_replicas a model resource may ask for",
        json_schema_extra=flag("scale-out", metavar="N"),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="base weights' dtype: auto = bfloat16 on CUDA, float32 on CPU; float32 on"
        " CUDA makes sampler and trainer logprobs agree to float32 rounding",
        json_schema_extra=flag("models"),
    )
    max_lora_rank: int = Field(64, ge=1, description="largest LoRA rank a client may request")
    max_batch_size: int = Field(256, ge=1, description="most samples in one forward-backward")
    # The model's context by default (model/context_length.py): a sample the model can
    # position is one the server trains on, unless a smaller number is given.
    max_seq_length: int | None = Field(
        None,
        ge=2,
        description="most tokens in one training sample (its model input and last target),"
        " at most the model's context: max_position_embeddings, or the length its rope"
        " scaling extends it to; a sample over it is refused with a 400",
        json_schema_extra=flag(
            "limits and auth",
            env="POSTTRAIN_MAX_SEQ_LENGTH",
            metavar="N",
            default="the model's context",
        ),
    )
    # Checkpointed (engine/train/layer_checkpoint.py), a forward-backward keeps each decoder
    # layer's input instead of its activations, about 25x less per layer and token on
    # Qwen3-like widths (memory/estimate.py), and runs every layer's forward again in the
    # backward: a third more compute, so auto keeps it for passes that need it.
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="keep only each decoder layer's input for the backward of a"
        " forward-backward and recompute the layer's activations there (same results, less"
        " memory, more time); auto: only in a pass whose estimated peak without it does not"
        " fit the free memory (--memory-limit), and admission counts the checkpointed peak",
        json_schema_extra=flag("performance"),
    )
    max_sessions_per_resource: int = Field(
        8,
        ge=1,
        description="concurrent LoRA sessions one model resource hosts (Tinker samplers"
        " included: the least recently used gives its slot up)",
        json_schema_extra=flag("limits and auth", metavar="N"),
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="tokens per chunk of the float32 log-softmax (bounds memory)"
    )
    # Measured on a 2-core CPU (38M-parameter Qwen3, bench/forward_backward.py): one more forward
    # costs 10-35 tokens of work, and 256 pads that script's 64..1024 batch by 6% (32: by 1%).
    # On a GPU (estimated, not measured yet) the fixed cost is a forward's hundreds of kernel
    # launches, some milliseconds: a few hundred tokens of a 0.2B model at the 43k tokens/s of
    # docs/benchmarks.md. 256 suits the GPU, where serving runs, and costs the CPU little.
    # The grouping: engine/train/buckets.py.
    bucket_overhead_tokens: int = Field(
        256,
        ge=0,
        description="fixed cost of one model forward, in tokens of work: a training batch's rows"
        " are grouped by length into forwards that minimise padded tokens plus this per forward;"
        " 0 gives one forward per distinct length, a huge value one padded forward for the"
        " whole batch",
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
        description="memory the server (on CUDA: torch's allocations on the device) may use,"
        " with a unit: 8GiB or 8G, 512MiB or 512M, 1.5GB (a bare number is refused). An"
        " operation whose estimated peak does not fit fails RESOURCE_EXHAUSTED before it runs",
        json_schema_extra=flag(
            "limits and auth", metavar="SIZE", default="none: only the free memory"
        ),
    )
    loss_fn_outputs: Literal["requested", "always"] = Field(
        "requested",
        description="when a forward-backward returns its per-sample logprobs (loss_fn_outputs):"
        " requested = only when the request sets return_loss_fn_outputs; always = on every"
        " forward-backward, for Tinker-style loops (tinker-cookbook) that read them without"
        " asking",
        json_schema_extra=flag("models"),
    )

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _memory_limit_with_unit(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _checks(self) -> EngineConfig:
        # A ConfigError, not a ValueError: pydantic passes it through, naming the field.
        processes = self.workers == "process" or self.generators == "process"
        if self.ray is not None and not processes and self.trainer_ranks == 1:
            raise ConfigError(
                "--ray places worker processes: give --workers process, --generators process"
                " or --trainer-ranks N",
                param="engine.ray",
            )
        if self.generators == "vllm" and self.vllm_python is None:
            message = "--generators vllm needs --vllm-python PATH (scripts/build_vllm_env.sh)"
            raise ConfigError(message, param="engine.vllm_python")
        return self


class SamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tokens: int = Field(100, ge=1, description="default sampling max_tokens")
    temperature: float = Field(1.0, ge=0, description="default sampling temperature")
    num_samples: int = Field(1, ge=1, description="default num_samples")


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch: int = Field(
        8, ge=1, description="most forward-backward operations (of as many sessions) in one pass"
    )
    max_sample_rows: int = Field(
        256,
        ge=1,
        description="most sequences (prompts x num_samples) a shared sample pass starts with",
        json_schema_extra=flag("performance", metavar="N"),
    )
    stream_join_rows: int | None = Field(
        None,
        ge=0,
        description="sequences beyond --max-sample-rows a running sample pass takes for joining"
        " operations, so a small late one starts within a block or two (0: none)",
        json_schema_extra=flag("performance", metavar="N", default="--max-sample-rows / 8"),
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
        64,
        ge=1,
        description="largest request body in MiB, payload uploads aside; larger ones get a 413",
        json_schema_extra=flag("limits and auth", metavar="MIB"),
    )
    # The SDK refuses payloads over 4.995 GiB; 1 GiB holds a 256 x 32k-token batch with its
    # loss inputs as JSON several times over.
    max_payload_mib: int = Field(
        1024,
        ge=1,
        description="largest payload upload in MiB (the SDK's offload of large operation bodies)",
        json_schema_extra=flag("limits and auth", metavar="MIB"),
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
    # Decoding is bounded before the processor runs: 16 MP is above any VL model's own
    # resize cap (Qwen3-VL's default longest edge is 16.7 MP) and well under PIL's bomb limit.
    max_image_pixels: int = Field(
        1 << 24,
        ge=1,
        description="most pixels (width x height) of one image chunk; larger images get a 400",
        json_schema_extra=flag("limits and auth", metavar="PIXELS"),
    )


class RoutedExpertsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # An RL step samples, then trains on what it sampled within seconds to minutes; an hour
    # covers slow off-policy loops too. 256 MiB holds about 5,000 sequences of 1,000 tokens
    # on a 48-layer top-8 model (2 bytes per token, layer and expert slot).
    ttl_s: float = Field(
        3600.0,
        gt=0,
        description="seconds a routed_experts_key (MoE routing replay) stays usable after sampling",
        json_schema_extra=flag("limits and auth", name="--routed-experts-ttl-s", metavar="S"),
    )
    memory_mib: int = Field(
        256,
        ge=0,
        description="memory in MiB for recorded expert routes, all sessions together; the least"
        " recently used keys are forgotten first when it is full",
        json_schema_extra=flag("limits and auth", name="--routed-experts-mib", metavar="MIB"),
    )


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str = Field(
        "127.0.0.1", description="address to listen on", json_schema_extra=flag("basics", env=True)
    )
    port: int = Field(
        8000,
        ge=0,
        le=65535,
        description="TCP port; 0 picks a free one",
        json_schema_extra=flag("basics", env=True),
    )
    data_dir: Path = Field(
        Path("posttrain-data"),
        description="where the server keeps its database, checkpoints and uploads",
        json_schema_extra=flag("basics", env=True, metavar="DIR"),
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="least severe log lines shown; debug adds one per engine pass and tracebacks",
        json_schema_extra=flag("basics"),
    )
    access_log: bool = Field(
        False,
        description="log every HTTP request, and the web server's own start and stop lines",
        json_schema_extra=flag("basics", switch=True),
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="bearer API key -> user id (created_by of that caller's objects); empty"
        " accepts any non-empty key as `user_id` (single user)",
    )
    user_id: str = Field("user_local", description="the user of single-user mode and of --api-key")
    # Without a key anyone who reaches the port trains and samples here (api/deps.py): fine
    # on loopback, an accident beyond it unless asked for by name.
    insecure_no_auth: bool = Field(
        False,
        description="with a --host beyond loopback, serve without an API key: anyone who"
        " reaches the port may train and sample on this machine",
        json_schema_extra=flag("limits and auth", env=True, switch=True),
    )
    models: tuple[ModelSpec, ...] = Field(
        default_factory=builtin_model_specs,
        description="add a Hugging Face Hub id ORG/NAME[@REV] (from the HF cache, HF_HOME;"
        " downloaded if not cached, unless HF_HUB_OFFLINE=1), served as base_model ORG/NAME, or a"
        " causal-LM directory, served as <directory name>; NAME=PATH serves it as NAME (a hub name"
        " such as Qwen/Qwen3-8B), NAME=posttrain/tiny-qwen3 a built-in model (repeatable)",
        json_schema_extra=flag(
            "models",
            name="--model",
            metavar="ORG/NAME|[NAME=]PATH",
            default="none: the built-in models only",
        ),
    )
    signing_key: str = Field(
        "",
        description="HMAC key of signed download and upload URLs",
        json_schema_extra=flag(
            "limits and auth",
            env=True,
            metavar="KEY",
            default="a random key kept in the data directory, so URLs survive restarts",
        ),
    )
    url_ttl_s: int = Field(3600, ge=1, description="lifetime of signed download/upload URLs")
    persist_every: int = Field(
        10,
        ge=1,
        description="write a full-weight session's state every N optimizer steps; the"
        " operations between are journaled and replayed after a crash (1: every step)",
        json_schema_extra=flag("performance", env=True, metavar="N"),
    )
    # The API's minimum is 300 s; tests lower it to expire resources within seconds.
    min_inactive_timeout_s: int = Field(
        300,
        ge=1,
        description="smallest inactive_timeout a resource may ask for; lower only for tests",
        json_schema_extra=flag("limits and auth", env=True, hidden=True),
    )
    expiry_check_interval_s: float = Field(
        30.0,
        gt=0,
        description="how often idle model resources are checked for expiry",
        json_schema_extra=flag("limits and auth", env=True, hidden=True),
    )
    # 10 s sits well under the SDK's shortest read timeout (60 s, api.md 2.6), so a held GET
    # never times out on the client; 0 answers every poll at once.
    poll_hold_seconds: float = Field(
        10.0,
        ge=0,
        le=50,
        description="an operation GET, or a sample POST sent beside others of its session,"
        " waits up to S seconds for a pending or running operation to finish before answering"
        " its current status (at most 50; 0 answers at once)",
        json_schema_extra=flag("performance", env=True, metavar="S"),
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
