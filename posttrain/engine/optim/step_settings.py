"""The hyperparameters one optim-step runs with (losses.md 12.2, 12.3): the request's fields
for the resource's optimizer family, defaults filled every step, never the previous step's
values (13.18), and the rule for the learning rate of the parameters Muon does not own.

The service resolves them at submit time too, so a request for the other family fails before
it queues (service/operations/submit.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.errors import InvalidRequest
from posttrain.types import AdamParams, MuonParams, MuonScaling, OptimStepRequest


@dataclass(frozen=True)
class StepSettings:
    """The hyperparameters one optim-step runs with, after defaults and the lr rule."""

    adam: AdamParams
    muon: MuonParams | None
    grad_clip_norm: float


def resolve_step_settings(
    request: OptimStepRequest, muon_scaling: MuonScaling | None
) -> StepSettings:
    """Fill the defaults of one optim-step for an AdamW (`muon_scaling` None) or Muon optimizer.

    Raises InvalidRequest if the request carries the other family's parameters.
    """
    if muon_scaling is None:
        if request.muon is not None:
            raise InvalidRequest(
                "muon_params given, but this model resource uses AdamW; send adam_params",
                param="muon_params",
            )
        adam = request.adam or AdamParams()
        return StepSettings(adam=adam, muon=None, grad_clip_norm=adam.grad_clip_norm)
    if request.adam is not None:
        raise InvalidRequest(
            "adam_params given, but this model resource uses Muon; send muon_params "
            "(with muon_params.adam for the parameters Muon does not own)",
            param="adam_params",
        )
    muon = request.muon or MuonParams()
    if muon.adam is not None:
        adam = muon.adam
    elif muon_scaling is MuonScaling.MATCH_ADAM:
        # 12.3: an absent adam.learning_rate is the Muon lr under MATCH_ADAM (whose Muon lr is
        # AdamW-sized by design), and 1e-4 (AdamParams' default) under ORIGINAL.
        adam = AdamParams(learning_rate=muon.learning_rate)
    else:
        adam = AdamParams()
    # 12.3: muon_params.grad_clip_norm, else muon_params.adam.grad_clip_norm, else 1.0 (which
    # is also AdamParams' default when muon_params.adam is absent).
    clip = muon.grad_clip_norm if muon.grad_clip_norm is not None else adam.grad_clip_norm
    return StepSettings(adam=adam, muon=muon, grad_clip_norm=clip)
