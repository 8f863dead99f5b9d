"""GET /v3/whoami: the caller's identity. The SDK's CLI (`tg`) asks for it before any command
when no project id is configured, and fails on a 404.

The CLI only looks for a project in the answer (to fill in its project id) and prints the user.
A self-hosted server has users but no organizations or projects, so it answers the one
WhoamiResponse variant that carries nothing else: `user_jwt`, `{type, user: {id}}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from posttrain.api.contract import documented
from posttrain.api.deps import UserDep
from posttrain.api.schemas import objects as o

router = APIRouter()


@router.get("/v3/whoami", **documented(o.Whoami))
def whoami(*, user: UserDep) -> dict[str, Any]:
    identity = o.WhoamiUser.model_construct(id=user)
    return o.Whoami.model_construct(type="user_jwt", user=identity).wire()
