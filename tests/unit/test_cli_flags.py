"""`posttrain serve` flags that become engine settings."""

from __future__ import annotations

import pytest
import torch

from posttrain.cli import engine_config, parser
from posttrain.config import EngineConfig
from posttrain.model.loader import resolve_dtype


def test_device_and_dtype_flags_become_the_engine_config():
    assert engine_config(parser().parse_args(["serve"])) is None
    args = parser().parse_args(["serve", "--device", "cpu", "--dtype", "float32"])
    assert engine_config(args) == EngineConfig(device="cpu", dtype="float32")
    assert engine_config(parser().parse_args(["serve", "--dtype", "bfloat16"])).device == "auto"


def test_an_unknown_dtype_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--dtype", "float16"])
    assert "--dtype" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("float32", "cuda", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_cuda(name, device, expected):
    assert resolve_dtype(name, torch.device(device)) == expected
