"""SessionOptimizer against independent references (losses.md 11.3, 12).

AdamW is checked against torch.optim.AdamW and clip_grad_norm_; Muon and its nested AdamW
against a plain reference written here from the formulas of losses.md 12.1-12.3.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor, nn

from posttrain.engine.optim.muon import is_muon_param, newton_schulz
from posttrain.engine.optim.optimizer import (
    SessionOptimizer,
    clip_grads_,
    global_grad_norm,
    resolve_step_settings,
)
from posttrain.errors import InvalidRequest, NonFiniteLoss
from posttrain.types import AdamParams, MuonParams, MuonScaling, OptimStepRequest

NamedParams = list[tuple[str, nn.Parameter]]

# Shapes of a tiny session with LoRA factors, full weights, a stacked-expert tensor and the
# tensors that Muon leaves to AdamW.
SHAPES = {
    "model.layers.0.self_attn.q_proj.lora_A.default": (2, 8),  # r x in
    "model.layers.0.self_attn.q_proj.lora_B.default": (6, 2),  # out x r
    "model.layers.0.mlp.gate_proj.weight": (5, 8),
    "model.layers.0.mlp.experts.down_proj": (3, 6, 4),  # batch of 3 tall matrices
    "model.layers.0.mlp.gate.weight": (3, 8),  # MoE router
    "model.embed_tokens.weight": (10, 8),
    "lm_head.lora_A.default": (2, 8),
    "model.layers.0.input_layernorm.weight": (8,),
    "model.norm.weight": (8,),
}
MUON_NAMES = {
    "model.layers.0.self_attn.q_proj.lora_A.default",
    "model.layers.0.self_attn.q_proj.lora_B.default",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.experts.down_proj",
}
NS_ABC = (3.4445, -4.7750, 2.0315)


def make_params(seed: int = 0, shapes: dict[str, tuple[int, ...]] = SHAPES) -> NamedParams:
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, nn.Parameter(torch.randn(shape, generator=gen))) for name, shape in shapes.items()
    ]


def clone_params(named: NamedParams) -> NamedParams:
    return [(name, nn.Parameter(p.detach().clone())) for name, p in named]


def make_grads(named: NamedParams, step: int, scale: float = 1.0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [scale * torch.randn(p.shape, generator=gen) for _, p in named]


def set_grads(named: NamedParams, grads: list[Tensor | None]) -> None:
    for (_, p), g in zip(named, grads, strict=True):
        p.grad = None if g is None else g.clone()


def snapshot(opt: SessionOptimizer) -> list[bytes]:
    """Bytes of every parameter, gradient and state tensor: NaN-safe exact comparison."""
    tensors = [p.detach() for _, p in opt.named_params]
    tensors += [p.grad for _, p in opt.named_params if p.grad is not None]
    for group in opt.state_dict().values():
        for name in sorted(group):
            tensors += [group[name][k] for k in sorted(group[name])]
    return [t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for family in a:
        assert a[family].keys() == b[family].keys()
        for name in a[family]:
            for key, tensor in a[family][name].items():
                assert torch.equal(tensor, b[family][name][key]), (family, name, key)


# ---------------------------------------------------------------- AdamW and clipping (12.1, 12.2)

ADAM_SHAPES = {"w": (4, 3), "a": (2, 5), "b": (3,)}


@pytest.mark.parametrize("grad_clip_norm", [1.0, 0.0])
def test_adamw_matches_torch_adamw_over_ten_steps(grad_clip_norm: float) -> None:
    ours = make_params(shapes=ADAM_SHAPES)
    ref = clone_params(ours)
    opt = SessionOptimizer(ours)
    adam = AdamParams(learning_rate=0.05, weight_decay=0.3, grad_clip_norm=grad_clip_norm)
    # 12.2: only >= 2-D tensors are decayed, so the reference has two groups.
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in ref if p.ndim >= 2], "weight_decay": adam.weight_decay},
            {"params": [p for _, p in ref if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        foreach=False,
    )
    for step in range(10):
        grads = make_grads(ours, step, scale=3.0)  # global norm ~15: clipping is active
        set_grads(ours, grads)
        set_grads(ref, grads)
        opt.step(OptimStepRequest(adam=adam))
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in ref], grad_clip_norm, foreach=False)
        ref_opt.step()
        for (name, p), (_, q) in zip(ours, ref, strict=True):
            assert torch.equal(p, q), (step, name)
    assert all(p.grad is None for _, p in ours)


def test_adamw_decays_matrices_but_not_vectors() -> None:
    named = make_params(shapes=ADAM_SHAPES)
    before = {name: p.detach().clone() for name, p in named}
    opt = SessionOptimizer(named)
    # A zero gradient leaves Adam's own update at 0, so only decay can move a parameter.
    set_grads(named, [torch.zeros_like(p) for _, p in named])
    opt.step(OptimStepRequest(adam=AdamParams(learning_rate=0.1, weight_decay=0.5)))
    for name, p in named:
        factor = 1 - 0.1 * 0.5 if p.ndim >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)


def test_clipping_matches_clip_grad_norm() -> None:
    grads = make_grads(make_params(shapes=ADAM_SHAPES), step=0, scale=2.0)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, 0.7, foreach=False)
    ours_norm = global_grad_norm(grads)
    clip_grads_(grads, 0.7, ours_norm)
    assert torch_norm > 0.7
    assert torch.equal(ours_norm, torch_norm)
    for g, p in zip(grads, params, strict=True):
        assert torch.equal(g, p.grad)


def test_clipping_scales_by_threshold_over_norm_plus_eps() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]  # G = 5
    clip_grads_(grads, 1.0, global_grad_norm(grads))
    torch.testing.assert_close(grads[0], torch.tensor([3.0, 0.0]) / (5 + 1e-6))
    small = [torch.tensor([0.3, 0.4])]  # G = 0.5 < c: unchanged
    clip_grads_(small, 1.0, global_grad_norm(small))
    assert torch.equal(small[0], torch.tensor([0.3, 0.4]))


def test_zero_grad_clip_norm_disables_clipping() -> None:
    named = make_params(shapes={"w": (3, 3)})
    opt = SessionOptimizer(named)
    set_grads(named, [torch.full((3, 3), 100.0)])
    ref = clone_params(named)
    ref_opt = torch.optim.AdamW([p for _, p in ref], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    set_grads(ref, [torch.full((3, 3), 100.0)])
    opt.step(OptimStepRequest(adam=AdamParams(grad_clip_norm=0.0)))
    ref_opt.step()
    assert torch.equal(named[0][1], ref[0][1])


@pytest.mark.parametrize("family", ["adam", "muon"])
def test_omitted_step_fields_take_defaults_not_previous_values(family: str) -> None:
    scaling = None if family == "adam" else MuonScaling.MATCH_ADAM
    custom = (
        OptimStepRequest(adam=AdamParams(learning_rate=0.03, beta1=0.5, weight_decay=0.4))
        if family == "adam"
        else OptimStepRequest(muon=MuonParams(learning_rate=0.001, momentum=0.5, weight_decay=0.3))
    )
    explicit_defaults = (
        OptimStepRequest(adam=AdamParams())
        if family == "adam"
        else OptimStepRequest(muon=MuonParams())
    )
    results = []
    for second in (OptimStepRequest(), explicit_defaults, custom):
        named = make_params()
        opt = SessionOptimizer(named, muon_scaling=scaling)
        for step, request in enumerate((custom, second)):
            set_grads(named, make_grads(named, step))
            opt.step(request)
        results.append([p.detach().clone() for _, p in named])
    omitted, defaults, sticky = results
    assert all(torch.equal(a, b) for a, b in zip(omitted, defaults, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(omitted, sticky, strict=True))


@pytest.mark.parametrize("scaling", [None, MuonScaling.ORIGINAL])
def test_step_without_gradients_is_a_noop(scaling: MuonScaling | None) -> None:
    named = make_params()
    opt = SessionOptimizer(named, muon_scaling=scaling)
    opt.step(OptimStepRequest())  # before any state exists
    set_grads(named, make_grads(named, 0))
    opt.step(OptimStepRequest())
    before = snapshot(opt)
    assert not opt.has_gradients()
    opt.step(OptimStepRequest())
    assert snapshot(opt) == before


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM])
def test_parameter_without_gradient_is_not_decayed_or_updated(scaling: MuonScaling | None) -> None:
    named = make_params()
    opt = SessionOptimizer(named, muon_scaling=scaling)
    set_grads(named, make_grads(named, 0))
    opt.step(OptimStepRequest())
    state_before = opt.state_dict()
    skipped = {"model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"}
    params_before = {name: p.detach().clone() for name, p in named}
    grads = make_grads(named, 1)
    set_grads(named, [None if n in skipped else g for (n, _), g in zip(named, grads, strict=True)])
    opt.step(OptimStepRequest())
    state_after = opt.state_dict()
    for name, p in named:
        assert torch.equal(p, params_before[name]) == (name in skipped), name
    for family in state_after:
        for name in skipped & state_after[family].keys():
            for key, tensor in state_after[family][name].items():
                assert torch.equal(tensor, state_before[family][name][key]), (name, key)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM])
def test_non_finite_gradient_raises_and_touches_nothing(
    bad: float, scaling: MuonScaling | None
) -> None:
    named = make_params()
    opt = SessionOptimizer(named, muon_scaling=scaling)
    for step in range(2):
        set_grads(named, make_grads(named, step))
        opt.step(OptimStepRequest())
    grads = make_grads(named, 2)
    grads[3][0, 1, 2] = bad
    set_grads(named, grads)
    before = snapshot(opt)
    with pytest.raises(NonFiniteLoss):
        opt.step(OptimStepRequest())
    assert snapshot(opt) == before  # parameters, state and the gradients themselves


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM])
@pytest.mark.parametrize("first_step", [False, True])
def test_a_step_that_would_overflow_the_weights_raises_and_touches_nothing(
    scaling: MuonScaling | None, first_step: bool
) -> None:
    """A finite gradient and a huge learning rate: the weights would become inf. The step fails
    and parameters, optimizer state (none yet, on a first step) and gradients stay bit-exact;
    the next sane step then runs as if the bad one never happened."""
    named, twin = make_params(), make_params()
    optimizers = [SessionOptimizer(n, muon_scaling=scaling) for n in (named, twin)]
    for step in range(0 if first_step else 2):
        for params, opt in zip((named, twin), optimizers, strict=True):
            set_grads(params, make_grads(params, step))
            opt.step(OptimStepRequest())
    opt = optimizers[0]
    set_grads(named, make_grads(named, 2))
    before = snapshot(opt)
    huge = AdamParams(learning_rate=1e308, grad_clip_norm=0.5)
    request = (
        OptimStepRequest(muon=MuonParams(learning_rate=1e308, adam=huge))
        if scaling
        else (OptimStepRequest(adam=huge))
    )
    with pytest.raises(NonFiniteLoss, match="unchanged"):
        opt.step(request)
    assert snapshot(opt) == before
    opt.step(OptimStepRequest())
    set_grads(twin, make_grads(twin, 2))
    optimizers[1].step(OptimStepRequest())
    assert snapshot(opt) == snapshot(optimizers[1])


def test_family_mismatch_is_invalid_request() -> None:
    named = make_params()
    set_grads(named, make_grads(named, 0))
    adam_opt = SessionOptimizer(named)
    muon_opt = SessionOptimizer(named, muon_scaling=MuonScaling.MATCH_ADAM)
    before = snapshot(adam_opt)
    with pytest.raises(InvalidRequest) as err:
        adam_opt.step(OptimStepRequest(muon=MuonParams()))
    assert err.value.param == "muon_params"
    with pytest.raises(InvalidRequest) as err:
        muon_opt.step(OptimStepRequest(adam=AdamParams()))
    assert err.value.param == "adam_params"
    assert snapshot(adam_opt) == before


# ---------------------------------------------------------------- Muon (12.3)


def test_muon_classification_of_parameter_names() -> None:
    expected = {
        "model.layers.0.self_attn.q_proj.lora_A.default": True,
        "model.layers.0.self_attn.q_proj.lora_B.default": True,
        "model.layers.3.mlp.down_proj.lora_B.my_adapter": True,
        "model.layers.0.mlp.gate_proj.weight": True,  # dense projection, not a router
        "model.layers.0.mlp.gate_proj.lora_A.default": True,
        "model.layers.0.mlp.gate_up_proj.weight": True,
        "model.layers.0.mlp.experts.down_proj": True,
        "model.layers.0.self_attn.o_proj.weight": True,
        "model.layers.0.self_attn.q_proj.lora_A.norm_adapter": True,  # adapter name ignored
        "model.layers.0.mlp.gate.weight": False,  # MoE router
        "model.layers.0.mlp.gate.lora_A.default": False,  # LoRA follows its module
        "model.layers.0.mlp.shared_expert_gate.weight": False,
        "model.embed_tokens.weight": False,
        "model.embed_tokens.lora_A.default": False,
        "model.embed_tokens.lora_B.default": False,
        "lm_head.weight": False,
        "lm_head.lora_A.default": False,
        "lm_head.lora_B.default": False,
        "model.vision_tower.embeddings.patch_embedding.weight": False,
        "model.layers.0.self_attn.q_norm.weight": False,
        "model.layers.0.mixer.conv1d.weight": False,
    }
    for name, is_muon in expected.items():
        assert is_muon_param(name, ndim=2) == is_muon, name
    assert is_muon_param("model.layers.0.mlp.experts.gate_up_proj", ndim=3)
    assert not is_muon_param("model.layers.0.self_attn.q_proj.bias", ndim=1)
    opt = SessionOptimizer(make_params(), muon_scaling=MuonScaling.ORIGINAL)
    assert set(opt.muon_param_names) == MUON_NAMES
    assert SessionOptimizer(make_params()).muon_param_names == []


@pytest.mark.parametrize(
    ("scaling", "muon", "adam_lr", "clip"),
    [
        (MuonScaling.MATCH_ADAM, MuonParams(learning_rate=3e-4), 3e-4, 1.0),
        (MuonScaling.ORIGINAL, MuonParams(learning_rate=3e-4), 1e-4, 1.0),
        (MuonScaling.MATCH_ADAM, MuonParams(adam=AdamParams(grad_clip_norm=0.5)), 1e-4, 0.5),
        (MuonScaling.ORIGINAL, MuonParams(grad_clip_norm=0.0, adam=AdamParams(2e-3)), 2e-3, 0.0),
    ],
)
def test_muon_nested_adam_lr_and_clip_rule(
    scaling: MuonScaling, muon: MuonParams, adam_lr: float, clip: float
) -> None:
    settings = resolve_step_settings(OptimStepRequest(muon=muon), scaling)
    assert settings.muon == muon
    assert settings.adam.learning_rate == adam_lr
    assert settings.grad_clip_norm == clip


def ref_newton_schulz(u: Tensor, num_steps: int) -> Tensor:
    """NS_k of losses.md 12.3 on one R x C matrix, literally."""
    a, b, c = NS_ABC
    transposed = u.shape[0] > u.shape[1]
    x = u.T if transposed else u
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(num_steps):
        p = x @ x.T
        x = a * x + (b * p + c * (p @ p)) @ x
    return x.T if transposed else x


def ref_scale(rows: int, cols: int, scaling: MuonScaling) -> float:
    if scaling is MuonScaling.ORIGINAL:
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


class RefMuon:
    """losses.md 12.1 clipping, 12.3 Muon (EMA + nesterov) and 12.2 AdamW, from the formulas."""

    def __init__(self, named: NamedParams, scaling: MuonScaling) -> None:
        self.params = {name: p.detach().clone() for name, p in named}
        self.scaling = scaling
        self.buf = {n: torch.zeros_like(p) for n, p in self.params.items() if n in MUON_NAMES}
        self.m = {n: torch.zeros_like(p) for n, p in self.params.items() if n not in MUON_NAMES}
        self.v = {n: torch.zeros_like(p) for n in self.m for p in [self.params[n]]}
        self.t = 0

    def step(self, grads: dict[str, Tensor], muon: MuonParams) -> None:
        adam = muon.adam
        if adam is None:
            lr = muon.learning_rate if self.scaling is MuonScaling.MATCH_ADAM else 1e-4
            adam = AdamParams(learning_rate=lr)
        clip = muon.grad_clip_norm if muon.grad_clip_norm is not None else adam.grad_clip_norm
        total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        coef = min(1.0, clip / (total + 1e-6)) if clip > 0 else 1.0
        grads = {n: g * coef for n, g in grads.items()}
        mu, lr, wd = muon.momentum, muon.learning_rate, muon.weight_decay
        for name, buf in self.buf.items():
            g, w = grads[name], self.params[name]
            buf.copy_(mu * buf + (1 - mu) * g)
            u = (1 - mu) * g + mu * buf
            rows, cols = w.shape[-2:]
            mats = u.reshape(-1, rows, cols)
            o = torch.stack([ref_newton_schulz(m, muon.newton_schulz_steps) for m in mats])
            w = w * (1 - lr * wd)
            self.params[name] = w - lr * ref_scale(rows, cols, self.scaling) * o.reshape(w.shape)
        self.t += 1
        b1, b2 = adam.beta1, adam.beta2
        for name, m in self.m.items():
            g, w, v = grads[name], self.params[name], self.v[name]
            decay = adam.weight_decay if w.ndim >= 2 else 0.0
            w = w * (1 - adam.learning_rate * decay)
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            m_hat, v_hat = m / (1 - b1**self.t), v / (1 - b2**self.t)
            self.params[name] = w - adam.learning_rate * m_hat / (v_hat.sqrt() + adam.eps)


MUON_CASES = {
    "defaults": MuonParams(),
    "explicit": MuonParams(
        learning_rate=0.005,
        momentum=0.8,
        newton_schulz_steps=4,
        weight_decay=0.05,
        adam=AdamParams(learning_rate=1e-3, beta2=0.99, weight_decay=0.02, grad_clip_norm=0.5),
    ),
    "no_momentum_no_clip": MuonParams(learning_rate=0.01, momentum=0.0, grad_clip_norm=0.0),
}


@pytest.mark.parametrize("case", list(MUON_CASES))
@pytest.mark.parametrize("scaling", [MuonScaling.MATCH_ADAM, MuonScaling.ORIGINAL])
def test_muon_matches_reference_over_five_steps(case: str, scaling: MuonScaling) -> None:
    muon = MUON_CASES[case]
    named = make_params()
    opt = SessionOptimizer(named, muon_scaling=scaling)
    ref = RefMuon(named, scaling)
    for step in range(5):
        grads = make_grads(named, step, scale=0.5)
        set_grads(named, grads)
        opt.step(OptimStepRequest() if case == "defaults" else OptimStepRequest(muon=muon))
        ref.step({name: g for (name, _), g in zip(named, grads, strict=True)}, muon)
        for name, p in named:
            torch.testing.assert_close(p.detach(), ref.params[name], rtol=1e-6, atol=1e-6)
    for name, entry in opt.state_dict()["muon"].items():
        torch.testing.assert_close(entry["momentum_buffer"], ref.buf[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("scaling", "torch_fn"),
    [(MuonScaling.ORIGINAL, "original"), (MuonScaling.MATCH_ADAM, "match_rms_adamw")],
)
def test_muon_agrees_with_torch_muon_up_to_its_bfloat16_newton_schulz(
    scaling: MuonScaling, torch_fn: str
) -> None:
    shapes = {"model.layers.0.mlp.down_proj.weight": (12, 20), "model.layers.0.x.weight": (20, 6)}
    named = make_params(shapes=shapes)
    ref = clone_params(named)
    opt = SessionOptimizer(named, muon_scaling=scaling)
    ref_opt = torch.optim.Muon(
        [p for _, p in ref], lr=0.01, weight_decay=0.1, momentum=0.9, adjust_lr_fn=torch_fn
    )
    for step in range(3):
        grads = make_grads(named, step)
        set_grads(named, grads)
        set_grads(ref, grads)
        start = [p.detach().clone() for _, p in named]
        opt.step(OptimStepRequest(muon=MuonParams(0.01, momentum=0.9, grad_clip_norm=0.0)))
        ref_opt.step()
        for (_, p), (_, q), p0 in zip(named, ref, start, strict=True):
            delta, ref_delta = p.detach() - p0, q.detach() - p0
            scale = ref_delta.abs().max().item()
            torch.testing.assert_close(delta, ref_delta, rtol=0, atol=0.05 * scale)
            p.data.copy_(q.detach())  # keep both on the same trajectory


def test_newton_schulz_orthogonalises_and_keeps_zero() -> None:
    u = torch.randn(3, 7, 4, generator=torch.Generator().manual_seed(3))
    singular_values = torch.linalg.svdvals(newton_schulz(u, 5))
    assert singular_values.min() > 0.5 and singular_values.max() < 1.5
    assert torch.equal(newton_schulz(torch.zeros(2, 5, 3), 5), torch.zeros(2, 5, 3))


# ---------------------------------------------------------------- state round trip


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM, MuonScaling.ORIGINAL])
def test_state_dict_round_trip_continues_bit_exactly(scaling: MuonScaling | None) -> None:
    named = make_params()
    opt = SessionOptimizer(named, muon_scaling=scaling)
    for step in range(3):
        set_grads(named, make_grads(named, step))
        opt.step(OptimStepRequest())
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_named = clone_params(named)
    resumed = SessionOptimizer(resumed_named, muon_scaling=scaling)
    resumed.load_state_dict(saved)
    assert_states_equal(resumed.state_dict(), opt.state_dict())
    for step in range(3, 6):
        set_grads(named, make_grads(named, step))
        set_grads(resumed_named, make_grads(named, step))
        opt.step(OptimStepRequest())
        resumed.step(OptimStepRequest())
    for (name, p), (_, q) in zip(named, resumed_named, strict=True):
        assert torch.equal(p, q), name
    assert_states_equal(resumed.state_dict(), opt.state_dict())


def test_state_of_another_family_is_rejected() -> None:
    named = make_params()
    adam_opt = SessionOptimizer(named)
    set_grads(named, make_grads(named, 0))
    adam_opt.step(OptimStepRequest())
    muon_opt = SessionOptimizer(clone_params(named), muon_scaling=MuonScaling.MATCH_ADAM)
    with pytest.raises(InvalidRequest, match="AdamW state for unknown parameter"):
        muon_opt.load_state_dict(adam_opt.state_dict())


@pytest.mark.parametrize("scaling", list(MuonScaling))
@pytest.mark.parametrize(
    ("prefix", "suffix", "shape"),
    [("model.layers.0.mlp.", ".weight", (12, 4)), ("model.layers.0.mlp.experts.", "", (3, 8, 6))],
    ids=["dense", "experts"],
)
def test_muon_updates_a_fused_gate_up_projection_as_its_two_halves(
    scaling: MuonScaling, prefix: str, suffix: str, shape: tuple[int, ...]
) -> None:
    """losses.md 12.3: [gate | up] is split in two before orthogonalisation, each half scaled
    by its own shape: the fused parameter moves exactly as separate gate and up would."""
    gen = torch.Generator().manual_seed(3)
    half = shape[-2] // 2
    fused = nn.Parameter(torch.randn(shape, generator=gen))
    unsplit = nn.Parameter(fused.detach().clone())  # the same matrix under a plain name
    gate = nn.Parameter(fused.detach()[..., :half, :].clone())
    up = nn.Parameter(fused.detach()[..., half:, :].clone())
    fused_opt = SessionOptimizer([(f"{prefix}gate_up_proj{suffix}", fused)], muon_scaling=scaling)
    unsplit_opt = SessionOptimizer([(f"{prefix}w_proj{suffix}", unsplit)], muon_scaling=scaling)
    split_opt = SessionOptimizer(
        [(f"{prefix}gate_proj{suffix}", gate), (f"{prefix}up_proj{suffix}", up)],
        muon_scaling=scaling,
    )
    assert len(fused_opt.muon_param_names) == 1 and len(split_opt.muon_param_names) == 2
    request = OptimStepRequest(muon=MuonParams(learning_rate=0.05, grad_clip_norm=0.0))
    for _ in range(3):
        grad = torch.randn(shape, generator=gen)
        fused.grad, unsplit.grad = grad.clone(), grad.clone()
        gate.grad, up.grad = grad[..., :half, :].clone(), grad[..., half:, :].clone()
        for optimizer in (fused_opt, unsplit_opt, split_opt):
            optimizer.step(request)
    torch.testing.assert_close(fused.detach(), torch.cat([gate, up], -2).detach())
    assert not torch.allclose(fused, unsplit, atol=1e-3)  # the split changes the update
