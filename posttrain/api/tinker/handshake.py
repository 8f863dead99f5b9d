"""The Tinker SDK's handshake: who the caller is (its `X-API-Key`), and the feature flags
`/client/config` answers.

The key is checked as the Together surface checks a bearer key (api/deps.authenticate): the
same keys and users, and the guard checks it before a body is read. The SDK itself only sends
keys that start with `tml-`, so a keys file for Tinker users holds such keys.

Flags, each against the SDK 0.38 default:
- `parallel_fwdbwd_chunks` false: a forward_backward over more than 1,024 datums is sent as
  chunks one after another, in seq_id order, instead of all at once with the first chunk last
  (which a server must reorder); their gradients add up as one call's would.
- `use_pyqwest_transport` false: the SDK's plain httpx transport; both work over http.
- `fwdbwd_max_chunk_len`: the engine's max_batch_size (the SDK's default, 1,024, is more than
  one forward-backward takes here).
- everything else as the SDK defaults it (no JWT exchange, no server-side custom losses, no
  batched future polling).

Imports: api.deps.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request

from posttrain.api.deps import authenticate
from posttrain.config import ServerConfig

FLAGS = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
# The SDK's own chunk bound (bytes of one forward_backward body); a smaller body limit wins.
SDK_CHUNK_BYTES = 5_000_000


def client_config(config: ServerConfig) -> dict[str, object]:
    """The flags, and the chunk bounds of this server: a forward_backward chunk holds at most
    the engine's max_batch_size datums and fits under half the body limit."""
    return {
        **FLAGS,
        "fwdbwd_max_chunk_len": config.engine.max_batch_size,
        "fwdbwd_max_chunk_bytes_count": min(
            SDK_CHUNK_BYTES, (config.limits.max_body_mib << 20) // 2
        ),
    }


DYNAMIC_CONFIG = {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


async def tinker_user(request: Request) -> str:
    config = request.app.state.services.config
    return authenticate(config, authorization_of(request.headers))


def authorization_of(headers: Mapping[str, str]) -> str:
    """The caller's credentials as an Authorization value: the Tinker SDK sends its key as
    `X-API-Key`, the Together SDK as a bearer key."""
    key = headers.get("x-api-key")
    if key:
        return f"Bearer {key}"
    return headers.get("authorization", "")
