"""The demo's hand-written PNG: a valid file whose pixels are what was drawn."""

from __future__ import annotations

import struct
import zlib

from posttrain.demo.loop import DemoConfig, DemoResult, StepRecord
from posttrain.demo.plot import FONT, GLYPH_H, GLYPH_W, Canvas, encode_png, ticks
from posttrain.demo.report import PLOT_HEIGHT, PLOT_WIDTH, render_plot


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, rgb) of a truecolour PNG with filter 0 rows: an independent reader."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, chunks = 8, {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        offset += 12 + length
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 3 * width
    rows = [raw[y * (stride + 1) : (y + 1) * (stride + 1)] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, b"".join(row[1:] for row in rows)


def test_png_round_trips_every_pixel():
    rgb = bytes((7 * i) % 256 for i in range(3 * 7 * 5))
    assert decode_png(encode_png(7, 5, rgb)) == (7, 5, rgb)


def test_canvas_draws_lines_and_glyphs_where_asked():
    canvas = Canvas(40, 20)
    canvas.line(0, 0, 39, 0, (255, 0, 0))
    canvas.text(2, 5, "7", (0, 0, 255))
    _, _, rgb = decode_png(canvas.png())

    def pixel(x: int, y: int) -> tuple[int, ...]:
        return tuple(rgb[3 * (y * 40 + x) : 3 * (y * 40 + x) + 3])

    assert all(pixel(x, 0) == (255, 0, 0) for x in range(40))
    for row, bits in enumerate(FONT["7"]):
        for col in range(GLYPH_W):
            expected = (0, 0, 255) if bits & (1 << (GLYPH_W - 1 - col)) else (255, 255, 255)
            assert pixel(2 + col, 5 + row) == expected
    assert pixel(2, 5 + GLYPH_H) == (255, 255, 255)


def test_ticks_are_round_numbers_covering_the_range():
    values, decimals = ticks(0.013, 0.47)  # span/4 = 0.114 -> step 0.2
    assert [round(v, 9) for v in values] == [0.2, 0.4] and decimals == 1
    values, decimals = ticks(-3.0, 250.0)  # span/4 = 63 -> step 100
    assert [round(v, 9) for v in values] == [0, 100, 200] and decimals == 0
    values, decimals = ticks(0.0, 0.004)  # step 0.001
    assert len(values) == 5 and decimals == 3


def test_demo_plot_has_the_expected_size():
    steps = [StepRecord("warmup", i + 1, 1.0 - 0.01 * i, 0.1, 10, 100.0) for i in range(5)]
    steps += [
        StepRecord("rl", 6 + i, 0.001 * i, 0.1, 10, 100.0, reward=0.1 * i, kl=0.01 * i)
        for i in range(5)
    ]
    result = DemoResult(DemoConfig(), 0.01, 0.1, 0.4, steps, 12.0)
    width, height, rgb = decode_png(render_plot(result))
    assert (width, height) == (PLOT_WIDTH, PLOT_HEIGHT)
    assert len(set(rgb[i : i + 3] for i in range(0, len(rgb), 3))) > 5  # not blank
