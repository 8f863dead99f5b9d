"""Charts described as data (Figure, Panel, Series) and drawn straight to PNG with zlib and
struct: no plotting dependency.

The demo's plot needs a few line and point charts with titles, axis titles and tick labels,
nothing more. Drawing them on an RGB pixel buffer with a built-in 5x7 bitmap font keeps the
`examples` extra free of matplotlib (and its compiled dependencies), works offline, and writes
the same bytes for the same numbers. Lower-case letters render as capitals. The Figure is
what a test inspects (panel order, axis titles, x ranges, which series are points); `render`
is the only code that knows pixels.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
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

    def text_up(self, x: int, y: int, text: str, color: Color = BLACK) -> None:
        """Text turned 90 degrees counter-clockwise, read bottom to top, starting at (x, y)
        (its baseline runs up the column x + GLYPH_H)."""
        for index, char in enumerate(text.upper()):
            rows = FONT.get(char, FONT["?"])
            bottom = y - index * (GLYPH_W + 1)
            for row, bits in enumerate(rows):
                for col in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - col)):
                        self.dot(x + row, bottom - col, color)

    def disc(self, cx: float, cy: float, radius: int, color: Color) -> None:
        x0, y0 = round(cx), round(cy)
        for dy in range(-radius, radius + 1):
            for dx in range(-radius, radius + 1):
                if dx * dx + dy * dy <= radius * radius + radius:
                    self.dot(x0 + dx, y0 + dy, color)

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
    power: float = 10 ** math.floor(math.log10(raw))  # an int from 1 up, a float below
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
    """One data series. `is_points` draws a marker per value and no connecting line (a value
    measured a few times, not a trend); `point_labels`, one per point, are written above them."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: Color
    is_points: bool = False
    point_labels: Sequence[str] = ()


