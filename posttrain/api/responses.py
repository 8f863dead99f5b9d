"""Reply models -> response bodies: cursor pages, the error envelope, and JSON bytes.

The shapes themselves are the reply models' (api/schemas/objects.py, outputs.py), which build
themselves from domain records and dump what the SDK 3.1.1 reads.
Imports: api.schemas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from posttrain.api.schemas.objects import ErrorData, ErrorEnvelope, PageMeta
from posttrain.api.schemas.reply import Reply


class Identified(Protocol):
    id: str


def page(
    reply: type[Reply], items: Sequence[Identified], *, limit: int, after: str | None
) -> dict[str, Any]:
    """Cursor pagination over newest-first items: `after` is the id of the previous page's last."""
    start = 0
    if after:
        ids = [item.id for item in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    chunk = list(items[start : start + limit])
    has_more = start + limit < len(items)
    meta = PageMeta.model_construct(
        has_more=has_more, limit=limit, next_cursor=chunk[-1].id if has_more and chunk else ""
    )
    return reply.model_construct(data=chunk, meta=meta).wire()


def json_bytes(reply: Reply) -> bytes:
    """The reply as the compact JSON FastAPI's JSONResponse writes."""
    return json.dumps(reply.wire(), separators=(",", ":"), allow_nan=False).encode()


def error_response(status: int, kind: str, message: str, param: str | None) -> JSONResponse:
    """The error envelope of every 4xx and 5xx (api.md 6.1)."""
    error = ErrorData.model_construct(message=message, type=kind, param=param, code=None)
    body = ErrorEnvelope.model_construct(error=error).wire()
    return JSONResponse(status_code=status, content=body)
