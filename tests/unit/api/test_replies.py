"""The reply models render the JSON the SDK 3.1.1 got before they did, byte for byte:
golden_replies.json holds that JSON as literal text for the records of reply_cases.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.api.kinds import WIRE_KINDS
from posttrain.api.responses import error_response, json_bytes, page
from posttrain.api.routes.supported_models import supported_model
from posttrain.api.schemas import objects as o
from posttrain.config import SamplerConfig
from tests.unit.api import reply_cases as cases

GOLDEN: dict[str, str] = json.loads((Path(__file__).parent / "golden_replies.json").read_text())


def dumps(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"), allow_nan=False)


def rendered() -> dict[str, str]:
    out = {name: dumps(o.ModelResources.of(r).wire()) for name, r in cases.RESOURCES.items()}
    out |= {name: dumps(o.Session.of(s).wire()) for name, s in cases.SESSIONS.items()}
    out |= {name: dumps(o.Checkpoint.of(c).wire()) for name, c in cases.CHECKPOINTS.items()}
    out |= {
        name: json_bytes(WIRE_KINDS[op.kind].reply.of(op)).decode()
        for name, op in cases.OPERATIONS.items()
    }
    items = [o.ModelResources.of(r) for r in cases.RESOURCES.values()]
    lists = o.ModelResourcesList
    out["page_first"] = dumps(page(lists, items, limit=2, after=None))
    out["page_last"] = dumps(page(lists, items, limit=2, after="mr-2"))
    out["page_unknown_cursor"] = dumps(page(lists, items, limit=2, after="nope"))
    out["page_empty"] = dumps(page(lists, [], limit=20, after=None))
    out["error_envelope"] = bytes(
        error_response(400, "invalid_request_error", "bad", "field").body
    ).decode()
    out["error_envelope_no_param"] = bytes(
        error_response(401, "authentication_error", "no key", None).body
    ).decode()
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_reply_renders_the_golden_json(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a value the model's type does not expect
        assert rendered()[name] == GOLDEN[name]


def test_every_case_has_a_golden() -> None:
    assert sorted(rendered()) == sorted(GOLDEN)


def test_ints_stay_ints_and_floats_keep_their_text() -> None:
    session = json.loads(GOLDEN["session_lora_wandb_reordered"])
    assert (
        session["lora_config"]["alpha"] == 16
        and '"alpha":16,' in GOLDEN["session_lora_wandb_reordered"]
    )
    assert '"loss":1e-05' in GOLDEN["op_forward_backward"]
    assert '"num_tokens":12}' in GOLDEN["op_forward_backward"]


def test_supported_model() -> None:
    info = SimpleNamespace(
        context_length=4096, max_batch_size=8, max_seq_length=2048, max_lora_rank=64
    )
    body = o.SupportedModels.model_construct(
        data=[supported_model("m", info, SamplerConfig(max_tokens=50), "cpu")]
    ).wire()
    assert dumps(body) == (
        '{"data":[{"base_model":"m","default_gpu_type":"B200-SXM","compute_configs":[{'
        '"gpu_type":"B200-SXM","device":"cpu","generator_config":{"context_length":4096,'
        '"sampling_defaults":{"logprobs":1,"max_tokens":50,"n":1,"temperature":1.0}},'
        '"trainer_config":{"full":{"max_batch_size":8,"max_seq_length":2048},'
        '"lora":{"max_batch_size":8,"max_seq_length":2048,"max_rank":64}}}]}]}'
    )


def test_small_objects() -> None:
    whoami = o.Whoami.model_construct(type="user_jwt", user=o.WhoamiUser.model_construct(id="u"))
    assert dumps(whoami.wire()) == '{"type":"user_jwt","user":{"id":"u"}}'
    files = [o.CheckpointFile.model_construct(filename="a.bin", size=3, url="http://x")]
    assert dumps(o.CheckpointDownload.model_construct(data=files).wire()) == (
        '{"data":[{"filename":"a.bin","size":3,"url":"http://x"}]}'
    )
    cost = o.EstimateCost.model_construct(currency="USD", price_per_hour=0.0)
    assert dumps(cost.wire()) == '{"currency":"USD","price_per_hour":0.0}'
    stored = o.PayloadStored.model_construct(payload_id="p", size=2)
    assert dumps(stored.wire()) == '{"payload_id":"p","size":2}'
    upload = o.UploadUrl.model_construct(payload_id="p", upload_url="u")
    assert dumps(upload.wire()) == '{"payload_id":"p","upload_url":"u"}'
    assert dumps(o.DownloadUrl.model_construct(download_url="d").wire()) == '{"download_url":"d"}'
