"""`posttrain demo` flags -> DemoConfig: `--model` picks a built-in base model."""

from __future__ import annotations

import io
from dataclasses import replace

from posttrain.cli import parser
from posttrain.config import BUILTIN_MODEL_ID
from posttrain.demo.command import ProgressBar, demo_config
from posttrain.demo.loop import QUICK, StepRecord

MOE_MODEL = "posttrain/tiny-qwen3-moe"


def test_model_flag_sets_the_demo_base_model():
    args = parser().parse_args(["demo", "--quick", "--model", MOE_MODEL])
    assert demo_config(args) == replace(QUICK, base_model=MOE_MODEL)


def test_the_demo_trains_the_dense_built_in_by_default():
    assert demo_config(parser().parse_args(["demo"])).base_model == BUILTIN_MODEL_ID


def test_progress_into_a_pipe_is_one_line_per_step_without_carriage_returns():
    stream = io.StringIO()  # not a terminal, as a pipe or a file
    progress = ProgressBar(3, stream)
    progress(StepRecord("warmup", 1, 1.25, 0.1, 10, 100.0), 3)
    progress(StepRecord("rl", 2, 0.01, 0.1, 10, 100.0, reward=0.5, kl=0.02), 3)
    progress(StepRecord("rl", 3, 0.02, 0.1, 10, 100.0, reward=0.75), 3)
    progress.close()
    assert "\r" not in stream.getvalue()
    assert stream.getvalue().splitlines() == [
        "warm-up (cross-entropy): step 1/3 loss/token=1.250 tok/s=100",
        "GRPO: step 2/3 reward=0.500 loss=+0.0100 kl=0.020 tok/s=100",
        "GRPO: step 3/3 reward=0.750 loss=+0.0200 kl=- tok/s=100",
    ]
