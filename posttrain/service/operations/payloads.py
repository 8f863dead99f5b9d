"""Large-payload offload (api.md 1.6): signed upload URLs, the uploaded JSON bodies, and
loading them back when an operation names its payload_id.

Files live under <data_dir>/payloads, written to a temporary name and renamed, so a retried
PUT overwrites idempotently and a crash never leaves half a payload under its real name.

Imports: store.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from posttrain.errors import InvalidRequest, NotFound
from posttrain.service.ids import new_id
from posttrain.service.lifecycle.sessions import SessionService
from posttrain.service.signing import UrlSigner
from posttrain.store.repo import Repo


def payload_path(payload_id: str) -> str:
    return f"/v1/rl/payloads/{payload_id}"


class PayloadService:
    def __init__(
        self, data_dir: Path, repo: Repo, sessions: SessionService, signer: UrlSigner
    ) -> None:
        self.directory = data_dir / "payloads"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.repo = repo
        self.sessions = sessions
        self.signer = signer

    def create_upload(self, user: str, session_id: str) -> tuple[str, str]:
        """(payload_id, upload_url) for one offloaded request body."""
        self.sessions.get(user, session_id)
        payload_id = new_id("pl")
        file = self.directory / f"{payload_id}.json"
        self.repo.put_payload(payload_id, session_id, time.time(), str(file))
        return payload_id, self.signer.sign("PUT", payload_path(payload_id))

    def download_url(self, user: str, session_id: str, payload_id: str) -> str:
        self.sessions.get(user, session_id)
        found = self.repo.get_payload(payload_id)
        if found is None or found[0] != session_id or not Path(found[1]).is_file():
            raise NotFound(f"payload {payload_id} not found", param="payload_id")
        return self.signer.sign("GET", payload_path(payload_id))

    def authorize(self, method: str, payload_id: str, expires: str | None, sig: str | None) -> Path:
        """The file behind a signed URL; NotFound when the signature is bad or expired."""
        found = self.repo.get_payload(payload_id)
        if found is None or not self.signer.verify(method, payload_path(payload_id), expires, sig):
            raise NotFound("payload URL is unknown or expired", param="payload_id")
        return Path(found[1])

    def write(self, path: Path, body: bytes) -> None:
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(body)
        os.replace(temporary, path)

    def read(self, session_id: str, payload_id: str) -> bytes:
        """The uploaded body of `payload_id`, which must belong to `session_id`, as sent (the
        api layer parses it like any request body)."""
        found = self.repo.get_payload(payload_id)
        if found is None or found[0] != session_id:
            raise InvalidRequest(
                f"payload_id {payload_id!r} is unknown or belongs to another session",
                param="payload_id",
            )
        path = Path(found[1])
        if not path.is_file():
            raise InvalidRequest(f"payload {payload_id} was never uploaded", param="payload_id")
        return path.read_bytes()
