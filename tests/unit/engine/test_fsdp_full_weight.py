"""A full-weight session on two gloo ranks sharded with FSDP2 (engine/parallel/fsdp.py, what
`--trainer-ranks N` does with a full-weight session) computes what one LocalEngine does:
losses, metrics and first gradients within 1e-5 relative, weights after three AdamW and three
Muon steps on uneven batches within the tolerance test_sharded_full_weight.py explains; the
MoE model and a client's custom forward-backward likewise. Each rank holds about half of every
parameter, gradient and optimizer moment (within 1.1x of an even share, embedding included).
Checkpoints and persisted state are the one-process formats: from two ranks they resume on one
and back, and continue as one process continues. A session's end leaves every rank the base
model; a rank that dies fails the operation naming it, and the group loads again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_calls import forward_backward
from safetensors.torch import load_file, save_file
from test_sharded_full_weight import (
    BATCHES,
    HUGE,
    MOE,
    ONE,
    PER_LENGTH,
    REL,
    STEPS,
    UNEVEN,
    UNEVEN_WEIGHTS,
    WITH_MOE,
    _need,
    assert_runs_equal,
    checkpoint,
    custom_train,
    fresh,
    resumed,
    state,
    train,
)

from posttrain.config import BUILTIN_MODEL_DIR, BUILTIN_MODEL_ID, EngineConfig
from posttrain.engine.checkpoint import formats as weights
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.engine.hosts.messages import MeasureResourceFootprint, MeasureSessionFootprint
from posttrain.engine.hosts.ranks.trainer_group import TrainerGroupEngine
from posttrain.engine.interface import Headroom
from posttrain.errors import INTERNAL_ERROR, NonFiniteLoss, WorkerDied
from posttrain.service.scheduling.admission import plan_passes
from posttrain.types import MuonScaling, OperationKind

# Bucket overhead 0 (test_sharded_full_weight's PER_LENGTH): the ranks' shares of a batch
# take different numbers of buckets (and ONE leaves rank 1 without rows), so the padded,
# aligned bucket schedule is what keeps the FSDP2 collectives in step.
FSDP2 = EngineConfig(device="cpu", trainer_ranks=2, bucket_overhead_tokens=0)
helpers = sys.modules["test_sharded_full_weight"]


@pytest.fixture(scope="module")
def fsdp():
    engine = TrainerGroupEngine(FSDP2, WITH_MOE)
    yield engine
    engine.close()


@pytest.fixture
def uneven(monkeypatch):
    """The helpers' `train` runs UNEVEN's batches, and compares weights with its tolerance."""
    monkeypatch.setattr(helpers, "BATCHES", UNEVEN)
    monkeypatch.setattr(helpers, "WEIGHTS", UNEVEN_WEIGHTS)


def assert_even_shares(local, fsdp, resource: str, parts=("weights_bytes", "optimizer_bytes")):
    """Each rank holds its slice of every tensor: together exactly one process's bytes, each
    within 1.1x of half (the embedding, 26% of a Qwen3-0.6B, is split like any matrix)."""
    one = local.session_footprint("r", "f")
    ranks = fsdp.on_every_rank(MeasureSessionFootprint(resource, "f"))
    for part in parts:
        total = getattr(one, part)
        held = sum(getattr(r, part) for r in ranks)
        # Every rank keeps its own AdamW step counts (a 4-byte scalar per parameter).
        extra = 4 * len(local._session("r", "f")[1].optimizer.named_params)
        assert total <= held <= total + (extra if part == "optimizer_bytes" else 0), part
        assert total > 0, part
        assert all(getattr(r, part) <= 1.1 * total / 2 for r in ranks), part
    return one, ranks


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM], ids=["adamw", "muon"])
def test_fsdp2_ranks_train_what_one_process_does_holding_half_of_everything(
    fsdp, tmp_path, scaling, uneven
):
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    fresh(local, "r", scaling)
    resource = f"fsdp-{scaling}"
    fresh(fsdp, resource, scaling)
    # The same weights: loss, metrics and every per-token output within 1e-5 relative.
    for batch in UNEVEN:
        request = replace(batch, forward_only=True, return_loss_fn_outputs=True)
        got = forward_backward(fsdp, resource, "f", request)
        want = forward_backward(local, "r", "f", request)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
        assert got.metrics == pytest.approx(want.metrics, rel=1e-5)
        for got_row, want_row in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            assert got_row == pytest.approx(want_row, rel=1e-5, abs=1e-6)
    expected = train(local, "r", tmp_path / "local", scaling, steps=3)
    assert_runs_equal(train(fsdp, resource, tmp_path / "group", scaling, steps=3), expected)

    forward_backward(local, "r", "f", UNEVEN[0])
    forward_backward(fsdp, resource, "f", UNEVEN[0])
    one, ranks = assert_even_shares(
        local, fsdp, resource, ("weights_bytes", "optimizer_bytes", "gradient_bytes")
    )
    # The generator's copy, which sampling uses, is rank 0's alone.
    assert [r.generator_bytes for r in ranks] == [one.generator_bytes, 0]

    # A step that would overflow fails alike on every rank and changes nothing; the next
    # step equals one process's.
    for engine, name in ((local, "r"), (fsdp, resource)):
        with pytest.raises(NonFiniteLoss, match="unchanged"):
            engine.optim_step(name, "f", HUGE[scaling])
        engine.optim_step(name, "f", STEPS[scaling])
    want_weights = state(local, "r", tmp_path / "local", ("trainer",))["trainer"]
    parts = state(fsdp, resource, tmp_path / "group", ("trainer", "generator"))
    assert all(
        float((parts["trainer"][n] - w).abs().max()) <= UNEVEN_WEIGHTS
        for n, w in want_weights.items()
    )

    # weights-sync streams the shards into the generator's copy: exactly the trained weights.
    fsdp.publish(resource, "f", version=1)
    parts = state(fsdp, resource, tmp_path / "group", ("trainer", "generator"))
    served = {n.replace(".base.", "."): t for n, t in parts["generator"].items()}
    assert served.keys() == parts["trainer"].keys()
    assert all(torch.equal(served[n], t) for n, t in parts["trainer"].items())
    fsdp.unload_resource(resource)


def test_fsdp2_custom_forward_backward_trains_what_one_process_does(fsdp, tmp_path, uneven):
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    fresh(local, "r", None)
    expected_forwards, expected = custom_train(local, "r", tmp_path / "local")
    fresh(fsdp, "custom", None)
    forwards, actual = custom_train(fsdp, "custom", tmp_path / "group")
    for got, want in zip(forwards, expected_forwards, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=REL)
        assert got.metrics == pytest.approx(want.metrics, rel=REL)
        for got_row, want_row in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            assert got_row == pytest.approx(want_row, rel=REL)
    assert_runs_equal(actual, expected)
    fsdp.unload_resource("custom")


def test_fsdp2_trains_an_moe_model_as_one_process_does(fsdp):
    """The MoE model's fused 3-D experts shard on their expert dim like any parameter."""
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    for engine in (local, fsdp):
        engine.load_resource("moe", MOE, muon_scaling=MuonScaling.MATCH_ADAM)
        engine.create_session("moe", "f", None)
    for batch in UNEVEN:
        want = forward_backward(local, "moe", "f", batch).loss
        assert forward_backward(fsdp, "moe", "f", batch).loss == pytest.approx(want, rel=REL)
        for engine in (local, fsdp):
            engine.optim_step("moe", "f", STEPS[MuonScaling.MATCH_ADAM])
    want = forward_backward(local, "moe", "f", ONE).loss
    assert forward_backward(fsdp, "moe", "f", ONE).loss == pytest.approx(want, rel=REL)
    ranks = fsdp.on_every_rank(MeasureSessionFootprint("moe", "f"))
    one = local.session_footprint("moe", "f")
    assert sum(r.weights_bytes for r in ranks) == one.weights_bytes
    assert all(r.weights_bytes <= 1.1 * one.weights_bytes / 2 for r in ranks)
    fsdp.unload_resource("moe")


