"""The signing key: the configured one, else one created once in the data directory (owner-only)
and read back on every later start, so signed URLs outlive a restart."""

from __future__ import annotations

from posttrain.service.signing import KEY_FILE, UrlSigner, signing_key


def test_the_data_directory_keeps_one_key(tmp_path):
    first = signing_key("", tmp_path / "data")
    assert len(first) == 64 and signing_key("", tmp_path / "data") == first
    assert (tmp_path / "data" / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert signing_key("", tmp_path / "other") != first


def test_a_configured_key_wins_and_writes_nothing(tmp_path):
    assert signing_key("my-key", tmp_path) == "my-key"
    assert not (tmp_path / KEY_FILE).exists()


def test_a_url_signed_before_a_restart_verifies_after_it(tmp_path):
    url = UrlSigner(signing_key("", tmp_path), 60).sign("PUT", "/v1/rl/payloads/pl-1")
    query = dict(part.split("=") for part in url.split("?")[1].split("&"))
    restarted = UrlSigner(signing_key("", tmp_path), 60)
    assert restarted.verify("PUT", "/v1/rl/payloads/pl-1", query["expires"], query["sig"])
    assert not restarted.verify("PUT", "/v1/rl/payloads/pl-2", query["expires"], query["sig"])
