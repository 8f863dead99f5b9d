"""What is free (engine/memory/headroom.py): the tightest of MemAvailable, RLIMIT_AS headroom and
memory_limit, each checked in a subprocess whose limits the test sets."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

GIB = 1 << 30

PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    import torch
    from posttrain.engine.memory.headroom import headroom
    limit = {address_space}
    if limit:
        vm = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + limit, vm + limit))
    room = headroom(torch.device("cpu"), {memory_limit})
    print(json.dumps({{"free": room.free_bytes, "bound": room.bound}}))
    """
)


def probe(*, address_space: int = 0, memory_limit: int | None = None) -> dict:
    script = PROBE.format(address_space=address_space, memory_limit=memory_limit)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_limits_the_bound_is_the_systems_available_memory():
    room = probe()
    assert room["bound"] == "MemAvailable"
    assert room["free"] > 0


def test_an_address_space_limit_bounds_what_is_free_by_its_headroom():
    room = probe(address_space=GIB // 4)
    assert room["bound"].startswith("RLIMIT_AS")
    # The limit was set at VmSize + 256 MiB; reading the bound itself maps a little more.
    assert GIB // 4 - (64 << 20) <= room["free"] <= GIB // 4


@pytest.mark.parametrize("limit", [GIB, 2 * GIB])
def test_a_memory_limit_bounds_what_is_free_by_itself_less_the_resident_set(limit):
    room = probe(memory_limit=limit)
    assert room["bound"] == f"memory_limit {limit}"
    # A torch process holds a few hundred MiB resident.
    assert limit - GIB < room["free"] < limit
