"""What memory an operation may still allocate: the tightest of the bounds that apply.

On the CPU: the system's MemAvailable (/proc/meminfo), the process's address-space headroom
under RLIMIT_AS when one is set (the limit less the process's VmSize: an allocation fails once
the address space would pass the limit, whatever of it is resident), and `memory_limit` less
the process's resident set. On CUDA: what the device has free plus what torch's caching
allocator holds unused, and `memory_limit` less what torch has allocated on it.

Not here: what an operation needs (estimate.py), the refusal (service/scheduling/admission.py).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from posttrain.engine.interface import Headroom


def headroom(device: torch.device, memory_limit: int | None) -> Headroom:
    """The tightest bound on what an operation may allocate now."""
    bounds = _cuda_bounds(device) if device.type == "cuda" else _host_bounds()
    if memory_limit is not None:
        used = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes()
        bounds.append(Headroom(max(0, memory_limit - used), f"memory_limit {memory_limit}"))
    return min(bounds, key=lambda h: h.free_bytes)


def _host_bounds() -> list[Headroom]:
    bounds = [Headroom(_mem_available(), "MemAvailable")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(Headroom(max(0, soft - _vm_size()), f"RLIMIT_AS {soft}"))
    return bounds


def _cuda_bounds(device: torch.device) -> list[Headroom]:
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return [Headroom(free + cached, f"free memory of {torch.cuda.get_device_name(device)}")]


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the file's unit is kB
    raise AssertionError("/proc/meminfo has no MemAvailable line")


def _statm_bytes(field: int) -> int:
    """A field of /proc/self/statm (0: VmSize, 1: resident), in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[field])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _vm_size() -> int:
    return _statm_bytes(0)


def _rss_bytes() -> int:
    return _statm_bytes(1)
