"""`posttrain --help` and `posttrain serve --help` are written for users, and a bad setting is
one line on stderr with exit status 2, through the real CLI."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain import cli
from posttrain.config_sources import FLAG_GROUPS, settings


def help_of(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_the_top_level_help_says_what_posttrain_is_and_where_to_go_next(capsys):
    text = help_of(capsys=capsys)
    flat = " ".join(text.split())
    assert "Together RL post-training API" in flat
    for command in ("serve", "demo"):
        assert re.search(rf"^\s+{command}\s+\S", text, re.M), command
        assert f"posttrain {command} --help" in flat
    assert "Imports:" not in text and "ServerConfig" not in text


def test_serve_help_groups_every_flag_and_shows_its_default(capsys):
    text = help_of("serve", capsys=capsys)
    headings = [line[:-1] for line in text.splitlines() if line[:-1] in FLAG_GROUPS]
    assert headings == list(FLAG_GROUPS)
    sections = dict(
        zip(
            headings,
            re.split("|".join(f"^{h}:$" for h in headings), text, flags=re.M)[1:],
            strict=True,
        )
    )
    for setting in settings():
        if setting.hidden:
            assert setting.flag not in text
            continue
        section = sections[setting.group]
        assert re.search(rf"^  {re.escape(setting.flag)}\b", section, re.M), setting.flag
        # The help of this flag: from its line to the next flag's.
        after = section[section.index(f"  {setting.flag}") :]
        entry = re.split(r"\n  --", after[2:], maxsplit=1)[0]
        assert "(default: " in " ".join(entry.split()), setting.flag
    flat = " ".join(text.split())
    assert "--data-dir DIR where the server keeps" in flat
    assert "(default: posttrain-data; env POSTTRAIN_DATA_DIR)" in flat
    assert "cpu, cuda or cuda:N (default: auto)" in flat
    for flag in ("--api-key", "--keys-file"):
        assert re.search(rf"^  {flag}\b", sections["limits and auth"], re.M)


def test_serve_help_cites_no_file_the_user_does_not_have(capsys):
    text = help_of("serve", capsys=capsys)
    assert not re.search(r"\.md\b|\w+/\w+\.py|\bissue \d", text), text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--memory-limit", "8"), "posttrain: --memory-limit 8: '8' has no unit: give one"),
        (("--port", "70000"), "posttrain: --port 70000: Input should be less than or equal"),
        (("--trainer-ranks", "zero"), "posttrain: --trainer-ranks zero: Input should be a valid"),
        (("--workers", "fork"), "posttrain: argument --workers: invalid choice: 'fork'"),
        (
            ("--no-such-flag",),
            "posttrain: unrecognized arguments: --no-such-flag; run `posttrain serve --help`",
        ),
        (("--ray", "local"), "posttrain: --ray places worker processes"),
        (("--device", "tpu9"), "posttrain: --device tpu9: "),
        (("--host", "0.0.0.0"), "posttrain: --host 0.0.0.0 listens beyond loopback without an"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what serve sets, undone after the test
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with pytest.raises(SystemExit) as refused:
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "data"), *flags])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1, err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"posttrain {posttrain.__version__}\n"
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == posttrain.__version__


def test_a_port_in_use_is_one_line_that_suggests_another_port(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as refused:
            cli.main(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        f"posttrain: --port {port}: 127.0.0.1:{port} is in use; give another --port (0: any)\n"
    )


def test_a_data_dir_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as refused:
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path / "file")])
    assert refused.value.code == 2
    assert capsys.readouterr().err == f"posttrain: --data-dir {tmp_path / 'file'}: File exists\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_from_the_real_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "serve", "--port", "0", "--device", "cuda"]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2
    assert done.stderr == (
        "posttrain: --device cuda: device 'cuda' requested but CUDA is not available\n"
    )
    assert done.stdout == ""
