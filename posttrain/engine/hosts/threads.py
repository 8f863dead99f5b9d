"""How many intra-op threads an engine process gives torch, decided once where the engine starts.

Why not torch's default (one thread per core): torch's CPU kernels run each operator as an
OpenMP parallel region whose threads meet at a barrier when it ends, so an operator takes as
long as its slowest thread. Beside another busy process, one of those threads shares its core
and runs at half speed or less, and every operator waits for it: on the 2-core machine a
busy neighbour made the demo's warm-up 5-10x slower, far more than the half of the machine it
took (docs/benchmarks.md, "Beside a busy process"). With fewer threads than cores, the kernel's
scheduler gives every thread a core of its own while the neighbours fit on the rest, so a
neighbour costs the process its share of the cores and not more.

The rule: half the cores this process may run on (`os.sched_getaffinity`), at least one,
split between the engine processes that share them (a trainer group's ranks). On 2 cores that
is one thread per process; on a GPU host the CPU threads only feed the device.

Why not follow the load (os.getloadavg) instead: the thread count is part of the numerics.
A CPU kernel's reduction order may depend on how many threads split it, so a count that
followed the load would let a busy neighbour change a run's losses. This count depends only
on the machine and the settings, so two runs with the same seed on the same machine compute
the same numbers, quiet or not. EngineConfig.threads overrides it (a measured choice for a
dedicated machine); OMP_NUM_THREADS does not, since it would be read before this applies.

Inter-op threads (torch.set_num_interop_threads) are left alone: the engine runs no
inter-op parallel work (no torch.jit.fork), and torch allows setting them only before the
first parallel op of the process.

Not here: which processes exist (engine/hosts/worker_process.py, trainer_group.py, replicas.py).
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a container's
    cpuset); os.cpu_count() where the platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def intra_op_threads(requested: int | None, *, processes: int = 1) -> int:
    """The intra-op thread count of one of `processes` engine processes sharing this
    machine's cores: `requested` when given, else half the usable cores split between them,
    at least one."""
    if requested is not None:
        return requested
    return max(1, usable_cores() // (2 * processes))


def use_intra_op_threads(requested: int | None, *, processes: int = 1) -> int:
    """Set this process's torch intra-op threads (see intra_op_threads); returns the count."""
    threads = intra_op_threads(requested, processes=processes)
    torch.set_num_threads(threads)
    return threads
