"""Signed, expiring URLs for the fetches the SDK makes without an Authorization header
(payload upload and download, checkpoint files). The signature binds method, path and expiry,
so a URL cannot be reused for another object or after it expires."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import urlencode


class UrlSigner:
    def __init__(self, key: str, ttl_s: int) -> None:
        self._key = (key or secrets.token_hex(32)).encode()
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
