"""Line charts written straight to PNG with zlib and struct: no plotting dependency.

The demo's plot needs a few line charts with titles and tick labels, nothing more. Drawing them
on an RGB pixel buffer with a built-in 5x7 bitmap font keeps the `examples` extra free of
matplotlib (and its compiled dependencies), works offline, and writes the same bytes for the
same numbers. Lower-case letters render as capitals.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (30, 30, 30)
GRID: Color = (225, 225, 225)
AXIS: Color = (120, 120, 120)
BLUE: Color = (31, 119, 180)
ORANGE: Color = (230, 120, 20)
GREEN: Color = (44, 160, 44)
RED: Color = (214, 39, 40)
PURPLE: Color = (148, 103, 189)

# 5x7 glyphs, one 5-bit row per entry, most significant bit on the left.
FONT: dict[str, tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E),
    "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F),
    "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02),
    "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E),
    "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E),
    "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11),
    "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E),
    "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F),
    "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F),
    "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11),
    "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11),
    "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D),
    "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E),
    "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A),
    "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04),
    "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    " ": (0, 0, 0, 0, 0, 0, 0),
    ".": (0, 0, 0, 0, 0, 0x0C, 0x0C),
    ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0),
    "-": (0, 0, 0, 0x1F, 0, 0, 0),
    "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0),
    "=": (0, 0, 0x1F, 0, 0x1F, 0, 0),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "/": (0, 0x01, 0x02, 0x04, 0x08, 0x10, 0),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08),
    "<": (0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02),
    "_": (0, 0, 0, 0, 0, 0, 0x1F),
    "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04),
}
GLYPH_W, GLYPH_H = 5, 7


class Canvas:
    """An RGB pixel buffer with the few drawing operations a line chart needs."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = 3 * (y * self.width + x)
            self.pixels[offset : offset + 3] = bytes(color)

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(y0, 0), min(y1, self.height)):
            for x in range(max(x0, 0), min(x1, self.width)):
                self.dot(x, y, color)

    def line(
        self, x0: float, y0: float, x1: float, y1: float, color: Color, *, width: int = 1
    ) -> None:
        """A straight segment, `width` pixels thick (a square brush along a DDA walk)."""
        steps = max(int(max(abs(x1 - x0), abs(y1 - y0))), 1)
        low, high = -((width - 1) // 2), width // 2
        for i in range(steps + 1):
            x = round(x0 + (x1 - x0) * i / steps)
            y = round(y0 + (y1 - y0) * i / steps)
            for dy in range(low, high + 1):
                for dx in range(low, high + 1):
                    self.dot(x + dx, y + dy, color)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, *, scale: int = 1) -> None:
        for index, char in enumerate(text.upper()):
            rows = FONT.get(char, FONT["?"])
            left = x + index * (GLYPH_W + 1) * scale
            for row, bits in enumerate(rows):
                for col in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - col)):
                        self.fill(
                            left + col * scale,
                            y + row * scale,
                            left + (col + 1) * scale,
                            y + (row + 1) * scale,
                            color,
                        )

    def png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))


def text_width(text: str, scale: int = 1) -> int:
    return len(text) * (GLYPH_W + 1) * scale - scale


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """A truecolour 8-bit PNG (RFC 2083): signature, IHDR, one zlib IDAT, IEND."""
    assert len(rgb) == 3 * width * height, "rgb must hold width * height pixels"

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    stride = 3 * width
    # Filter type 0 (None) on every scanline.
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def nice_step(span: float, num_ticks: int = 4) -> float:
    """The 1, 2 or 5 times a power of ten closest above span / num_ticks."""
    raw = span / num_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * 0.999)


def ticks(low: float, high: float, num_ticks: int = 4) -> tuple[list[float], int]:
    """Round tick values covering [low, high] and the decimals their labels need."""
    step = nice_step(high - low, num_ticks)
    first = math.ceil(low / step - 1e-9)
    values = [k * step for k in range(first, math.floor(high / step + 1e-9) + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return values, decimals


def format_tick(value: float, decimals: int) -> str:
    return f"{value:.{decimals}f}" if abs(value) > 10 ** -(decimals + 1) else "0"


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: Color
    is_points: bool = False


def nice_range(values: Sequence[float]) -> tuple[float, float]:
    """A y-range with a little headroom; a flat series gets a unit-wide band."""
    low, high = min(values), max(values)
    if math.isclose(low, high):
        return low - 0.5, high + 0.5
    pad = 0.05 * (high - low)
    return low - pad, high + pad


def line_chart(
    canvas: Canvas,
    box: tuple[int, int, int, int],
    title: str,
    series: Sequence[Series],
    *,
    y_range: tuple[float, float] | None = None,
) -> None:
    """Draw `series` into box = (left, top, right, bottom): title, grid, ticks, lines, legend."""
    left, top, right, bottom = box
    canvas.text(left, top, title, BLACK, scale=2)
    plot_left, plot_top, plot_right, plot_bottom = left + 64, top + 40, right - 10, bottom - 28
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True)]
    if not points:
        canvas.text(plot_left, plot_top + 20, "no data", AXIS, scale=2)
        return
    x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
    if x_low == x_high:
        x_low, x_high = x_low - 1, x_high + 1
    y_low, y_high = y_range or nice_range([p[1] for p in points])

    def to_px(x: float, y: float) -> tuple[float, float]:
        px = plot_left + (x - x_low) / (x_high - x_low) * (plot_right - plot_left)
        py = plot_bottom - (y - y_low) / (y_high - y_low) * (plot_bottom - plot_top)
        return px, py

    y_ticks, decimals = ticks(y_low, y_high, num_ticks=5)
    for value in y_ticks:
        _, py = to_px(x_low, value)
        canvas.line(plot_left, py, plot_right, py, GRID)
        label = format_tick(value, decimals)
        canvas.text(plot_left - 8 - text_width(label), round(py) - 3, label, AXIS)
    x_ticks, _ = ticks(x_low, x_high, num_ticks=6)
    for value in x_ticks:
        if not math.isclose(value, round(value)):
            continue  # x is a step number: label whole steps only
        px, _ = to_px(value, y_low)
        label = format_tick(value, 0)
        canvas.text(round(px) - text_width(label) // 2, plot_bottom + 8, label, AXIS)
    canvas.line(plot_left, plot_top, plot_left, plot_bottom, AXIS)
    canvas.line(plot_left, plot_bottom, plot_right, plot_bottom, AXIS)
    for s in series:
        pixels = [to_px(x, y) for x, y in zip(s.xs, s.ys, strict=True)]
        if s.is_points:
            for px, py in pixels:
                canvas.fill(round(px) - 4, round(py) - 4, round(px) + 5, round(py) + 5, s.color)
        for (ax, ay), (bx, by) in zip(pixels, pixels[1:], strict=False):
            canvas.line(ax, ay, bx, by, s.color, width=1 if s.is_points else 2)
    legend_x = plot_left
    for s in series:
        canvas.fill(legend_x, top + 24, legend_x + 14, top + 30, s.color)
        canvas.text(legend_x + 20, top + 24, s.label, BLACK)
        legend_x += 20 + text_width(s.label) + 24
