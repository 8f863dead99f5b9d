"""Signed, expiring URLs for the fetches the SDK makes without an Authorization header
(payload upload and download, checkpoint files). The signature binds method, path and expiry,
so a URL cannot be reused for another object or after it expires.

The key is the configured one, or else one kept in the data directory (`signing.key`, created
on first start, readable by its owner only), so URLs handed out before a restart still work
after it.

Imports: nothing from posttrain."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlencode

KEY_FILE = "signing.key"


def signing_key(configured: str, data_dir: Path) -> str:
    """`configured`, or the data directory's persistent key (created atomically if absent)."""
    if configured:
        return configured
    path = data_dir / KEY_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)  # first writer wins; a concurrent start reads its key
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
    return path.read_text().strip()


class UrlSigner:
    def __init__(self, key: str, ttl_s: int) -> None:
        assert key, "a signing key (signing_key() gives the persistent one)"
        self._key = key.encode()
        self.ttl_s = ttl_s

    def _signature(self, method: str, path: str, expires: int) -> str:
        message = f"{method}\n{path}\n{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, method: str, path: str) -> str:
        """`path?expires=...&sig=...`, relative, so the SDK joins it to its base URL."""
        expires = int(time.time()) + self.ttl_s
        query = urlencode({"expires": expires, "sig": self._signature(method, path, expires)})
        return f"{path}?{query}"

    def verify(self, method: str, path: str, expires: str | None, sig: str | None) -> bool:
        if not expires or not sig or not expires.isdigit() or int(expires) < time.time():
            return False
        return hmac.compare_digest(self._signature(method, path, int(expires)), sig)
