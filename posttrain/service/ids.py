"""Object ids: a kind prefix plus 24 random hex digits; the prefix tells kinds apart in logs."""

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"
