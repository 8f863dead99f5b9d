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


def test_poll_hold_seconds_defaults_to_ten_and_refuses_what_the_sdk_would_time_out_on():
    from posttrain.config import build_config
    from posttrain.errors import ConfigError

    assert build_config().poll_hold_seconds == 10.0
    args = parser().parse_args(["serve", "--poll-hold-seconds", "0"])
    assert build_config(poll_hold_seconds=args.poll_hold_seconds).poll_hold_seconds == 0.0
    for bad in (-1.0, 60.0):  # the SDK's shortest read timeout is 60 s (api.md 2.6)
        with pytest.raises(ConfigError) as refused:
            build_config(poll_hold_seconds=bad)
        assert refused.value.param == "poll_hold_seconds"


def test_persist_every_comes_from_the_flag_or_env_and_refuses_zero(monkeypatch):
    from posttrain.config import build_config
    from posttrain.errors import ConfigError

    assert build_config().persist_every == 10
    args = parser().parse_args(["serve", "--persist-every", "1"])
    assert build_config(persist_every=args.persist_every).persist_every == 1
    monkeypatch.setenv("POSTTRAIN_PERSIST_EVERY", "4")
    assert build_config().persist_every == 4
    with pytest.raises(ConfigError) as refused:
        build_config(persist_every=0)
    assert refused.value.param == "persist_every"


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_memory_limit_flag_takes_bytes_with_a_unit(flag, expected):
    args = parser().parse_args(["serve", "--memory-limit", flag])
    assert engine_config(args) == EngineConfig(memory_limit=expected)


def test_a_memory_limit_without_a_known_unit_is_refused(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--memory-limit", "8 parsecs"])
    assert "--memory-limit" in capsys.readouterr().err


def test_memory_limit_config_key_takes_the_same_units():
    assert EngineConfig(memory_limit="2GiB").memory_limit == 2 << 30
    assert EngineConfig().memory_limit is None


def test_cuda_graphs_flag_becomes_the_engine_setting_and_is_off_by_default():
    assert EngineConfig().cuda_graphs is False
    on = engine_config(parser().parse_args(["serve", "--cuda-graphs", "on"]))
    assert on == EngineConfig(cuda_graphs=True)
    off = engine_config(parser().parse_args(["serve", "--cuda-graphs", "off"]))
    assert off == EngineConfig(cuda_graphs=False)


def test_shard_parameters_is_on_by_default_and_the_flag_turns_it_off():
    assert EngineConfig().shard_parameters is True
    args = parser().parse_args(["serve", "--trainer-ranks", "2", "--shard-parameters", "off"])
    assert engine_config(args) == EngineConfig(trainer_ranks=2, shard_parameters=False)
    on = parser().parse_args(["serve", "--trainer-ranks", "2", "--shard-parameters", "on"])
    assert engine_config(on).shard_parameters
    assert engine_config(parser().parse_args(["serve", "--trainer-ranks", "2"])).shard_parameters
