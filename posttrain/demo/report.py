"""What the demo leaves behind: the PNG plot, summary.json, and the closing printout."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields
from pathlib import Path

from posttrain.demo.loop import DemoConfig, DemoResult, StepRecord
from posttrain.demo.plot import (
    BLUE,
    GREEN,
    ORANGE,
    PURPLE,
    Color,
    Figure,
    Panel,
    Series,
    render,
)
from posttrain.demo.task import HeldoutExample

PLOT_WIDTH, PLOT_HEIGHT = 1000, 680
LIGHT_BLUE: Color = (158, 196, 228)
LIGHT_PURPLE: Color = (206, 188, 226)
WARMUP_WINDOW, RL_WINDOW = 10, 5


def moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def share_axis_top(values: list[float]) -> float:
    """The top of a 0-based axis of shares: the next tenth above the largest value plus a
    fifth, at most 1, so a reward that stays low still shows its trend."""
    top = max(values, default=0.0) * 1.2
    return min(1.0, max(0.1, math.ceil(round(top * 10, 6)) / 10))


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def demo_figure(result: DemoResult) -> Figure:
    """Four panels in time order: the warm-up's loss, GRPO's reward and KL, then the held-out
    accuracy at its three checkpoints. Each phase numbers its steps from 1, as its loop does.

    The GRPO loss is not charted: with group-centred advantages it sums to about 0 on-policy
    whatever the policy learns, so its curve is noise; the KL from the warm-up policy says how
    far GRPO moved."""
    warmup = [r for r in result.steps if r.phase == "warmup"]
    rl = [r for r in result.steps if r.phase == "rl"]
    warmup_x = list(range(1, len(warmup) + 1))
    rl_x = list(range(1, len(rl) + 1))
    losses = [r.loss for r in warmup]
    rewards = [r.reward or 0.0 for r in rl]
    kl = [(x, r.kl) for x, r in zip(rl_x, rl, strict=True) if r.kl is not None]
    accuracies = [result.accuracy_base, result.accuracy_warmup, result.accuracy_rl]
    config = result.config
    warmup_panel = Panel(
        "Warm-up: cross-entropy loss",
        "warm-up step",
        "loss per answer token",
        [
            Series("loss", warmup_x, losses, LIGHT_BLUE),
            Series(
                f"{WARMUP_WINDOW}-step average",
                warmup_x,
                moving_average(losses, WARMUP_WINDOW),
                BLUE,
            ),
        ],
    )
    reward_panel = Panel(
        "GRPO: reward",
        "GRPO step",
        "mean reward (share correct)",
        [
            Series(
                f"reward ({config.group_size} samples x {config.prompts_per_step} prompts)",
                rl_x,
                rewards,
                LIGHT_BLUE,
            ),
            Series(f"{RL_WINDOW}-step average", rl_x, moving_average(rewards, RL_WINDOW), ORANGE),
        ],
        y_range=(0.0, share_axis_top(rewards)),
    )
    kl_panel = Panel(
        "GRPO: KL from the warm-up policy",
        "GRPO step",
        "KL per token (k3)",
        [
            Series("KL", [x for x, _ in kl], [k for _, k in kl], LIGHT_PURPLE),
            Series(
                f"{RL_WINDOW}-step average",
                [x for x, _ in kl],
                moving_average([k for _, k in kl], RL_WINDOW),
                PURPLE,
            ),
        ],
    )
    accuracy_panel = Panel(
        "Held-out accuracy",
        f"checkpoint (greedy, {config.num_heldout} unseen problems)",
        "accuracy (%)",
        [
            Series(
                "exact answers",
                [0, 1, 2],
                [100 * a for a in accuracies],
                GREEN,
                is_points=True,
                point_labels=[percent(a) for a in accuracies],
            ),
        ],
        y_range=(0.0, 100.0),
        x_ticks=((0, "base"), (1, "after warm-up"), (2, "after GRPO")),
    )
    return Figure(
        title=f"posttrain demo: {config.base_model} learns two-digit addition",
        subtitle=(
            f"{len(warmup)} warm-up steps, then {len(rl)} GRPO steps. held-out accuracy "
            f"{percent(result.accuracy_base)} (base) -> {percent(result.accuracy_warmup)} "
            f"(warm-up) -> {percent(result.accuracy_rl)} (GRPO). seed {config.seed}"
        ),
        rows=[[warmup_panel, reward_panel], [kl_panel, accuracy_panel]],
        width=PLOT_WIDTH,
        height=PLOT_HEIGHT,
    )


def render_plot(result: DemoResult) -> bytes:
    return render(demo_figure(result))


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


def marked_example(example: HeldoutExample) -> str:
    """`12+34=46`, or `12+34=47 ✗ (46)` for a wrong answer, with the expected sum."""
    shown = f"{example['prompt']}{example['completion']}"
    return shown if example["correct"] else f"{shown} ✗ ({example['expected']})"


def closing_text(result: DemoResult, paths: dict[str, Path]) -> str:
    gain = 100 * (result.accuracy_rl - result.accuracy_warmup)
    lines = [
        "",
        f"held-out accuracy (greedy, {result.config.num_heldout} unseen problems):",
        f"  base model        {100 * result.accuracy_base:5.1f}%",
        f"  after warm-up     {100 * result.accuracy_warmup:5.1f}%",
        f"  after GRPO        {100 * result.accuracy_rl:5.1f}%   ({gain:+.1f} points from RL)",
        f"finished in {result.seconds:.0f}s",
        "examples after RL (✗: wrong, the right sum in brackets): "
        + ", ".join(marked_example(e) for e in result.examples[:6]),
        f"plot      {paths['plot']}",
        f"step log  {paths['steps']}",
        f"summary   {paths['summary']}",
    ]
    return "\n".join(lines)


def load_result(out_dir: Path) -> DemoResult:
    """The DemoResult a finished run left in out_dir (steps.jsonl, summary.json), so the plot
    can be drawn again without training. Fields a newer or older run wrote and this code does
    not know are ignored; missing ones take their defaults."""
    summary = json.loads((out_dir / "summary.json").read_text())
    config_fields = {f.name for f in fields(DemoConfig)}
    config = DemoConfig(**{k: v for k, v in summary["config"].items() if k in config_fields})
    step_fields = {f.name for f in fields(StepRecord)}
    steps = [
        StepRecord(**{k: v for k, v in json.loads(line).items() if k in step_fields})
        for line in (out_dir / "steps.jsonl").read_text().splitlines()
        if line.strip()
    ]
    accuracy = summary["heldout_accuracy"]
    return DemoResult(
        config=config,
        accuracy_base=accuracy["base"],
        accuracy_warmup=accuracy["after_warmup"],
        accuracy_rl=accuracy["after_rl"],
        steps=steps,
        seconds=summary.get("seconds", 0.0),
        examples=summary.get("examples", []),
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m posttrain.demo.report DIR`: redraw DIR/demo.png from DIR's logs."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir", type=Path, help="a demo's --out folder")
    args = parser.parse_args(argv)
    path = args.out_dir / "demo.png"
    path.write_bytes(render_plot(load_result(args.out_dir)))
    print(path)


if __name__ == "__main__":
    main()
