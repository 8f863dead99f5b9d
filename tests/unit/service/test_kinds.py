"""The operation-kind table is whole and consistent: every kind is in each layer's half, and
a kind that changes durable session state is one a full-weight restart can replay."""

from __future__ import annotations

from posttrain.api.kinds import WIRE_KINDS
from posttrain.service.operations.kinds import KINDS, Sharing
from posttrain.types import OPERATION_TYPES, OperationKind


def test_every_kind_is_in_every_half_of_the_table():
    assert set(KINDS) == set(WIRE_KINDS) == set(OPERATION_TYPES) == set(OperationKind)
    for kind, rules in KINDS.items():
        assert rules.types is OPERATION_TYPES[kind], kind


def test_a_kind_that_changes_session_state_is_replayed_after_a_restart():
    for kind, rules in KINDS.items():
        assert (rules.changes(None) != ()) == (rules.replay is not None), kind
        # A kind that changes state never shares a pass with its own session's operations.
        assert not (rules.changes(None) and rules.sharing == Sharing.ANY), kind


def test_only_a_kind_that_runs_on_the_generator_leaves_the_trainer_alone():
    on_generator = {kind for kind, rules in KINDS.items() if rules.on_generator}
    assert on_generator == {OperationKind.SAMPLE}
    assert KINDS[OperationKind.SAMPLE].changes(None) == ()
