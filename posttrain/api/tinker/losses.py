"""Tinker's losses on posttrain's engine: loss_fn + loss_fn_config -> LossConfig, the checks a
Tinker forward-backward's datums need, and posttrain's metric names in Tinker's form.

Loss names (tinker.types.LossFnType) and their loss_fn_config keys, with Tinker's defaults
where they differ from the Together surface's (here Tinker's win):

| loss_fn             | keys (default)                                        | LossType   |
|---------------------|-------------------------------------------------------|------------|
| cross_entropy       | none                                                  | CE         |
| importance_sampling | none                                                  | IS         |
| ppo                 | clip_low_threshold (0.8), clip_high_threshold (1.2)   | PPO        |
| cispo               | clip_low_threshold (0.0), clip_high_threshold (4.0)   | CISPO      |
| dro                 | beta (required)                                       | DRO        |
| gspo                | clip_low_threshold (0.8), clip_high_threshold (1.2)   | GSPO       |

Sources (../shared/reference/losses.md 4-6 and the Tinker docs "Loss functions", per-loss
pages): the PPO page gives the objective with clip(r, 1 - eps_low, 1 + eps_high) and "eps ...
currently fixed to 0.2", so 0.8 / 1.2, as Together's PPO. CISPO 0.0 / 4.0: Together's
README, XORL ("match Tinker's one-sided CISPO default") and MILES agree, as Together's CISPO.
DRO: Tinker's examples pass beta (0.05) and publish no default, so beta is required, as on
Together. GSPO: the GSPO page writes the same clip(s, 1 - eps_low, 1 + eps_high) and names no
default of its own, so PPO's 0.8 / 1.2 (Together's GRPO default 1.28 does not apply).
All thresholds are absolute ratio bounds, as in Tinker's code (clamp(ratio, clip_low_threshold,
clip_high_threshold)).

GSPO is its own loss, not GRPO with ratio_type SEQUENCE. Tinker's page defines, per datum, with
M the positions sequence_ratio_mask marks (rl_loop: the sampled tokens):

    s = exp(mean_{t in M} (x_t - q_t)),  s_t = sg(s) exp(x_t - sg(x_t)),
    L = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t)      (a plain sum over every position)

GRPO SEQUENCE takes the mean over the loss's own inclusion (weights/mask, else every position:
an unmasked Tinker datum would average the prompt's placeholder q = 0 into s) and normalises by
agg_type (1/(S H), 1/M or per-sequence means); no setting gives a plain sum over positions with
the ratio over a separate set. So engine/train/losses.gspo implements Tinker's formula.

Not served: stable_reinforce (its published interface needs server-recorded sampling data and
its objective is not published), and `custom` (server-side uploaded losses); the SDK's
forward_backward_custom with a Python loss runs client-side and needs only cross_entropy.

Imports: loss_specs, types, errors.
"""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.errors import InvalidRequest
from posttrain.loss_specs import (
    LOSS_SPECS,
    Dialect,
    check_input_values,
    check_params,
    input_keys,
    params_from_fields,
    required_inputs,
)
from posttrain.types import ForwardBackwardRequest, LossConfig, LossType, TrainingSample

_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")

# loss_fn -> (its LossType, the loss_fn_config keys it reads).
TINKER_LOSSES: dict[str, tuple[LossType, tuple[str, ...]]] = {
    "cross_entropy": (LossType.CROSS_ENTROPY, ()),
    "importance_sampling": (LossType.IMPORTANCE_SAMPLING, ()),
    "ppo": (LossType.PPO, _THRESHOLDS),
    "cispo": (LossType.CISPO, _THRESHOLDS),
    "dro": (LossType.DRO, ("beta",)),
    "gspo": (LossType.GSPO, _THRESHOLDS),
}
_BUILT_IN_RL = "importance_sampling, ppo, cispo, dro, gspo"

# posttrain's `<name>/<reduction>` metric suffixes and the Tinker reduction each becomes.
_SUFFIXES = {"mean": "mean", "sum": "sum", "min": "min", "max": "max", "fraction": "mean"}


