"""Every built-in loss, both request shapes, custom forward-backward and the non-finite guard,
driven through the official together SDK (and once its tinker shim) against a real server.

Gradient equality is observed from outside: two fresh sessions with the same LoRA seed take
the same optimizer step, so their forward-only logprobs afterwards are identical bit-for-bit
exactly when the gradients they accumulated were.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import API_KEY, BASE_MODEL, low_level
from together import BadRequestError, omit
from together.post_training import ModelResourcesClient, SessionClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
IS = {"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"}
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.0}
POLL_S = 0.05  # the SDK polls every 0.5 s by default; these operations take milliseconds
DONE = ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED")
PREFIX = 1  # each sample's first position predicts a prompt token: excluded by mask/weights

# Two RL samples of different lengths (padding and FIXED_HORIZON's H are exercised). Per
# position: the log-ratio the sampler's logprobs are set to (r = exp(offset)), the advantage,
# and the mask (one completion position of sample 0 is masked too).
SEQUENCES = [[1, 20, 21, 22, 23, 24, 25], [1, 30, 31, 32, 33]]
OFFSETS = [[0.0, 0.3, -0.1, 0.2, 0.05, -0.4], [0.0, 0.4, -0.3, 0.1]]
ADVANTAGES = [[0.0, 1.5, 1.0, 3.0, 2.0, 0.5], [0.0, -0.75, -0.5, -1.0]]
MASKS = [[0, 1, 1, 0, 1, 1], [0, 1, 1, 1]]
REF_OFFSETS = [[0.0, -0.2, 0.5, 0.0, 0.1, -0.05], [0.0, 0.3, -0.6, 0.2]]


def f32(values: list[float]) -> list[float]:
    """Values exactly as the server will hold them (float32)."""
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def model_input(tokens: list[int]) -> dict[str, Any]:
    return {"chunks": [{"encoded_text": {"tokens": tokens}}]}


def ce_sample(tokens: list[int], weights: list[float]) -> dict[str, Any]:
    return {
        "model_input": model_input(tokens[:-1]),
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": weights, "dtype": "float32"},
        },
    }


def all_positions(tokens: list[int]) -> dict[str, Any]:
    return ce_sample(tokens, [1.0] * (len(tokens) - 1))


PROBE = [all_positions(s) for s in SEQUENCES] + [all_positions([1, 40, 41, 42, 43, 44])]


@pytest.fixture(scope="module")
def resource(shared_server) -> Iterator[ModelResourcesClient]:
    client = ModelResourcesClient.create(
        base_url=shared_server.base_url, api_key=API_KEY, base_model=BASE_MODEL, interval=0.2
    )
    yield client
    client.stop(force=True)


def new_session(resource: ModelResourcesClient, seed: int = 7) -> SessionClient:
    return resource.create_session(lora_config={"rank": 4, "seed": seed}, interval=0.2)


@pytest.fixture(scope="module")
def scorer(resource) -> Iterator[SessionClient]:
    """A session that is never trained: scoring only."""
    session = new_session(resource, seed=3)
    yield session
    session.stop()


def probe(session: SessionClient, samples: list[dict[str, Any]] = PROBE) -> list[list[float]]:
    """Forward-only logprobs of every position of `samples` (PROBE: equal iff the weights are
    equal)."""
    result = session.trainer.forward(samples=samples, loss=CE, interval=POLL_S)
    return [list(out.tensors["logprobs"].data) for out in result.loss_fn_outputs]


def current_logprobs(session: SessionClient) -> list[list[float]]:
    """Forward-only logprobs of SEQUENCES, scored as the batch the tests send: float32 sums
    may round differently in a batch of another shape (a single-threaded matmul tiles its
    rows by the batch's size), by about 1e-6."""
    return probe(session, [all_positions(s) for s in SEQUENCES])


class Batch:
    """The RL batch, with sampler logprobs placed at OFFSETS from the session's current ones."""

    def __init__(self, x: list[list[float]]) -> None:
        self.x = x
        self.q = [
            f32([a - o for a, o in zip(xs, os, strict=True)])
            for xs, os in zip(x, OFFSETS, strict=True)
        ]
        self.ref = [
            f32([a + o for a, o in zip(xs, os, strict=True)])
            for xs, os in zip(x, REF_OFFSETS, strict=True)
        ]

    def samples(self, **extra_keys: Callable[[int], dict]) -> list[dict[str, Any]]:
        out = []
        for i, tokens in enumerate(SEQUENCES):
            inputs = {
                "target_tokens": {"data": tokens[1:], "dtype": "int64"},
                "logprobs": {"data": self.q[i], "dtype": "float32"},
                "advantages": {"data": ADVANTAGES[i], "dtype": "float32"},
                "mask": {"data": MASKS[i], "dtype": "int64"},
            }
            inputs.update({key: make(i) for key, make in extra_keys.items()})
            out.append({"model_input": model_input(tokens[:-1]), "loss_fn_inputs": inputs})
        return out

    def with_reference(self) -> list[dict[str, Any]]:
        return self.samples(reference_logprobs=lambda i: {"data": self.ref[i], "dtype": "float32"})

    def seed_samples(self, block: str, *, april: bool = False) -> list[dict[str, Any]]:
        """The same batch in the seed-era shape: string tokens, D_TYPE_* names, an inputs
        block, policy_segments; April spelling (loss_mask, generator_logprobs) if asked."""
        out = []
        for i, tokens in enumerate(SEQUENCES):
            inputs: dict[str, Any] = {
                "advantages": {"data": [str(a) for a in ADVANTAGES[i]], "dtype": "D_TYPE_FLOAT32"},
                ("generator_logprobs" if april else "logprobs"): {"data": self.q[i]},
            }
            if block == "grpo_inputs":
                inputs["reference_logprobs"] = {"data": self.ref[i], "dtype": "d_type_float32"}
            mask = {"data": MASKS[i], "dtype": "D_TYPE_INT64"}
            loss_inputs: dict[str, Any] = {
                "target_tokens": {"data": [str(t) for t in tokens[1:]], "dtype": "D_TYPE_INT64"},
                "loss_mask" if april else "weights": mask,
                block: inputs,
            }
            out.append(
                {
                    "model_input": model_input([str(t) for t in tokens[:-1]]),
                    "loss_inputs": loss_inputs,
                    "policy_segments": [{"version": "0", "start_token": 0}],
                }
            )
        return out


@pytest.fixture(scope="module")
def batch(scorer) -> Batch:
    return Batch(current_logprobs(scorer))


# ---------------------------------------------------------------- closed forms (losses.md)


def included(i: int) -> list[int]:
    return [t for t, m in enumerate(MASKS[i]) if m]


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def sum_terms(x, b: Batch, term: Callable[[float, float, float], float]) -> float:
    """sum_i sum_t m_it term(x_it, q_it, A_it) over the included positions."""
    return sum(term(x[i][t], b.q[i][t], ADVANTAGES[i][t]) for i in range(2) for t in included(i))


def ppo_term(x: float, q: float, a: float, low: float, high: float) -> float:
    r = math.exp(x - q)
    return -min(r * a, clip(r, low, high) * a)


def dppo_term(x: float, q: float, a: float, delta_low: float, delta_high: float) -> float:
    change = math.exp(x) - math.exp(q)
    keep = change <= delta_high if a > 0 else change >= -delta_low
    return -a * math.exp(x - q) * x if keep else 0.0


def grpo_token_fixed_horizon(x, b: Batch, low: float, high: float, beta: float) -> float:
    total = 0.0
    for i in range(2):
        for t in included(i):
            u = clip(b.ref[i][t] - x[i][t], -10.0, 10.0)
            kl = math.exp(u) - u - 1.0
            total += ppo_term(x[i][t], b.q[i][t], ADVANTAGES[i][t], low, high) + beta * kl
    horizon = max(len(s) - 1 for s in SEQUENCES)
    return total / (len(SEQUENCES) * horizon)


def gspo_sequence_mean(x, b: Batch, low: float, high: float) -> float:
    per_sample = []
    for i in range(2):
        positions = included(i)
        mean_log_ratio = sum(x[i][t] - b.q[i][t] for t in positions) / len(positions)
        s = math.exp(mean_log_ratio)
        terms = [
            -min(s * ADVANTAGES[i][t], clip(s, low, high) * ADVANTAGES[i][t]) for t in positions
        ]
        per_sample.append(sum(terms) / len(positions))
    return sum(per_sample) / len(per_sample)


BASE_KEYS = {"loss:sum", "loss/ratio/mean", "loss/kl_policy/mean"}
CLIP_KEYS = BASE_KEYS | {"loss/clip/high_fraction", "loss/clip/low_fraction"}
GRPO_KEYS = CLIP_KEYS | {"loss/clip/clipped_ratio/mean"}

# name -> (loss config, samples from the batch, closed form of L from x, metric keys)
CASES: dict[str, tuple[dict, Callable[[Batch], list], Callable[[Any, Batch], float], set]] = {
    "cross_entropy": (
        CE,
        lambda b: [ce_sample(s, [0.0, 1.0, 0.5, 0.0, 2.0, 1.0][: len(s) - 1]) for s in SEQUENCES],
        lambda x, b: (
            -sum(
                w * x[i][t]
                for i, s in enumerate(SEQUENCES)
                for t, w in enumerate([0.0, 1.0, 0.5, 0.0, 2.0, 1.0][: len(s) - 1])
            )
        ),
        {"loss:sum"},
    ),
    "importance_sampling": (
        IS,
        Batch.samples,
        lambda x, b: sum_terms(x, b, lambda xt, q, a: -math.exp(xt - q) * a),
        BASE_KEYS,
    ),
    "ppo": (
        {
            "type": "LOSS_TYPE_PPO",
            "ppo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        },
        Batch.samples,
        lambda x, b: sum_terms(x, b, lambda xt, q, a: ppo_term(xt, q, a, 0.8, 1.2)),
        CLIP_KEYS,
    ),
    "cispo": (
        {
            "type": "LOSS_TYPE_CISPO",
            "cispo_params": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        },
        Batch.samples,
        lambda x, b: sum_terms(x, b, lambda xt, q, a: -clip(math.exp(xt - q), 0.9, 1.1) * a * xt),
        CLIP_KEYS,
    ),
    "dro": (
        {"type": "LOSS_TYPE_DRO", "dro_params": {"beta": 0.5}},
        Batch.samples,
        lambda x, b: sum_terms(x, b, lambda xt, q, a: -(a * xt - 0.25 * (xt - q) ** 2)),
        BASE_KEYS,
    ),
    "dppo": (
        # The tiny model's probabilities are ~1e-5, so the trust region is scaled down to bite.
        {"type": "LOSS_TYPE_DPPO", "dppo_params": {"delta_low": 2e-6, "delta_high": 2e-6}},
        Batch.samples,
        lambda x, b: sum_terms(x, b, lambda xt, q, a: dppo_term(xt, q, a, 2e-6, 2e-6)),
        CLIP_KEYS,
    ),
    "grpo": (
        {
            "type": "LOSS_TYPE_GRPO",
            "grpo_params": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "beta": 0.1},
        },
        Batch.with_reference,
        lambda x, b: grpo_token_fixed_horizon(x, b, 0.8, 1.2, 0.1),
        GRPO_KEYS | {"loss/kl_ref/mean"},
    ),
    "grpo_gspo_sequence_mean": (
        {
            "type": "LOSS_TYPE_GRPO",
            "grpo_params": {
                "clip_low_threshold": 0.95,
                "clip_high_threshold": 1.05,
                "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN",
                "ratio_type": "GRPO_LOSS_RATIO_TYPE_SEQUENCE",
            },
        },
        Batch.samples,
        lambda x, b: gspo_sequence_mean(x, b, 0.95, 1.05),
        GRPO_KEYS,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_loss_equals_the_closed_form_and_excluded_logprobs_are_zero(scorer, batch, name):
    loss, make_samples, closed_form, keys = CASES[name]
    samples = make_samples(batch)
    result = scorer.trainer.forward(samples=samples, loss=loss, interval=POLL_S)
    x = [list(out.tensors["logprobs"].data) for out in result.loss_fn_outputs]
    for i, sample in enumerate(samples):
        inputs = sample["loss_fn_inputs"]
        inclusion = inputs.get("weights", inputs.get("mask"))["data"]
        assert len(x[i]) == len(sample["model_input"]["chunks"][0]["encoded_text"]["tokens"])
        assert result.loss_fn_outputs[i].tensors["logprobs"].dtype == "float32"
        for t, m in enumerate(inclusion):
            if m == 0:
                assert x[i][t] == 0.0, (i, t)
            else:
                assert x[i][t] == pytest.approx(batch.x[i][t], abs=1e-6) and x[i][t] < 0
    expected = closed_form(x, batch)
    assert result.loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert keys <= set(result.metrics), sorted(result.metrics)
    assert result.metrics["loss:sum"] == result.loss
    if name not in ("cross_entropy", "grpo_gspo_sequence_mean"):
        ratios = [math.exp(x[i][t] - batch.q[i][t]) for i in range(2) for t in included(i)]
        assert result.metrics["loss/ratio/mean"] == pytest.approx(np.mean(ratios), rel=1e-5)


def test_the_cases_exercise_clipping_on_both_sides(scorer, batch):
    """Guards the closed-form test against data that never clips."""
    for name in ("ppo", "dppo", "grpo"):
        loss, make_samples, _, _ = CASES[name]
        metrics = scorer.trainer.forward(
            samples=make_samples(batch), loss=loss, interval=POLL_S
        ).metrics
        assert metrics["loss/clip/high_fraction"] > 0, name
        assert metrics["loss/clip/low_fraction"] > 0, name


def test_forward_only_never_touches_accumulated_gradients(resource, scorer, batch):
    scored, plain = new_session(resource), new_session(resource)
    for session in (scored, plain):
        session.trainer.forward_backward(samples=PROBE, loss=CE, interval=POLL_S)
        if session is scored:
            for loss, make_samples, _, _ in CASES.values():
                session.trainer.forward(samples=make_samples(batch), loss=loss, interval=POLL_S)
        session.trainer.optim_step(adam_params=ADAM, interval=POLL_S)
    assert probe(scored) == probe(plain)
    assert probe(scored) != probe(scorer)  # the step did change the weights
    scored.stop()
    plain.stop()


# ---------------------------------------------------------------- seed-era shapes


@pytest.fixture(scope="module")
def ops(shared_server):
    return low_level(shared_server.base_url).post_training.operations


def submit(ops, session: SessionClient, kind: str, **body: Any):
    """Submit through the low-level client and wait; returns the final operation."""
    sid = session.session_id
    submit_fn = getattr(ops, kind)
    retrieve = getattr(ops, f"retrieve_{kind}")
    op = submit_fn(sid, idempotency_key=str(uuid.uuid4()), **body)
    while op.status not in DONE:
        time.sleep(POLL_S)
        op = retrieve(op.id, session_id=sid)
    return op


def score(ops, session: SessionClient, **body: Any):
    op = submit(
        ops, session, "forward_backward", forward_only=True, return_loss_fn_outputs=True, **body
    )
    assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
    out = op.output
    return out.loss, out.metrics, [o.tensors["logprobs"].data for o in out.loss_fn_outputs]


def equivalent_bodies(b: Batch) -> dict[str, tuple[dict, dict]]:
    """name -> (3.1.1 body, seed-era body that means the same)."""
    grpo = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "beta": 0.1}
    ce = [ce_sample(s, [0.0] + [1.0] * (len(s) - 2)) for s in SEQUENCES]
    seed_ce = [
        {
            "model_input": model_input([str(t) for t in s[:-1]]),
            "loss_inputs": {
                "target_tokens": {"data": [str(t) for t in s[1:]]},
                "weights": {"data": ["0"] + ["1"] * (len(s) - 2), "dtype": "D_TYPE_FLOAT32"},
            },
        }
        for s in SEQUENCES
    ]
    return {
        "grpo, seed blocks": (
            {
                "loss": {"type": "LOSS_TYPE_GRPO", "grpo_params": grpo},
                "samples": b.with_reference(),
            },
            {
                "loss": {"type": "LOSS_TYPE_GRPO", "grpo_params": grpo},
                "samples": b.seed_samples("grpo_inputs"),
            },
        ),
        "grpo, April epsilons and no loss type": (
            {
                "loss": {
                    "type": "LOSS_TYPE_GRPO",
                    "grpo_params": {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25},
                },
                "samples": b.with_reference(),
            },
            {
                "loss": {"grpo_params": {"clip_low": 0.25, "clip_high": 0.25}},
                "samples": b.seed_samples("grpo_inputs", april=True),
            },
        ),
        "ppo, seed blocks": (
            {"loss": {"type": "LOSS_TYPE_PPO"}, "samples": b.samples()},
            {"loss": {"type": "LOSS_TYPE_PPO"}, "samples": b.seed_samples("ppo_inputs")},
        ),
        "importance sampling, block infers the type": (
            {"loss": IS, "samples": b.samples()},
            {"loss": {}, "samples": b.seed_samples("importance_sampling_inputs")},
        ),
        "dro, early loss_fn": (
            {
                "loss": {"type": "LOSS_TYPE_DRO", "dro_params": {"beta": 0.5}},
                "samples": b.samples(),
            },
            {
                "loss": omit,
                "extra_body": {"loss_fn": "dro", "loss_fn_config": {"beta": 0.5}},
                "samples": b.samples(),
            },
        ),
        "cross-entropy, string tokens": (
            {"loss": CE, "samples": ce},
            {"loss": {}, "samples": seed_ce},
        ),
    }


def test_seed_era_and_3_1_1_bodies_score_identically(ops, scorer, batch):
    for name, (new, seed) in equivalent_bodies(batch).items():
        assert score(ops, scorer, **seed) == score(ops, scorer, **new), name


def test_seed_era_and_3_1_1_bodies_give_identical_gradients(ops, resource, scorer, batch):
    bodies = equivalent_bodies(batch)
    names = ["grpo, April epsilons and no loss type", "cross-entropy, string tokens"]
    gradients = [[-0.5, -1.0, 0.25, 0.0, -2.0, 1.0], [1.0, -0.5, -0.25, 0.5]]
    custom_new = {
        "samples": [all_positions(s) for s in SEQUENCES],
        "gradients": [{"data": g} for g in gradients],
    }
    custom_seed = {
        "samples": [
            {
                "model_input": model_input([str(t) for t in s[:-1]]),
                "loss_inputs": {
                    "target_tokens": {"data": [str(t) for t in s[1:]], "dtype": "D_TYPE_INT64"}
                },
            }
            for s in SEQUENCES
        ],
        "gradients": [{"data": [str(v) for v in g], "dtype": "D_TYPE_FLOAT32"} for g in gradients],
    }
    sessions = []
    for shape in (0, 1):
        session = new_session(resource)
        for name in names:
            op = submit(ops, session, "forward_backward", **bodies[name][shape])
            assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", (name, op.error)
        op = submit(ops, session, "custom_forward_backward", **(custom_new, custom_seed)[shape])
        assert op.status == "TRAINING_OPERATION_STATUS_COMPLETED", op.error
        session.trainer.optim_step(adam_params=ADAM, interval=POLL_S)
        sessions.append(session)
    assert probe(sessions[0]) == probe(sessions[1])
    assert probe(sessions[0]) != probe(scorer)
    for session in sessions:
        session.stop()


# ---------------------------------------------------------------- validation at submit


def bad_bodies(b: Batch) -> dict[str, tuple[dict, str]]:
    grpo_no_ref = b.with_reference()
    del grpo_no_ref[1]["loss_fn_inputs"]["reference_logprobs"]
    no_adv = b.samples()
    del no_adv[1]["loss_fn_inputs"]["advantages"]
    both = b.samples(weights=lambda i: {"data": MASKS[i], "dtype": "float32"})
    short = b.samples()
    short[1]["loss_fn_inputs"]["advantages"]["data"] = ADVANTAGES[1][:-1]
    unknown = b.samples()
    unknown[0]["loss_fn_inputs"]["advantage"] = unknown[0]["loss_fn_inputs"]["advantages"]
    seed_missing = b.seed_samples("ppo_inputs")
    del seed_missing[1]["loss_inputs"]["ppo_inputs"]["logprobs"]
    return {
        "ppo clip_low_threshold above 1": (
            {
                "loss": {"type": "LOSS_TYPE_PPO", "ppo_params": {"clip_low_threshold": 1.1}},
                "samples": b.samples(),
            },
            "loss.ppo_params.clip_low_threshold",
        ),
        "grpo clip_high_threshold below 1": (
            {
                "loss": {"type": "LOSS_TYPE_GRPO", "grpo_params": {"clip_high_threshold": 0.9}},
                "samples": b.samples(),
            },
            "loss.grpo_params.clip_high_threshold",
        ),
        "cispo low above high": (
            {
                "loss": {
                    "type": "LOSS_TYPE_CISPO",
                    "cispo_params": {"clip_low_threshold": 2, "clip_high_threshold": 1},
                },
                "samples": b.samples(),
            },
            "loss.cispo_params.clip_high_threshold",
        ),
        "dppo delta above 1": (
            {
                "loss": {"type": "LOSS_TYPE_DPPO", "dppo_params": {"delta_high": 1.5}},
                "samples": b.samples(),
            },
            "loss.dppo_params.delta_high",
        ),
        "dro without beta": (
            {"loss": {"type": "LOSS_TYPE_DRO", "dro_params": {}}, "samples": b.samples()},
            "loss.dro_params.beta",
        ),
        "grpo beta without reference_logprobs in sample 1": (
            {
                "loss": {"type": "LOSS_TYPE_GRPO", "grpo_params": {"beta": 0.1}},
                "samples": grpo_no_ref,
            },
            "samples[1].loss_fn_inputs.reference_logprobs",
        ),
        "weights and mask together": (
            {"loss": IS, "samples": both},
            "samples[0].loss_fn_inputs.mask",
        ),
        "params of another loss": (
            {"loss": {"type": "LOSS_TYPE_PPO", "grpo_params": {}}, "samples": b.samples()},
            "loss.grpo_params",
        ),
        "missing advantages in sample 1": (
            {"loss": IS, "samples": no_adv},
            "samples[1].loss_fn_inputs.advantages",
        ),
        "missing seed logprobs in sample 1": (
            {"loss": {"type": "LOSS_TYPE_PPO"}, "samples": seed_missing},
            "samples[1].loss_inputs.ppo_inputs.logprobs",
        ),
        "length disagrees with the model input": (
            {"loss": IS, "samples": short},
            "samples[1].loss_fn_inputs.advantages",
        ),
        "unknown loss_fn_inputs key": (
            {"loss": IS, "samples": unknown},
            "samples[0].loss_fn_inputs.advantage",
        ),
        "negative weight in sample 1": (
            {"loss": CE, "samples": [PROBE[0], ce_sample(SEQUENCES[1], [0.0, 1.0, -1.0, 1.0])]},
            "samples[1].loss_fn_inputs.weights",
        ),
    }


def test_bad_bodies_are_400_naming_the_field_and_change_nothing(ops, resource, batch):
    session = new_session(resource)
    before = probe(session)
    for name, (body, param) in bad_bodies(batch).items():
        with pytest.raises(BadRequestError) as info:
            submit(ops, session, "forward_backward", **body)
        assert info.value.body["error"]["param"] == param, (name, info.value.body)
    session.trainer.optim_step(
        adam_params=ADAM, interval=POLL_S
    )  # nothing was accumulated: a no-op step
    assert probe(session) == before
    session.stop()


# ---------------------------------------------------------------- non-finite guard


def with_inputs(sample: dict[str, Any], **inputs: list[float]) -> dict[str, Any]:
    changed = {key: {"data": data, "dtype": "float32"} for key, data in inputs.items()}
    return {**sample, "loss_fn_inputs": {**sample["loss_fn_inputs"], **changed}}


def non_finite_batches(x: list[list[float]]) -> list[list[dict[str, Any]]]:
    """IS batches built from the session's current logprobs x; each is finite JSON."""
    samples = Batch(x).samples()
    on_policy = [with_inputs(s, logprobs=x[i]) for i, s in enumerate(samples)]
    lengths = [len(m) for m in MASKS]
    return [
        # r = 1 and A = 3e38 at 7 included positions: the float32 sum overflows.
        [with_inputs(s, advantages=[3e38] * n) for s, n in zip(on_policy, lengths, strict=True)],
        # q = -1e30 at included positions: exp(x - q) overflows.
        [with_inputs(s, logprobs=[-1e30] * n) for s, n in zip(samples, lengths, strict=True)],
        # A finite loss (-3e38 at one position) whose gradient overflows inside the model.
        [with_inputs(on_policy[0], advantages=[0.0, 3e38, 0.0, 0.0, 0.0, 0.0])],
    ]


def test_non_finite_batches_fail_and_discard_only_their_own_contribution(ops, resource, scorer):
    good = {"loss": CE, "samples": PROBE}
    guarded, clean = new_session(resource), new_session(resource)
    for session in (guarded, clean):
        for _ in range(2):  # the second step runs on optimizer state from the first
            assert submit(ops, session, "forward_backward", **good).status == DONE[0]
            if session is guarded:
                for samples in non_finite_batches(current_logprobs(session)):
                    op = submit(ops, session, "forward_backward", loss=IS, samples=samples)
                    assert op.status == "TRAINING_OPERATION_STATUS_FAILED", op.output
                    assert op.error.code == "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS"
                    assert op.error.message
                op = submit(
                    ops,
                    session,
                    "custom_forward_backward",
                    samples=PROBE[:1],
                    gradients=[{"data": [1e38] * 6}],
                )
                assert op.error.code == "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS"
            session.trainer.optim_step(adam_params=ADAM, interval=POLL_S)
    assert probe(guarded) == probe(clean)
    assert probe(guarded) != probe(scorer)
    guarded.stop()
    clean.stop()


# ---------------------------------------------------------------- custom forward-backward


def test_custom_forward_backward_equals_cross_entropy_with_weights_minus_g(
    ops, resource, scorer, shared_server
):
    gradients = [[-0.5, -1.0, -0.25, 0.0, -2.0, -1.0], [-1.0, 0.0, -0.75, -0.5]]
    custom, reference = new_session(resource), new_session(resource)
    # All-zero weights, as the tinker shim sends them: placeholders, not applied.
    placeholders = [ce_sample(s, [0.0] * (len(s) - 1)) for s in SEQUENCES]
    result = custom.trainer.custom_forward_backward(
        samples=placeholders, gradients=[{"data": g} for g in gradients], interval=POLL_S
    )
    assert result is not None
    weights = [ce_sample(s, [-v for v in g]) for s, g in zip(SEQUENCES, gradients, strict=True)]
    reference.trainer.forward_backward(samples=weights, loss=CE, interval=POLL_S)
    for session in (custom, reference):
        session.trainer.optim_step(adam_params=ADAM, interval=POLL_S)
    for a, b in zip(probe(custom), probe(reference), strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert probe(custom) != probe(scorer)
    # The raw wire output is an empty object, not null.
    op = submit(
        ops,
        custom,
        "custom_forward_backward",
        samples=placeholders,
        gradients=[{"data": g} for g in gradients],
    )
    raw = httpx.get(
        f"{shared_server.base_url}/v1/rl/training-sessions/{custom.session_id}/operations"
        f"/custom-forward-backward/{op.id}",
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert raw["status"] == "TRAINING_OPERATION_STATUS_COMPLETED" and raw["output"] == {}
    custom.stop()
    reference.stop()


def test_tinker_shim_forward_backward_custom_trains(resource, shared_server):
    import together.post_training.tinker as tinker
    import torch

    service = tinker.ServiceClient(
        base_url=shared_server.base_url,
        api_key=API_KEY,
        model_resources_id=resource.model_resources_id,
    )
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4)
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in SEQUENCES
    ]

    def loss_fn(data, logprobs: list[torch.Tensor]):
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom/loss": float(loss.detach())}

    def logprobs_now() -> list[list[float]]:
        out = training.forward(data, "cross_entropy").result()
        return [list(o["logprobs"].data) for o in out.loss_fn_outputs]

    before = logprobs_now()
    result = training.forward_backward_custom(data, loss_fn).result()
    assert result.metrics["custom/loss"] == pytest.approx(-sum(map(sum, before)), rel=1e-5)
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    after = logprobs_now()
    # The loss maximises the targets' logprobs: one step raises their total.
    assert sum(map(sum, after)) > sum(map(sum, before)) + 1e-3, (before, after)
    training.close()
