"""API keys in the config: the keys file format, --api-key, env, and errors that name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config_sources import api_keys_from, build_config, load_keys_file
from posttrain.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_keys_file_maps_each_key_to_its_user_and_skips_comments(tmp_path):
    path = write(tmp_path, "# team keys\nkey-a  user_alice\n\n   \n  key-b\tuser_bob\n")
    assert load_keys_file(path) == {"key-a": "user_alice", "key-b": "user_bob"}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("key-a user_alice\nkey-b\n", ":2: expected `KEY USER_ID`, got 1 fields"),
        ("key-a user_alice extra\n", ":1: expected `KEY USER_ID`, got 3 fields"),
        ("key-a user_alice\nkey-a user_bob\n", ":2: this key already appears above"),
        ("# only a comment\n", "the file holds no keys"),
    ],
)
def test_malformed_keys_files_are_rejected_naming_the_line(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_keys_file(write(tmp_path, text))
    assert fragment in info.value.message
    assert info.value.param == "api_keys"


def test_missing_keys_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="--keys-file"):
        load_keys_file(tmp_path / "absent")


def test_api_key_belongs_to_the_single_user_and_joins_the_keys_file(tmp_path):
    path = write(tmp_path, "key-a user_alice\n")
    assert api_keys_from("solo", None, "user_local") == {"solo": "user_local"}
    assert api_keys_from("solo", path, "user_local") == {
        "key-a": "user_alice",
        "solo": "user_local",
    }
    with pytest.raises(ConfigError, match="user_alice"):
        api_keys_from("key-a", path, "user_local")


def test_build_config_reads_keys_and_expiry_knobs_from_env(tmp_path, monkeypatch):
    path = write(tmp_path, "key-a user_alice\n")
    monkeypatch.setenv("POSTTRAIN_KEYS_FILE", str(path))
    monkeypatch.setenv("POSTTRAIN_MIN_INACTIVE_TIMEOUT_S", "2")
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    config = build_config(expiry_check_interval_s=0.5)
    assert config.api_keys == {"key-a": "user_alice"}
    assert config.min_inactive_timeout_s == 2
    assert config.expiry_check_interval_s == 0.5
    # An explicit --api-key adds to the env's keys file; no keys at all is single-user mode.
    assert build_config(api_key="solo").api_keys == {"key-a": "user_alice", "solo": "user_local"}
    monkeypatch.delenv("POSTTRAIN_KEYS_FILE")
    assert build_config().api_keys == {}
    with pytest.raises(ConfigError) as info:
        build_config(min_inactive_timeout_s=0)
    assert info.value.param == "min_inactive_timeout_s"