@pytest.mark.parametrize("scaling", [None, MuonScaling.MATCH_ADAM], ids=["adamw", "muon"])
def test_fsdp2_checkpoints_resume_on_one_process_and_back(fsdp, tmp_path, scaling, uneven):
    """Two ranks write what one process writes; a checkpoint from two ranks resumes on one
    (2 -> 1) and on two (2 -> 2), one from one process on two (1 -> 2), each continuing as one
    process does; persisted live state (gradients included) restores across the same; the
    session's end leaves every rank the whole base model, as one process."""
    resource = f"ckpt-{scaling}"
    fresh(fsdp, resource, scaling)
    train(fsdp, resource, tmp_path / "a", scaling, steps=2)
    from_two = checkpoint(fsdp, resource, tmp_path / "from-two")
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    fresh(local, "r", scaling)
    train(local, "r", tmp_path / "b", scaling, steps=2)
    from_one = checkpoint(local, "r", tmp_path / "from-one")
    two, one = weights.load_training_state(from_two), weights.load_training_state(from_one)
    assert two.tensors.keys() == one.tensors.keys()
    for family in one.optimizer:
        assert two.optimizer[family].keys() == one.optimizer[family].keys()
        for name, entry in one.optimizer[family].items():
            assert entry.keys() == two.optimizer[family][name].keys()
    for directory in (from_two, from_one):
        root = tmp_path / directory.name
        expected = resumed(local, "r", directory, root / "1", scaling)
        actual = resumed(fsdp, resource, directory, root / "2", scaling)
        assert_runs_equal(actual, expected)

    # Live state with accumulated gradients, persisted by two ranks, restored on one and back.
    forward_backward(fsdp, resource, "f", BATCHES[0])
    parts = ("trainer", "generator", "optimizer", "gradients")
    persisted = tmp_path / "live"
    fsdp.persist_session(resource, "f", persisted, parts, {"step": 4})
    local.drop_session("r", "f")
    fresh(local, "r", scaling)
    assert local.restore_session("r", "f", persisted, version=4) == {"step": 4}
    fsdp.drop_session(resource, "f")
    fresh(fsdp, resource, scaling)
    fsdp.restore_session(resource, "f", persisted, version=4)
    for engine, name in ((local, "r"), (fsdp, resource)):
        engine.optim_step(name, "f", STEPS[scaling])
    want = state(local, "r", tmp_path / "l", ("trainer",))["trainer"]
    got = state(fsdp, resource, tmp_path / "g", ("trainer",))["trainer"]
    assert all(float((got[n] - w).abs().max()) <= UNEVEN_WEIGHTS for n, w in want.items())

    fsdp.drop_session(resource, "f")
    local.drop_session("r", "f")
    assert (
        fsdp.on_every_rank(MeasureResourceFootprint(resource))
        == [local.resource_footprint("r")] * 2
    )
    # A new session on the resource starts from the base model again.
    fresh(fsdp, resource, scaling)
    fresh(local, "r", scaling)
    want = forward_backward(local, "r", "f", ONE).loss
    assert forward_backward(fsdp, resource, "f", ONE).loss == pytest.approx(want, rel=REL)
    fsdp.unload_resource(resource)


