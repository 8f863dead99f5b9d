"""The wire's gpu_type literals name real devices only where one fits (api.md 7.9), and a list's
`status` filter refuses values outside its enum (api.md 0.4)."""

from __future__ import annotations

import pytest

from posttrain.api.schemas.objects import resource_gpu_type
from posttrain.api.schemas.sessions import status_filter
from posttrain.errors import InvalidRequest
from posttrain.statuses import ResourceStatus, SessionStatus


@pytest.mark.parametrize(
    ("device", "literal"),
    [
        ("NVIDIA B200", "B200-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 NVL", None),  # 94 GB: not the SDK's H100-80GB
        ("NVIDIA H200", None),
        ("cpu", None),
    ],
)
def test_resource_gpu_type_is_the_sdk_literal_naming_the_device_or_none(device, literal):
    assert resource_gpu_type(device) == literal


def test_status_filter_splits_commas_and_repeated_keys():
    values = [
        "MODEL_RESOURCES_STATUS_READY,MODEL_RESOURCES_STATUS_PENDING",
        "MODEL_RESOURCES_STATUS_ERROR",
    ]
    assert status_filter(values, ResourceStatus) == {
        "MODEL_RESOURCES_STATUS_READY",
        "MODEL_RESOURCES_STATUS_PENDING",
        "MODEL_RESOURCES_STATUS_ERROR",
    }


def test_status_filter_absent_or_empty_means_every_status():
    assert status_filter(None, SessionStatus) is None
    assert status_filter([""], SessionStatus) is None


@pytest.mark.parametrize(
    "values",
    [
        ["TRAINING_SESSION_STATUS_RUNNING,running"],
        ["MODEL_RESOURCES_STATUS_READY"],  # a resource status on the sessions list
        ["TRAINING_SESSION_STATUS_UNSPECIFIED"],
    ],
)
def test_status_filter_refuses_unknown_values_naming_the_field(values):
    with pytest.raises(InvalidRequest) as refused:
        status_filter(values, SessionStatus)
    assert refused.value.param == "status"
