"""What the demo leaves behind: the PNG plot, summary.json, and the closing printout."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.demo.loop import DemoResult
from posttrain.demo.plot import BLUE, GREEN, ORANGE, PURPLE, RED, Canvas, Series, line_chart

PLOT_WIDTH, PLOT_HEIGHT = 1000, 680


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def render_plot(result: DemoResult) -> bytes:
    """Four panels: RL reward (with held-out accuracy), RL loss, KL, warm-up loss."""
    warmup = [r for r in result.steps if r.phase == "warmup"]
    rl = [r for r in result.steps if r.phase == "rl"]
    canvas = Canvas(PLOT_WIDTH, PLOT_HEIGHT)
    headline = (
        f"posttrain demo: held-out accuracy {100 * result.accuracy_base:.1f}% (base) -> "
        f"{100 * result.accuracy_warmup:.1f}% (warm-up) -> {100 * result.accuracy_rl:.1f}% (RL)"
    )
    canvas.text(20, 14, headline, scale=2)
    half_w, top, half_h = PLOT_WIDTH // 2, 50, (PLOT_HEIGHT - 50) // 2
    rl_x = [r.step for r in rl]
    rewards = [r.reward or 0.0 for r in rl]
    accuracy_x = [rl_x[0] - 1, rl_x[-1]] if rl_x else []
    line_chart(
        canvas,
        (10, top, half_w - 10, top + half_h - 10),
        "reward per RL step",
        [
            Series("mean reward", rl_x, rewards, BLUE),
            Series("avg of 5", rl_x, moving_average(rewards, 5), ORANGE),
            Series(
                "held-out acc",
                accuracy_x,
                [result.accuracy_warmup, result.accuracy_rl][: len(accuracy_x)],
                GREEN,
                is_points=True,
            ),
        ],
        y_range=(0.0, max([0.1, *rewards, result.accuracy_rl]) * 1.1),
    )
    line_chart(
        canvas,
        (half_w + 10, top, PLOT_WIDTH - 10, top + half_h - 10),
        "GRPO loss per RL step",
        [Series("loss (about 0 on-policy: advantages sum to 0)", rl_x, [r.loss for r in rl], RED)],
    )
    line_chart(
        canvas,
        (10, top + half_h, half_w - 10, PLOT_HEIGHT - 10),
        "warm-up loss per answer token",
        [Series("cross-entropy", [r.step for r in warmup], [r.loss for r in warmup], BLUE)],
    )
    kl = [(r.step, r.kl) for r in rl if r.kl is not None]
    line_chart(
        canvas,
        (half_w + 10, top + half_h, PLOT_WIDTH - 10, PLOT_HEIGHT - 10),
        "KL to warm-up policy per RL step",
        [Series("kl (k3)", [s for s, _ in kl], [k for _, k in kl], PURPLE)],
    )
    return canvas.png()


def write_outputs(result: DemoResult, out_dir: Path) -> dict[str, Path]:
    """Write demo.png and summary.json next to steps.jsonl; return every output path."""
    paths = {
        "plot": out_dir / "demo.png",
        "summary": out_dir / "summary.json",
        "steps": out_dir / "steps.jsonl",
    }
    paths["plot"].write_bytes(render_plot(result))
    paths["summary"].write_text(json.dumps(result.summary(), indent=2) + "\n")
    return paths


def closing_text(result: DemoResult, paths: dict[str, Path]) -> str:
    gain = 100 * (result.accuracy_rl - result.accuracy_warmup)
    lines = [
        "",
        f"held-out accuracy (greedy, {result.config.num_heldout} unseen problems):",
        f"  base model        {100 * result.accuracy_base:5.1f}%",
        f"  after warm-up     {100 * result.accuracy_warmup:5.1f}%",
        f"  after GRPO        {100 * result.accuracy_rl:5.1f}%   ({gain:+.1f} points from RL)",
        f"finished in {result.seconds:.0f}s",
        "examples after RL: "
        + ", ".join(f"{e['prompt']}{e['completion']}" for e in result.examples[:6]),
        f"plot      {paths['plot']}",
        f"step log  {paths['steps']}",
        f"summary   {paths['summary']}",
    ]
    return "\n".join(lines)