def test_a_rank_that_dies_fails_the_operation_naming_it_and_the_group_restarts(fsdp):
    fresh(fsdp, "dies", None)
    first = fsdp.rank_pids("dies")
    os.kill(first[1], signal.SIGKILL)
    with pytest.raises(
        WorkerDied, match="rank 1 of the trainer group of model resource dies"
    ) as failure:
        forward_backward(fsdp, "dies", "f", ONE)
    assert failure.value.error_code == INTERNAL_ERROR
    assert not fsdp.is_loaded("dies")
    fresh(fsdp, "dies", None)
    assert not set(fsdp.rank_pids("dies")) & set(first)
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    fresh(local, "r", None)
    want = forward_backward(local, "r", "f", ONE).loss
    assert forward_backward(fsdp, "dies", "f", ONE).loss == pytest.approx(want, rel=REL)
    fsdp.unload_resource("dies")


def test_a_memory_limit_that_refuses_a_full_weight_step_on_one_process_admits_it_on_fsdp2(
    fsdp,
):
    """Memory admission with the real estimates (peak_bytes, resource_footprint): what an
    FSDP2 rank holds (its slices) and gathers (the root, a layer and the prefetched next) is
    under 0.85x of one process's need for the first optim-step and for a forward-backward, so
    a limit between the two refuses one process and admits the group (on rank 0's
    numbers)."""
    local = LocalEngine(PER_LENGTH, WITH_MOE)
    fresh(local, "r", None)
    fresh(fsdp, "admit", None)
    operations = (
        (OperationKind.OPTIM_STEP, STEPS[None]),
        (OperationKind.FORWARD_BACKWARD, BATCHES[0]),
    )
    for kind, request in operations:
        one, rank = _need(local, "r", kind, request), _need(fsdp, "admit", kind, request)
        # Measured 0.80 for the forward-backward: the tiny model's embedding (in the root,
        # gathered in full with its full gradient for the whole operation) is most of it.
        assert sum(rank) < 0.85 * sum(one), (kind, one, rank)
        limit = (sum(one) + sum(rank)) // 2
        for engine, resource, (resident, _), admitted in (
            (local, "r", one, False),
            (fsdp, "admit", rank, True),
        ):
            room = Headroom(limit - resident, "--memory-limit")
            passes, refused = plan_passes(
                kind,
                ["f"],
                lambda members, e=engine, r=resource, k=kind, q=request: e.peak_bytes(
                    r, k, [(m, q) for m in members]
                ),
                room,
            )
            assert (passes == [["f"]]) is admitted and (0 in refused) is not admitted, kind
    fsdp.unload_resource("admit")