def tinker_loss(loss_fn: str, config: Mapping[str, float | str] | None) -> LossConfig:
    """The domain loss of a Tinker forward_backward (or forward): its `loss_fn` and
    `loss_fn_config`, defaults for keys not sent. InvalidRequest names `loss_fn` for a loss
    posttrain does not serve, `loss_fn_config.<key>` for an unknown key, a non-number or a
    value out of range."""
    if loss_fn == "stable_reinforce":
        raise InvalidRequest(
            "loss_fn 'stable_reinforce' is not supported by this server (it needs"
            " server-recorded sampling data and its objective is not published); use one of"
            f" the built-in policy losses: {_BUILT_IN_RL}",
            param="loss_fn",
        )
    if loss_fn == "custom":
        raise InvalidRequest(
            "loss_fn 'custom' (a server-side uploaded loss) is not supported; the SDK's"
            " forward_backward_custom with a Python loss function works: it runs the loss on"
            " the client and sends cross_entropy",
            param="loss_fn",
        )
    if loss_fn not in TINKER_LOSSES:
        known = ", ".join(TINKER_LOSSES)
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; known: {known}", param="loss_fn")
    loss_type, keys = TINKER_LOSSES[loss_fn]
    given: dict[str, float] = {}
    for key, value in (config or {}).items():
        param = f"loss_fn_config.{key}"
        if key not in keys:
            takes = ", ".join(keys) if keys else "no keys"
            raise InvalidRequest(f"{loss_fn} takes {takes}; got {key!r}", param=param)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{param} must be a number, got {value!r}", param=param)
        given[key] = float(value)
    try:
        params = params_from_fields(loss_type, given)
        config_out = LossConfig(loss_type, params)
        check_params(config_out)
    except InvalidRequest as exc:  # loss.<params_field>.<field> -> loss_fn_config.<field>
        field = (exc.param or "").rsplit(".", 1)[-1]
        message = str(exc).replace(exc.param or "", f"loss_fn_config.{field}")
        raise InvalidRequest(message, param=f"loss_fn_config.{field}") from None
    return config_out


def check_tinker_inputs(request: ForwardBackwardRequest, field: str = "data") -> None:
    """Raise InvalidRequest naming `<field>[i].loss_fn_inputs.<key>` unless every datum of a
    Tinker forward-backward fits its loss: only keys the Tinker surface knows, those the loss
    requires, each of the right length (target_tokens and weights N * K, others N; K > 1
    for cross_entropy only), no negative mask or sequence_ratio_mask (cross-entropy weights
    may be negative: forward_backward_custom). Values must already be finite numbers."""
    known = input_keys(Dialect.TINKER)
    required = required_inputs(request.loss)
    for index, sample in enumerate(request.samples):
        where = f"{field}[{index}].loss_fn_inputs"
        k = sample.targets_per_position
        if k < 1 or (k > 1 and request.loss.type != LossType.CROSS_ENTROPY):
            raise InvalidRequest(
                f"2-D [N, K] target_tokens need loss_fn cross_entropy (K = {k})",
                param=f"{where}.target_tokens",
            )
        for key, values in sample.loss_fn_inputs.items():
            if key not in known:
                names = ", ".join(sorted(known))
                raise InvalidRequest(
                    f"unknown loss_fn_inputs key {key!r}; known: {names}", param=f"{where}.{key}"
                )
            is_per_target = key in ("target_tokens", "weights")
            wanted = sample.loss_length if is_per_target else len(sample.tokens)
            if len(values) != wanted:
                raise InvalidRequest(
                    f"{key} has {len(values)} values, expected {wanted}"
                    f" ({len(sample.tokens)} model_input tokens x {k})",
                    param=f"{where}.{key}",
                )
        for key, condition in required.items():
            if key not in sample.loss_fn_inputs:
                loss = LOSS_SPECS[request.loss.type].function
                raise InvalidRequest(
                    f"{loss} requires loss_fn_inputs.{key}{condition}", param=f"{where}.{key}"
                )
    check_input_values(request.samples, Dialect.TINKER, field)


def tinker_metric_name(name: str) -> str:
    """A posttrain metric name in Tinker's `name:reduction` form (the SDK splits every key on
    ':' and reduces chunk results by the reduction): names with one ':' as they are,
    `<name>/mean` -> `<name>:mean` (likewise sum, min, max), `<name>/<x>_fraction` ->
    `<name>/<x>_fraction:mean`, `loss` -> `loss:sum`, any other name `:mean`."""
    if name.count(":") == 1:
        return name
    name = name.replace(":", "/")
    if name == "loss":
        return "loss:sum"
    head, _, last = name.rpartition("/")
    if head and last in _SUFFIXES:
        return f"{head}:{_SUFFIXES[last]}"
    suffix = last.rpartition("_")[2]
    return f"{name}:{_SUFFIXES.get(suffix, 'mean')}"


def tinker_metrics(loss: float, metrics: Mapping[str, float]) -> dict[str, float]:
    """A forward-backward's metrics for the Tinker surface: every name in `name:reduction`
    form and `loss:sum` always present (the SDK's custom-loss path pops it)."""
    out = {tinker_metric_name(name): value for name, value in metrics.items()}
    out.setdefault("loss:sum", loss)
    return out


def logprobs_shape(sample: TrainingSample) -> list[int]:
    """The shape of a datum's logprobs output, its target_tokens': [N], or [N, K] (the
    engine's N * K values, row-major)."""
    n, k = len(sample.tokens), sample.targets_per_position
    return [n] if k == 1 else [n, k]