def nice_range(values: Sequence[float]) -> tuple[float, float]:
    """A y-range with a little headroom; a flat series gets a unit-wide band."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    if math.isclose(low, high):
        return low - 0.5, high + 0.5
    pad = 0.05 * (high - low)
    return low - pad, high + pad


@dataclass(frozen=True)
class Panel:
    """One chart: title, axis titles, series. `x_ticks` names positions (categories such as
    checkpoints); without it the x axis counts steps and labels whole numbers."""

    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    y_range: tuple[float, float] | None = None
    x_ticks: Sequence[tuple[float, str]] = ()

    def x_limits(self) -> tuple[float, float]:
        if self.x_ticks:
            positions = [x for x, _ in self.x_ticks]
            return min(positions) - 0.5, max(positions) + 0.5
        xs = [x for s in self.series for x in s.xs]
        if not xs:
            return 0.0, 1.0
        low, high = min(xs), max(xs)
        return (low - 1, high + 1) if low == high else (low, high)

    def y_limits(self) -> tuple[float, float]:
        return self.y_range or nice_range([y for s in self.series for y in s.ys])


@dataclass(frozen=True)
class Figure:
    """Panels in rows, read left to right then top to bottom, under a title and a subtitle."""

    title: str
    subtitle: str
    rows: Sequence[Sequence[Panel]]
    width: int
    height: int

    @property
    def panels(self) -> list[Panel]:
        return [panel for row in self.rows for panel in row]


# Margins inside a panel's box, in pixels: room for the y-axis title and tick labels on the
# left, the x tick labels and x-axis title below.
PLOT_LEFT, PLOT_RIGHT, PLOT_BOTTOM = 78, 14, 40
HEADER_H = 62
MIN_TICK_GAP = 28


def render(figure: Figure) -> bytes:
    """The figure as PNG bytes."""
    canvas = Canvas(figure.width, figure.height)
    canvas.text(20, 12, figure.title, scale=2)
    canvas.text(20, 36, figure.subtitle, BLACK)
    row_h = (figure.height - HEADER_H) // len(figure.rows)
    for r, row in enumerate(figure.rows):
        col_w = figure.width // len(row)
        top = HEADER_H + r * row_h
        for c, panel in enumerate(row):
            draw_panel(canvas, (c * col_w + 10, top, (c + 1) * col_w - 10, top + row_h - 12), panel)
    return canvas.png()


def draw_legend(canvas: Canvas, left: int, top: int, right: int, series: Sequence[Series]) -> int:
    """Legend entries, wrapped to the box; returns the y below the last line."""
    x, y = left, top
    for s in series:
        width = 20 + text_width(s.label) + 22
        if x + width > right and x > left:
            x, y = left, y + 12
        if s.is_points:
            canvas.disc(x + 7, y + 3, 3, s.color)
        else:
            canvas.fill(x, y + 2, x + 14, y + 5, s.color)
        canvas.text(x + 20, y, s.label, BLACK)
        x += width
    return y + 12


def step_ticks(x_low: float, x_high: float, to_px: Callable[[float], float]) -> list[float]:
    """Whole-number ticks including the first step, none closer than MIN_TICK_GAP pixels."""
    values, _ = ticks(x_low, x_high, num_ticks=6)
    candidates = sorted({round(v) for v in values if math.isclose(v, round(v))})
    if math.isclose(x_low, round(x_low)):
        candidates = [round(x_low), *(v for v in candidates if v != round(x_low))]
    kept: list[float] = []
    for value in candidates:
        if all(abs(to_px(value) - to_px(k)) >= MIN_TICK_GAP for k in kept):
            kept.append(value)
    return kept


def draw_panel(canvas: Canvas, box: tuple[int, int, int, int], panel: Panel) -> None:
    """Title, legend, grid, ticks, axis titles and series of one panel in box (l, t, r, b)."""
    left, top, right, bottom = box
    canvas.text(left, top, panel.title, BLACK, scale=2)
    plot_left, plot_right, plot_bottom = left + PLOT_LEFT, right - PLOT_RIGHT, bottom - PLOT_BOTTOM
    plot_top = draw_legend(canvas, plot_left, top + 22, right, panel.series) + 8
    x_low, x_high = panel.x_limits()
    y_low, y_high = panel.y_limits()

    def px(x: float) -> float:
        return plot_left + (x - x_low) / (x_high - x_low) * (plot_right - plot_left)

    def py(y: float) -> float:
        return plot_bottom - (y - y_low) / (y_high - y_low) * (plot_bottom - plot_top)

    y_ticks, decimals = ticks(y_low, y_high, num_ticks=5)
    for value in y_ticks:
        canvas.line(plot_left, py(value), plot_right, py(value), GRID)
        label = format_tick(value, decimals)
        canvas.text(plot_left - 8 - text_width(label), round(py(value)) - 3, label, AXIS)
    x_ticks = panel.x_ticks or [(v, format_tick(v, 0)) for v in step_ticks(x_low, x_high, px)]
    for value, label in x_ticks:
        canvas.line(px(value), plot_bottom, px(value), plot_bottom + 4, AXIS)
        canvas.text(round(px(value)) - text_width(label) // 2, plot_bottom + 8, label, AXIS)
    canvas.line(plot_left, plot_top, plot_left, plot_bottom, AXIS)
    canvas.line(plot_left, plot_bottom, plot_right, plot_bottom, AXIS)
    middle = (plot_left + plot_right) // 2
    canvas.text(middle - text_width(panel.x_label) // 2, plot_bottom + 24, panel.x_label, BLACK)
    y_middle = (plot_top + plot_bottom) // 2
    canvas.text_up(left, y_middle + text_width(panel.y_label) // 2, panel.y_label, BLACK)
    if not any(s.xs for s in panel.series):
        canvas.text(plot_left + 20, plot_top + 20, "no data", AXIS, scale=2)
    for s in panel.series:
        pixels = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=True)]
        if not s.is_points:
            for (ax, ay), (bx, by) in zip(pixels, pixels[1:], strict=False):
                canvas.line(ax, ay, bx, by, s.color, width=2)
            continue
        for index, (x, y) in enumerate(pixels):
            canvas.disc(x, y, 5, s.color)
            if index < len(s.point_labels):
                label = s.point_labels[index]
                label_y = round(y) - 26 if y - 26 > plot_top else round(y) + 12
                canvas.text(round(x) - text_width(label, 2) // 2, label_y, label, s.color, scale=2)