def test_an_embedding_subclass_is_a_gathered_unit_and_trains_as_one_process_does(tmp_path, uneven):
    """Gemma 3's embedding scales its rows inside the module (a subclass of nn.Embedding), so
    it is not looked up on the ranks' vocabulary rows as a plain one is: it is a unit gathered
    for its forward (not again for its backward, which never reads it). Untied, it trains and
    checkpoints as one process does."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
    import families

    extra = {"tie_word_embeddings": False}
    directory = families.build("gemma3_text", tmp_path / "gemma3", extra=extra)
    embedding = families.model("gemma3_text", extra=extra).get_input_embeddings()
    assert type(embedding) is not torch.nn.Embedding  # the case this test is about
    expected = _trains_as_one_process(tmp_path, directory)
    assert any("embed_tokens" in name for name in expected[0][1])


def _trains_as_one_process(tmp_path, directory, check=lambda local, group: None) -> list:
    """Two Muon steps of a full-weight session on the model in `directory`, on one process and
    on two FSDP2 ranks, equal (assert_runs_equal); then `check(local, group)`. One process's
    run."""
    models = {BUILTIN_MODEL_ID: directory}
    local = LocalEngine(PER_LENGTH, models)
    group = TrainerGroupEngine(FSDP2, models)
    try:
        fresh(local, "r", MuonScaling.MATCH_ADAM)
        fresh(group, "r", MuonScaling.MATCH_ADAM)
        expected = train(local, "r", tmp_path / "local", MuonScaling.MATCH_ADAM, steps=2)
        actual = train(group, "r", tmp_path / "group", MuonScaling.MATCH_ADAM, steps=2)
        assert_runs_equal(actual, expected)
        check(local, group)
        return expected
    finally:
        group.close()


def test_a_tied_embedding_shards_in_the_root_and_trains_as_one_process_does(tmp_path, uneven):
    """A model whose head is its input embedding (Qwen3-0.6B's layout): the one tensor stays
    in the root unit, shards like any other, and trains and checkpoints as one process."""
    tied = tmp_path / "tied"
    shutil.copytree(BUILTIN_MODEL_DIR, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]  # the head is the embedding now
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})

    def halves(local, group) -> None:
        one = local.session_footprint("r", "f")
        ranks = group.on_every_rank(MeasureSessionFootprint("r", "f"))
        assert sum(r.weights_bytes for r in ranks) == one.weights_bytes
        assert all(r.weights_bytes <= 1.1 * one.weights_bytes / 2 for r in ranks)

    expected = _trains_as_one_process(tmp_path, tied, halves)
    assert not any("lm_head" in name for name in expected[0][2])  # one tensor, one name


def test_a_gated_deltanet_hybrid_trains_on_fsdp2_ranks_as_one_process_does(tmp_path, uneven):
    """Qwen3-Next (linear-attention and gated-attention layers, a shared-expert MoE): its
    linear layers' parameters (conv, A_log, dt_bias, fused projections) shard like any other."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "model"))
    import families

    directory = families.build("qwen3_next", tmp_path / "qwen3_next")
    _trains_as_one_process(tmp_path, directory)
