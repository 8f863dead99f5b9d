"""`--model ORG/NAME`: a Hugging Face Hub id resolves to its snapshot in the hub cache through
huggingface_hub (model/hub.py), offline included, and one that can be neither found nor
downloaded stops start-up with one line that says what to do. The caches here are seeded as
huggingface_hub lays its own out (tests/hub_cache.py); nothing is downloaded."""

from __future__ import annotations

import shutil

import pytest
from hub_cache import COMMIT, seed_hub_model

from posttrain.cli import parser, serve_config
from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID
from posttrain.errors import ConfigError
from posttrain.model.hub import HubId, parse_hub_id, snapshot_dir

REPO_ID = "my-org/tiny-qwen3"
TOKENIZER_ONLY = ("config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture
def hub_cache(tmp_path):
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("Qwen/Qwen3-8B", HubId("Qwen/Qwen3-8B", None)),
        ("Qwen/Qwen3-8B@main", HubId("Qwen/Qwen3-8B", "main")),
        (f"my-org/tiny.v2@{COMMIT}", HubId("my-org/tiny.v2", COMMIT)),
        ("./org/name", None),
        ("/org/name", None),
        ("~/name", None),
        ("org/name/sub", None),
        ("name", None),
        ("Qwen/Qwen3-8B=posttrain/tiny-qwen3", None),
    ],
)
def test_only_org_slash_name_with_an_optional_revision_reads_as_a_hub_id(value, expected):
    assert parse_hub_id(value) == expected


@pytest.mark.parametrize("revision", [None, "main", COMMIT])
def test_a_cached_hub_id_resolves_to_its_snapshot_directory_offline(hub_cache, revision):
    snapshot = seed_hub_model(hub_cache, REPO_ID, BUILTIN_MODEL_DIR)
    hub_id = HubId(REPO_ID, revision)
    assert snapshot_dir(hub_id, is_offline=True, cache_dir=hub_cache) == snapshot
    assert (snapshot / "model.safetensors").read_bytes() == (
        BUILTIN_MODEL_DIR / "model.safetensors"
    ).read_bytes()


def test_an_uncached_hub_id_offline_is_refused_in_one_line_saying_what_to_do(hub_cache):
    seed_hub_model(hub_cache, REPO_ID, BUILTIN_MODEL_DIR)
    with pytest.raises(ConfigError) as refused:
        snapshot_dir(HubId("my-org/absent", None), is_offline=True, cache_dir=hub_cache)
    message = refused.value.message
    assert refused.value.param == "models"
    assert "\n" not in message
    assert message.startswith(
        "--model my-org/absent: no such directory, and not in the Hugging Face cache while offline"
    )
    for remedy in ("`hf download my-org/absent`", "unset HF_HUB_OFFLINE", "my-org/absent=DIR"):
        assert remedy in message


def test_a_cached_snapshot_without_weights_is_not_served_offline(hub_cache):
    """A cache that a client filled with a tokenizer only (tinker-cookbook's get_tokenizer)."""
    seed_hub_model(hub_cache, REPO_ID, BUILTIN_MODEL_DIR, names=TOKENIZER_ONLY)
    with pytest.raises(ConfigError) as refused:
        snapshot_dir(HubId(REPO_ID, None), is_offline=True, cache_dir=hub_cache)
    assert "without weights in the Hugging Face cache" in refused.value.message


def test_an_uncached_revision_of_a_cached_repo_is_refused_offline(hub_cache):
    seed_hub_model(hub_cache, REPO_ID, BUILTIN_MODEL_DIR)
    with pytest.raises(ConfigError, match=f"--model {REPO_ID}@v2: no such directory"):
        snapshot_dir(HubId(REPO_ID, "v2"), is_offline=True, cache_dir=hub_cache)


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_serve_reads_offline_mode_from_either_variable(monkeypatch, variable):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ConfigError) as refused:
        serve_config(parser().parse_args(["serve", "--model", "my-org/absent@no-such-rev"]))
    assert "while offline" in refused.value.message


def test_an_existing_directory_shaped_like_a_hub_id_is_a_directory(tmp_path, monkeypatch):
    shutil.copytree(BUILTIN_MODEL_DIR, tmp_path / "my-org" / "tiny")
    monkeypatch.chdir(tmp_path)
    config = serve_config(parser().parse_args(["serve", "--model", "my-org/tiny"]))
    assert config.models[-1].id == "tiny"
    assert config.models[-1].path == (tmp_path / "my-org" / "tiny").resolve()


def test_a_built_in_id_is_not_sent_to_the_hub():
    from posttrain.config_sources import model_spec_from_flag

    with pytest.raises(ConfigError, match="built in and always served"):
        model_spec_from_flag(BUILTIN_MODEL_ID)
