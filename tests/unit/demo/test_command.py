"""`posttrain demo` flags -> DemoConfig: `--model` picks a built-in base model."""

from __future__ import annotations

from dataclasses import replace

from posttrain.cli import parser
from posttrain.config import BUILTIN_MODEL_ID
from posttrain.demo.command import demo_config
from posttrain.demo.loop import QUICK

MOE_MODEL = "posttrain/tiny-qwen3-moe"


def test_model_flag_sets_the_demo_base_model():
    args = parser().parse_args(["demo", "--quick", "--model", MOE_MODEL])
    assert demo_config(args) == replace(QUICK, base_model=MOE_MODEL)


def test_the_demo_trains_the_dense_built_in_by_default():
    assert demo_config(parser().parse_args(["demo"])).base_model == BUILTIN_MODEL_ID
