"""How an engine process uses the machine's cores: how many intra-op threads torch gets, and
how OpenMP's idle threads wait. Both are decided once, where the process starts.

The thread count: every core this process may run on (`os.sched_getaffinity`), split between
the engine processes that share them (a trainer group's ranks), at least one. That is torch's
own default and every peer's: a server owns its machine, and half the cores would halve its
throughput on a quiet one. One exception, decided from the models the process serves: when
every one of them is narrower than SMALL_HIDDEN, one thread. Their operators are too small to
repay waking a second thread for each of them (below). EngineConfig.threads overrides both;
OMP_NUM_THREADS does not, since it would be read before this applies.

The wait policy, and why all cores are safe beside a busy neighbour: torch's CPU kernels run
each operator as an OpenMP parallel region, and by default libgomp's idle threads spin for
300,000 rounds (about a millisecond or more) after a region before they sleep. Beside another
busy process one of the threads shares its core; spinning, it is never asleep, so the kernel's
scheduler gives it no wake-up preference over the neighbour and time-slices the two, and
every region waits milliseconds for it: the demo's steps ran 38-64x slower (docs/benchmarks.md,
"Beside a busy process"). A spinning idle server also takes the core from its own neighbours
(a client computing rewards beside it). With GOMP_SPINCOUNT=SPIN_ROUNDS idle threads spin a
few tens of microseconds, across the gaps between one pass's operators, and then sleep: a
thread that wakes into a region preempts the neighbour as a sleeper. Sleeping at once
(OMP_WAIT_POLICY=PASSIVE) pays a wake-up per region, on a virtual machine the wake of an idle
vCPU; measured on a 40M Qwen3 with 2 threads, SPIN_ROUNDS kept forward-backward at spinning's
speed (passive: 11% slower) and decode within 9% (passive: 26%), and beside a busy process
both ran 1.8x their quiet time, the neighbour's share of 2 cores (spinning: 2.4-2.9x).
The setting is read once, when libgomp loads with torch, so `bounded_openmp_spins` must run
before torch is imported (the `serve` command does); worker processes and Ray actors inherit
the environment. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.

Why not follow the load (os.getloadavg) instead of a fixed count: the thread count is part of
the numerics. A CPU kernel's reduction order may depend on how many threads split it, so a
count that followed the load would let a busy neighbour change a run's losses. This count
depends only on the machine and the settings, so two runs with the same seed on the same
machine compute the same numbers, quiet or not. The wait policy changes no number.

Inter-op threads (torch.set_num_interop_threads) are left alone: the engine runs no
inter-op parallel work (no torch.jit.fork), and torch allows setting them only before the
first parallel op of the process.

Not here: which processes exist (engine/hosts/process/worker.py, trainer_group.py, replicas.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

# The settings that say how libgomp's (torch's OpenMP runtime's) idle threads wait; a user who
# set any of them chose for themselves.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Rounds an idle OpenMP thread spins before it sleeps (the module docstring says why).
SPIN_ROUNDS = 1000

# Models whose hidden size is below this get one thread. Measured on the 2-core machine with
# waits that sleep (docs/benchmarks.md, "Beside a busy process"): the built-in model (hidden
# 128) ran the demo's warm-up 0.87x and GRPO steps 0.76x as fast on 2 threads as on 1 (0.93x
# and 0.80x with SPIN_ROUNDS), while a 40M Qwen3 (hidden 384) trained 1.5x as fast on 2.
SMALL_HIDDEN = 256


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a container's
    cpuset); os.cpu_count() where the platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def widest_hidden(model_dirs: Iterable[Path]) -> int | None:
    """The largest hidden size the models' config.json files give (a multimodal model's text
    config's); None when none gives one."""
    sizes = []
    for directory in model_dirs:
        try:
            config = json.loads((Path(directory) / "config.json").read_text())
        except (OSError, ValueError):
            continue
        config = config.get("text_config") or config
        if isinstance(config.get("hidden_size"), int):
            sizes.append(config["hidden_size"])
    return max(sizes, default=None)


def intra_op_threads(
    requested: int | None, *, processes: int = 1, model_dirs: Iterable[Path] = ()
) -> int:
    """The intra-op thread count of one of `processes` engine processes sharing this
    machine's cores and serving the models in `model_dirs`: `requested` when given, one when
    every model is narrower than SMALL_HIDDEN, else the usable cores split between the
    processes, at least one."""
    if requested is not None:
        return requested
    hidden = widest_hidden(model_dirs)
    if hidden is not None and hidden < SMALL_HIDDEN:
        return 1
    return max(1, usable_cores() // processes)


def use_intra_op_threads(
    requested: int | None, *, processes: int = 1, model_dirs: Iterable[Path] = ()
) -> int:
    """Set this process's torch intra-op threads (see intra_op_threads); returns the count."""
    import torch

    threads = intra_op_threads(requested, processes=processes, model_dirs=model_dirs)
    torch.set_num_threads(threads)
    log.debug(
        "torch intra-op threads %d (usable cores %d), OpenMP wait policy %s",
        threads,
        usable_cores(),
        openmp_wait_policy(),
    )
    return threads


def _waits_chosen() -> bool:
    """Whether the environment already says how OpenMP's idle threads wait (the user's choice)."""
    return any(name in os.environ for name in WAIT_SETTINGS)


def bounded_openmp_spins() -> bool:
    """Make OpenMP's idle threads sleep after SPIN_ROUNDS rounds of spinning (the module
    docstring says why), unless the user set a wait setting. True when it will apply: torch is
    not imported yet, so libgomp reads it when it loads."""
    if _waits_chosen():
        return False
    if "torch" in sys.modules:
        log.debug("torch already imported: OpenMP's wait policy stays as it loaded")
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return True


def openmp_wait_policy() -> str:
    """How this process's OpenMP threads wait, as its environment set it: `passive`,
    `spin N` (a user's GOMP_SPINCOUNT) or `active` (libgomp's default spinning)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    if "GOMP_SPINCOUNT" in os.environ:
        return f"spin {os.environ['GOMP_SPINCOUNT']}"
    return "active"


def server_wait_policy() -> str:
    """The wait policy a `posttrain serve` started with this process's environment computes
    with (its own bounded spins unless a wait setting is set); for benchmarks to state."""
    if _waits_chosen():
        return openmp_wait_policy()
    return f"spin {SPIN_ROUNDS}"
