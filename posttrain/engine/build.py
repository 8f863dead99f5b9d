"""The one module that names concrete engines and hosts: it turns the engine config into the
Engine (engine/interface.py) the service runs on.

`--trainer-ranks N` (N > 1) gives a TrainerGroupEngine (any `--workers`), `--workers process` a
ProcessEngine, and otherwise the in-process LocalEngine; `--generators process` wraps it in a
ReplicatedEngine, `--generators vllm` in a VllmEngine (vLLM server processes, always local).
Every other process they start goes through one Placement: Ray actors with `--ray` (Ray is
imported then, and only then), else child processes of this one.

Imports: config, errors, engine.interface, engine.hosts; engine.hosts.ray_placement (and Ray)
only with `--ray`.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config import EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.placement import Placement
from posttrain.engine.hosts.process.local_placement import LocalPlacement
from posttrain.engine.hosts.process.remote import ProcessEngine
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.hosts.replicas.engine import ReplicatedEngine
from posttrain.engine.hosts.threads import intra_op_threads, openmp_wait_policy
from posttrain.engine.hosts.vllm.engine import VllmEngine
from posttrain.engine.interface import Engine
from posttrain.errors import ConfigError


def build_engine(config: EngineConfig, model_paths: dict[str, Path]) -> Engine:
    """The engine the config asks for, over the models at `model_paths` (id -> directory)."""
    placement = placement_for(config, model_paths)  # Ray only with --ray
    engine: Engine
    if config.trainer_ranks > 1:
        engine = TrainerGroupEngine(config, model_paths, placement)  # any --workers
    elif config.workers == "process":
        engine = ProcessEngine(config, model_paths, placement)
    else:
        engine = LocalEngine(config, model_paths)
    if config.generators == "process":
        engine = ReplicatedEngine(engine, config, model_paths, placement)
    elif config.generators == "vllm":
        engine = VllmEngine(engine, config, model_paths)  # vLLM servers, always local
    return engine


def cpu_threads(config: EngineConfig, model_paths: dict[str, Path]) -> tuple[int, str]:
    """The torch intra-op threads each engine process computes with (a trainer group's ranks
    split the cores) and how their idle OpenMP threads wait (engine/hosts/threads.py)."""
    threads = intra_op_threads(
        config.threads, processes=config.trainer_ranks, model_dirs=model_paths.values()
    )
    return threads, openmp_wait_policy()


def placement_for(config: EngineConfig, model_paths: dict[str, Path]) -> Placement:
    """`--ray` given: a RayPlacement (Ray imported now, and only then); else the local one."""
    if config.ray is None:
        return LocalPlacement(config, model_paths)
    try:
        from posttrain.engine.hosts.ray.placement import RayPlacement  # the optional extra
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ConfigError(
            "--ray needs Ray: pip install 'posttrain[ray]'", param="engine.ray"
        ) from None
    return RayPlacement(config, model_paths)
