"""Byte sizes as a person writes them (`8GiB`, `512M`): the one parser of every size setting.

Imports: nothing from posttrain.
"""

from __future__ import annotations

# Unit suffixes of a byte count (`--memory-limit 8GiB`): decimal KB..TB, binary KiB..TiB, and
# the one-letter K..T read as binary, as `free -h` and most tools print them.
BYTE_UNITS = {"B": 1} | {p + "B": 1000 ** (i + 1) for i, p in enumerate("KMGT")}
BYTE_UNITS |= {p + s: 1 << 10 * (i + 1) for i, p in enumerate("KMGT") for s in ("", "IB")}


def parse_bytes(text: str) -> int:
    """A byte count with a unit: `8GiB`, `8G` (= GiB), `512MiB`, `512M`, `1.5GB`, `4096B`.

    A bare number is refused: `--memory-limit 8` meant as gigabytes would otherwise be 8 bytes."""
    stripped = text.strip()
    number = stripped.rstrip("BbIiKkMmGgTt ")
    unit = stripped[len(number) :].strip().upper()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of bytes with a unit, e.g. 8GiB") from None
    if not unit:
        raise ValueError(
            f"{text!r} has no unit: give one, e.g. {number}GiB, {number}MiB or {number}B"
        )
    if unit not in BYTE_UNITS:
        raise ValueError(
            f"{text!r}: unknown unit {unit!r} (B, KiB/K, MiB/M, GiB/G, TiB/T, KB .. TB)"
        )
    return int(value * BYTE_UNITS[unit])
