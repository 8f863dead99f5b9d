"""Expert routes between the wire form (ExpertRoutes: uint16 bytes) and the tensors that
model/routing.py records and replays, and the rule for which routes fit a training sample.

A sampled sequence's routes cover its prompt and all but its last generated token: every
position the sampler ran through the model. A training sample's model input is
(prompt + completion)[:-1], so they cover it exactly; routes may also be one token short (the
sample's final token then routes freely) or longer (the first tokens are used), and nothing
else (api.md 1.7.2).

Legend: T = tokens, L = MoE layers, K = experts per token, B = rows of a forward,
W = its width (longest row).

Imports: errors, types.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from posttrain.errors import InvalidRequest
from posttrain.types import ExpertRoutes, MoeShape


def to_routes(routes_TLK: Tensor) -> ExpertRoutes:
    tokens, layers, top_k = routes_TLK.shape
    data = routes_TLK.to(device="cpu", dtype=torch.int32).numpy().astype("<u2").tobytes()
    return ExpertRoutes(tokens, layers, top_k, data)


def to_tensor(routes: ExpertRoutes) -> Tensor:
    """int64 [T, L, K]."""
    values = np.frombuffer(routes.data, dtype="<u2").astype(np.int64)
    return torch.from_numpy(values).view(routes.num_tokens, routes.num_layers, routes.top_k)


def check_routes(routes: ExpertRoutes, moe: MoeShape | None, num_tokens: int, param: str) -> None:
    """InvalidRequest naming `param` unless `routes` fit this model and a sample of
    `num_tokens` model-input tokens."""
    if moe is None:
        raise InvalidRequest(
            "this model has no mixture-of-experts layers whose routing can be replayed",
            param=param,
        )
    if (routes.num_layers, routes.top_k) != (moe.num_layers, moe.top_k):
        raise InvalidRequest(
            f"routes are [tokens, {routes.num_layers}, {routes.top_k}]; this model has"
            f" {moe.num_layers} MoE layers of top-{moe.top_k} routing",
            param=param,
        )
    if routes.num_tokens < num_tokens - 1:
        raise InvalidRequest(
            f"routes cover {routes.num_tokens} tokens; the sample has {num_tokens} (the routes"
            " must cover all of them, or all but the last)",
            param=param,
        )
    if routes.num_tokens and int(np.frombuffer(routes.data, dtype="<u2").max()) >= moe.num_experts:
        raise InvalidRequest(
            f"routes name an expert id >= {moe.num_experts}, the model's number of experts",
            param=param,
        )


def forced_routes(
    routes_B: list[ExpertRoutes | None], width: int, moe: MoeShape, device: torch.device
) -> list[Tensor] | None:
    """Per MoE layer, the [B * W, K] experts a forward of these rows (right-padded to `width`)
    replays: each row's routes over its first tokens, -1 (route freely) elsewhere. None when
    no row replays."""
    if all(r is None for r in routes_B):
        return None
    forced_BWLK = torch.full((len(routes_B), width, moe.num_layers, moe.top_k), -1)
    for row, routes in enumerate(routes_B):
        if routes is not None:
            values_TLK = to_tensor(routes)[:width]
            forced_BWLK[row, : values_TLK.shape[0]] = values_TLK
    forced_LNK = forced_BWLK.permute(2, 0, 1, 3).reshape(moe.num_layers, -1, moe.top_k)
    return list(forced_LNK.to(device).unbind(0))
