"""The `posttrain` command: flags and env -> ServerConfig, then serve create_app(config);
`posttrain demo` runs the demo client (posttrain/demo/).

Imports: config, api.app, demo.command, model.loader (the start-up check of --model dirs).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TypeVar

from posttrain.config import (
    EngineConfig,
    LimitsConfig,
    RoutedExpertsConfig,
    build_config,
    builtin_model_specs,
    model_spec_from_path,
    parse_bytes,
)
from posttrain.demo.command import add_demo_arguments, run_demo_command
from posttrain.errors import ConfigError

C = TypeVar("C")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the /v1/rl API")
    serve.add_argument("--host", default=None, help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="TCP port (8000)")
    serve.add_argument("--data-dir", type=Path, default=None, help="store directory")
    serve.add_argument(
        "--api-key", default=None, help="accept this bearer key, for user user_local"
    )
    serve.add_argument(
        "--keys-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="accept the keys in PATH, one `KEY USER_ID` pair per line (# comments)",
    )
    # Development and test knobs, hidden from --help: a test server expires resources after
    # seconds instead of api.md's 300 s minimum.
    serve.add_argument("--min-inactive-timeout-s", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument(
        "--expiry-check-interval-s", type=float, default=None, help=argparse.SUPPRESS
    )
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH",
        help="add a local Hugging Face causal-LM directory (repeatable)",
    )
    serve.add_argument("--device", default=None, help="auto, cpu or cuda")
    serve.add_argument(
        "--workers",
        choices=("thread", "process"),
        default=None,
        help="run each model resource's engine in a thread (default) or a worker process",
    )
    serve.add_argument(
        "--generators",
        choices=("inline", "process"),
        default=None,
        help="run each model resource's generators inline on its trainer (default) or as"
        " compute_config.num_generator_replicas processes sampling beside it",
    )
    serve.add_argument(
        "--weights-transport",
        choices=("broadcast", "pipe"),
        default=None,
        help="how weights-syncs reach --generators process replicas: a torch.distributed"
        " broadcast (default) or each replica's pipe",
    )
    serve.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        default=None,
        help="on CUDA, replay decode passes from captured CUDA graphs (default off: dynamic"
        " passes in blocks of 8 with one host read per block)",
    )
    serve.add_argument(
        "--ray",
        default=None,
        metavar="local|ADDRESS",
        help="place each model resource's worker processes as Ray actors, one placement group"
        " per resource: on a Ray instance started here (local) or on the cluster at ADDRESS"
        " (pip install 'posttrain[ray]')",
    )
    serve.add_argument(
        "--ray-strategy",
        choices=("PACK", "SPREAD"),
        default=None,
        help="a resource's placement group: PACK its processes on few nodes (default) or"
        " SPREAD them across nodes",
    )
    serve.add_argument(
        "--trainer-ranks",
        type=int,
        default=None,
        metavar="N",
        help="run each model resource's trainer on a group of N rank processes that split"
        " every forward-backward (1: in the engine of --workers; at most the CPU cores, or"
        " the CUDA devices)",
    )
    serve.add_argument(
        "--shard-parameters",
        choices=("on", "off"),
        default=None,
        help="with --trainer-ranks N > 1, shard a full-weight session's parameters over the"
        " ranks too (on, the default: ZeRO-3, each rank holds 1/N of the weights, gradients"
        " and optimizer state, and rank 0 alone the generator's copy) or replicate them (off:"
        " ZeRO-2, gradients and optimizer state sharded)",
    )
    serve.add_argument(
        "--max-generator-replicas",
        type=int,
        default=None,
        metavar="N",
        help="the most generator replicas a model resource may ask for (8)",
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="base weights' dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    serve.add_argument(
        "--memory-limit",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="memory the server may use, with a unit (8GiB): operations whose estimated peak"
        " does not fit fail RESOURCE_EXHAUSTED before they run (default: free memory only)",
    )
    serve.add_argument(
        "--loss-fn-outputs",
        choices=("requested", "always"),
        default=None,
        help="return forward-backward's per-sample logprobs only when requested (default, as"
        " api.md says) or always (tinker-cookbook loops read them without asking)",
    )
    serve.add_argument(
        "--poll-hold-seconds",
        type=float,
        default=None,
        metavar="S",
        help="an operation GET, or a sample POST sent beside others of its session, waits up"
        " to S seconds for a pending or running operation to finish before answering (10; 0"
        " answers at once)",
    )
    serve.add_argument(
        "--routed-experts-ttl-s",
        type=float,
        default=None,
        metavar="S",
        help="how long a routed_experts_key (MoE routing replay) stays usable (3600)",
    )
    serve.add_argument(
        "--routed-experts-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="memory for recorded expert routes; least recently used keys go first (256)",
    )
    serve.add_argument(
        "--signing-key",
        default=None,
        help="HMAC key of signed URLs (or POSTTRAIN_SIGNING_KEY; default: a random key kept in"
        " the data directory, so URLs survive restarts)",
    )
    serve.add_argument(
        "--max-body-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="largest request body, payload uploads aside (64); larger ones get a 413",
    )
    serve.add_argument(
        "--max-payload-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="largest payload upload, the SDK's offload of large operation bodies (1024)",
    )
    serve.add_argument(
        "--persist-every",
        type=int,
        default=None,
        metavar="N",
        help="write a full-weight session's state every N optimizer steps, journaling the"
        " operations between (10; 1: every step)",
    )
    serve.add_argument("--log-level", default="info", help="uvicorn/posttrain log level")
    demo = commands.add_parser(
        "demo", help="warm up then GRPO-train a built-in model on addition; plot the reward"
    )
    add_demo_arguments(demo)
    return root


def given_config(cls: type[C], **flags: object) -> C | None:
    """`cls` from the flags that were given, or None (its defaults) when none was."""
    given = {key: value for key, value in flags.items() if value is not None}
    return cls(**given) if given else None


def engine_config(args: argparse.Namespace) -> EngineConfig | None:
    """The engine flags given, or None for the engine defaults."""
    return given_config(
        EngineConfig,
        device=args.device,
        dtype=args.dtype,
        loss_fn_outputs=args.loss_fn_outputs,
        workers=args.workers,
        generators=args.generators,
        weights_transport=args.weights_transport,
        cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs == "on",
        ray=args.ray,
        ray_strategy=args.ray_strategy,
        trainer_ranks=args.trainer_ranks,
        shard_parameters=None if args.shard_parameters is None else args.shard_parameters == "on",
        max_generator_replicas=args.max_generator_replicas,
        memory_limit=args.memory_limit,
    )


def serve(args: argparse.Namespace) -> None:
    from posttrain.api.listen import listening_socket

    user_models = [model_spec_from_path(path) for path in args.model]
    config = build_config(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        api_key=args.api_key,
        keys_file=args.keys_file,
        min_inactive_timeout_s=args.min_inactive_timeout_s,
        expiry_check_interval_s=args.expiry_check_interval_s,
        poll_hold_seconds=args.poll_hold_seconds,
        signing_key=args.signing_key,
        persist_every=args.persist_every,
        models=(*builtin_model_specs(), *user_models),
        engine=engine_config(args),
        routed_experts=given_config(
            RoutedExpertsConfig,
            ttl_s=args.routed_experts_ttl_s,
            memory_mib=args.routed_experts_mib,
        ),
        limits=given_config(
            LimitsConfig, max_body_mib=args.max_body_mib, max_payload_mib=args.max_payload_mib
        ),
    )
    # Listening before torch is imported: clients that retry across a restart queue instead of
    # being refused (api/listen.py).
    try:
        sock = listening_socket(config.host, config.port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port}: {exc}", param="port"
        ) from exc

    from posttrain.api.app import create_app
    from posttrain.api.server import serve as run_server
    from posttrain.engine.hosts.trainer_group import check_trainer_ranks
    from posttrain.model.loader import servable_problem

    # The built-ins are known to be servable; only the user's directories are checked.
    for spec in user_models:
        problem = servable_problem(spec.path)
        if problem is not None:
            raise ConfigError(f"--model {spec.path}: {problem}", param="models")
    check_trainer_ranks(config.engine)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    run_server(create_app(config), sock=sock, log_level=args.log_level)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            serve(args)
        elif args.command == "demo":
            run_demo_command(args)
    except ConfigError as exc:
        print(f"posttrain: {exc.message}", file=sys.stderr)
        sys.exit(2)
