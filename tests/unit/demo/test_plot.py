"""The demo's plot: a Figure whose panels read in time order with titled axes, steps numbered
per phase from 1 and accuracy as labelled points; and the hand-written PNG it renders to, a valid
file whose pixels are what was drawn."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from posttrain.demo.loop import DemoConfig, DemoResult, StepLog, StepRecord
from posttrain.demo.plot import FONT, GLYPH_H, GLYPH_W, Canvas, encode_png, step_ticks, ticks
from posttrain.demo.report import (
    PLOT_HEIGHT,
    PLOT_WIDTH,
    closing_text,
    demo_figure,
    load_result,
    main,
    marked_example,
    render_plot,
    share_axis_top,
    write_outputs,
)
from posttrain.demo.task import HeldoutExample, Problem, judged


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


def test_text_up_turns_glyphs_a_quarter_counter_clockwise():
    canvas = Canvas(20, 20)
    canvas.text_up(3, 15, "7", (0, 0, 255))
    _, _, rgb = decode_png(canvas.png())
    for row, bits in enumerate(FONT["7"]):
        for col in range(GLYPH_W):
            x, y = 3 + row, 15 - col
            lit = rgb[3 * (y * 20 + x) : 3 * (y * 20 + x) + 3] == bytes((0, 0, 255))
            assert lit == bool(bits & (1 << (GLYPH_W - 1 - col))), (row, col)


def test_step_ticks_label_the_first_step_and_round_ones_apart():
    def to_px(x: float) -> float:
        return 400 * (x - 1) / (210 - 1)

    assert step_ticks(1, 210, to_px) == [1, 50, 100, 150, 200]
    # 90 steps over 400 px: 1 and 20 are 84 px apart; steps 1..3 label every step.
    assert step_ticks(1, 90, lambda x: 400 * (x - 1) / 89) == [1, 20, 40, 60, 80]
    assert step_ticks(1, 3, lambda x: 200 * (x - 1) / 2) == [1, 2, 3]


NUM_WARMUP, NUM_RL = 6, 5


RIGHT = HeldoutExample(prompt="12+34=", completion="46", expected="46", correct=True)
WRONG = HeldoutExample(prompt="7+8=", completion="16", expected="15", correct=False)


def demo_result() -> DemoResult:
    """A run as loop.py logs it: warm-up steps 1..6, then GRPO steps counted on (7..11)."""
    steps = [StepRecord("warmup", i + 1, 1.0 - 0.01 * i, 0.1, 10, 100.0) for i in range(NUM_WARMUP)]
    steps += [
        StepRecord("rl", NUM_WARMUP + 1 + i, 0.001 * i, 0.1, 10, 100.0, reward=0.1 * i, kl=0.01 * i)
        for i in range(NUM_RL)
    ]
    examples = [RIGHT, WRONG]
    return DemoResult(DemoConfig(num_heldout=50), 0.01, 0.1, 0.4, steps, 12.0, examples)


def test_panels_run_in_time_order_with_titled_axes():
    figure = demo_figure(demo_result())
    titles = [p.title for p in figure.panels]
    assert titles == [
        "Warm-up: cross-entropy loss",
        "GRPO: reward",
        "GRPO: KL from the warm-up policy",
        "Held-out accuracy",
    ]
    assert [p.x_label for p in figure.panels] == [
        "warm-up step",
        "GRPO step",
        "GRPO step",
        "checkpoint (greedy, 50 unseen problems)",
    ]
    assert [p.y_label for p in figure.panels] == [
        "loss per answer token",
        "mean reward (share correct)",
        "KL per token (k3)",
        "accuracy (%)",
    ]
    assert "1.0% (base) -> 10.0% (warm-up) -> 40.0% (GRPO)" in figure.subtitle


def test_each_phase_numbers_its_steps_from_one():
    warmup, reward, kl, _ = demo_figure(demo_result()).panels
    assert warmup.x_limits() == (1, NUM_WARMUP)
    assert list(warmup.series[0].xs) == list(range(1, NUM_WARMUP + 1))
    assert warmup.series[0].ys == pytest.approx([1.0 - 0.01 * i for i in range(NUM_WARMUP)])
    # The log counts GRPO steps on from the warm-up (7..11); the plot counts them from 1.
    for panel in (reward, kl):
        assert panel.x_limits() == (1, NUM_RL)
        assert list(panel.series[0].xs) == list(range(1, NUM_RL + 1))
    assert reward.series[0].ys == pytest.approx([0.1 * i for i in range(NUM_RL)])
    assert reward.y_limits() == (0.0, 0.5)  # rewards up to 0.4: the axis stops at 0.5
    assert kl.series[0].ys == pytest.approx([0.01 * i for i in range(NUM_RL)])


def test_heldout_accuracy_is_three_labelled_points_and_no_grpo_loss_is_charted():
    figure = demo_figure(demo_result())
    accuracy = figure.panels[-1]
    (points,) = accuracy.series
    assert points.is_points
    assert list(points.ys) == pytest.approx([1.0, 10.0, 40.0])
    assert list(points.point_labels) == ["1.0%", "10.0%", "40.0%"]
    assert [label for _, label in accuracy.x_ticks] == ["base", "after warm-up", "after GRPO"]
    assert accuracy.y_limits() == (0.0, 100.0)
    # Every other series is a line, and none is the GRPO loss (about 0: noise).
    lines = [s for p in figure.panels[:-1] for s in p.series]
    assert not any(s.is_points for s in lines)
    rl_losses = [0.001 * i for i in range(NUM_RL)]
    assert all(list(s.ys) != pytest.approx(rl_losses) for s in lines)


def test_demo_plot_renders_at_its_size():
    width, height, rgb = decode_png(render_plot(demo_result()))
    assert (width, height) == (PLOT_WIDTH, PLOT_HEIGHT)
    assert len(set(rgb[i : i + 3] for i in range(0, len(rgb), 3))) > 5  # not blank


def test_the_reward_axis_starts_at_zero_and_tops_out_above_the_data():
    assert share_axis_top([0.06, 0.09]) == 0.2
    assert share_axis_top([0.3, 0.75]) == 0.9
    assert share_axis_top([0.9, 1.0]) == 1.0
    assert share_axis_top([0.0]) == 0.1


def test_wrong_examples_are_marked_with_the_right_sum():
    assert marked_example(RIGHT) == "12+34=46"
    assert marked_example(WRONG) == "7+8=16 ✗ (15)"
    # The reward judges, not the text: the right digits without the end of text are wrong.
    assert marked_example(judged(Problem(7, 8), "15\n", stopped=False)) == "7+8=15 ✗ (15)"
    assert marked_example(judged(Problem(7, 8), "15\n", stopped=True)) == "7+8=15"


def test_summary_json_marks_the_wrong_examples_as_the_console_does(tmp_path: Path):
    result = demo_result()
    paths = write_outputs(result, tmp_path)
    examples = json.loads(paths["summary"].read_text())["examples"]
    assert [e["correct"] for e in examples] == [True, False]
    assert [e["expected"] for e in examples] == ["46", "15"]
    console = closing_text(result, paths)
    for example in examples:
        marked = f"{example['prompt']}{example['completion']}"
        assert (marked + " ✗" in console) is not example["correct"], console


def test_the_plot_redraws_from_a_runs_files(tmp_path: Path, capsys):
    result = demo_result()
    log = StepLog(tmp_path / "steps.jsonl")
    for record in result.steps:
        log.add(record)
    paths = write_outputs(result, tmp_path)
    loaded = load_result(tmp_path)
    assert loaded.steps == result.steps
    assert loaded.config == result.config and loaded.examples == result.examples
    assert (loaded.accuracy_base, loaded.accuracy_warmup, loaded.accuracy_rl) == (0.01, 0.1, 0.4)
    drawn = paths["plot"].read_bytes()
    paths["plot"].unlink()
    main([str(tmp_path)])
    assert paths["plot"].read_bytes() == drawn
    assert capsys.readouterr().out.strip() == str(paths["plot"])
