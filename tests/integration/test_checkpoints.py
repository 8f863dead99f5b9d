"""Optimizers wired to model resources, and checkpoints, through the official SDK: save, list,
download (PEFT adapter and merged model), exact resume after a server restart, resume errors,
and the tinker shim's resume path."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch
from helpers import API_KEY, BASE_MODEL, low_level, open_session, sft_sample
from safetensors.torch import load_file
from together import BadRequestError, NotFoundError, Together
from together.post_training import ModelResourcesClient, download_checkpoint
from transformers import AutoModelForCausalLM

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
BATCH = [
    sft_sample([5, 17, 23, 9, 41, 7, 0], 3),
    sft_sample([12, 30, 8, 44, 19, 0], 2),
    sft_sample([60, 61, 62, 63, 64, 65, 66, 0], 4),
]
PROBE_TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
PROBE = [sft_sample(PROBE_TOKENS, 1)]  # every position weighted: logprobs all reported
ADAM = {"adam_params": {"learning_rate": 2e-2, "weight_decay": 0.0}}
MUON = {"muon_params": {"learning_rate": 2e-2}}
MUON_CONFIG = {"muon": {"scaling_strategy": "MUON_SCALING_STRATEGY_MATCH_ADAM"}}
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def train_step(session, params: dict) -> float:
    loss = session.trainer.forward_backward(samples=BATCH, loss=CE).loss
    session.trainer.optim_step(**params)
    return loss


def probe_logprobs(session) -> list[float]:
    """Forward-only logprobs of a fixed sequence: equal iff the served weights are equal."""
    result = session.trainer.forward(samples=PROBE, loss=CE)
    return list(result.loss_fn_outputs[0].tensors["logprobs"].data)


def merged_logprobs(directory) -> torch.Tensor:
    """Logprobs of the probe under a downloaded model directory, loaded by plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROBE_TOKENS[:-1]])).logits[0].float()
    targets = torch.tensor(PROBE_TOKENS[1:])
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def open_resources(base_url: str, optimizer_config: dict | None = None) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        base_url=base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        optimizer_config=optimizer_config,
        interval=0.2,
    )


# ---------------------------------------------------------------- optimizers


def test_muon_resource_trains_echoes_its_config_and_rejects_adam_params(shared_server):
    resources = open_resources(shared_server.base_url, MUON_CONFIG)
    optimizer = resources.retrieve().optimizer_config
    assert optimizer.muon.scaling_strategy == "MUON_SCALING_STRATEGY_MATCH_ADAM"
    assert optimizer.adam is None
    session = resources.create_session(lora_config={"rank": 4, "seed": 1}, interval=0.2)
    losses = [train_step(session, MUON) for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses
    before = probe_logprobs(session)
    with pytest.raises(BadRequestError) as info:
        session.trainer.optim_step(adam_params={"learning_rate": 1e-2})
    assert info.value.body["error"]["param"] == "adam_params"
    with pytest.raises(BadRequestError) as info:  # the seed-era shape folds into adam_params
        low_level(shared_server.base_url).post_training.operations.optim_step(
            session.session_id,
            idempotency_key=str(uuid.uuid4()),
            extra_body={"learning_rate": 1e-3},
        )
    assert info.value.body["error"]["param"] == "adam_params"
    assert session.retrieve().step == 8
    assert probe_logprobs(session) == before
    session.stop()
    resources.stop()


def test_adam_resource_rejects_muon_params_and_changes_nothing(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 2})
    assert resources.retrieve().optimizer_config.adam is not None
    session.trainer.forward_backward(samples=BATCH, loss=CE)
    with pytest.raises(BadRequestError) as info:
        session.trainer.optim_step(muon_params={"learning_rate": 1e-2})
    assert info.value.body["error"]["param"] == "muon_params"
    assert session.retrieve().step == 0
    session.stop()
    resources.stop()


def test_optim_step_without_gradients_increments_step_and_keeps_weights(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 3})
    train_step(session, ADAM)
    before = probe_logprobs(session)
    assert session.trainer.optim_step(**ADAM).step == 2
    assert session.trainer.optim_step().step == 3
    assert probe_logprobs(session) == before
    state = session.retrieve()
    assert state.step == 3 and state.policy_state.trainer_step == 3
    session.stop()
    resources.stop()


# ---------------------------------------------------------------- checkpoints API


def test_checkpoints_are_recorded_listed_and_retrieved(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 4})
    sid = session.session_id
    client = low_level(shared_server.base_url).post_training
    train_step(session, ADAM)
    training = session.create_training_checkpoint()
    train_step(session, ADAM)
    inference = session.create_inference_checkpoint()
    assert (training.step, inference.step) == (1, 2)
    record = session.retrieve()
    assert [(c.id, c.step) for c in record.training_checkpoints] == [(training.id, 1)]
    assert [(c.id, c.step) for c in record.inference_checkpoints] == [(inference.id, 2)]

    listed = client.checkpoints.list(session_id=sid)
    assert [c.id for c in listed.data] == [inference.id, training.id]  # newest first
    assert [c.type for c in listed.data] == [
        "CHECKPOINT_TYPE_INFERENCE",
        "CHECKPOINT_TYPE_TRAINING",
    ]
    assert all(c.lora_rank == 4 and c.base_model == BASE_MODEL for c in listed.data)
    assert all(c.session_id == sid for c in listed.data)
    only = client.checkpoints.list(session_id=sid, type="CHECKPOINT_TYPE_TRAINING")
    assert [c.id for c in only.data] == [training.id]
    assert client.checkpoints.list(session_id=sid, base_model="other/model").data == []
    first = client.checkpoints.list(session_id=sid, limit=1)
    assert [c.id for c in first.data] == [inference.id] and first.meta.has_more
    rest = client.checkpoints.list(session_id=sid, limit=1, after=first.meta.next_cursor)
    assert [c.id for c in rest.data] == [training.id] and not rest.meta.has_more
    response = httpx.get(
        f"{shared_server.base_url}/v1/rl/checkpoints",
        params={"type": "CHECKPOINT_TYPE_UNSPECIFIED"},
        headers=HEADERS,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "type"

    fetched = client.checkpoints.retrieve(training.id)
    assert (fetched.type, fetched.step, fetched.lora_rank) == ("CHECKPOINT_TYPE_TRAINING", 1, 4)
    with pytest.raises(NotFoundError):
        client.checkpoints.retrieve("ckpt-doesnotexist")
    session.stop()
    resources.stop()


def test_checkpoint_operations_need_an_idempotency_key_and_take_no_body(shared_server):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 5})
    sid = session.session_id
    client = low_level(shared_server.base_url).post_training
    key = str(uuid.uuid4())
    first = client.operations.create_training_checkpoint(sid, idempotency_key=key)
    again = client.operations.create_training_checkpoint(sid, idempotency_key=key)
    assert again.id == first.id
    url = f"{shared_server.base_url}/v1/rl/training-sessions/{sid}/operations/inference-checkpoint"
    assert httpx.post(url, headers=HEADERS).status_code == 400  # no Idempotency-Key
    with_body = httpx.post(
        url, headers={**HEADERS, "Idempotency-Key": "k1"}, content=json.dumps({"name": "x"})
    )
    assert with_body.status_code == 400 and with_body.json()["error"]["param"] == "name"
    session.trainer.forward(samples=PROBE, loss=CE)  # runs after the checkpoint: it is done
    assert len(session.retrieve().training_checkpoints) == 1
    assert session.retrieve().inference_checkpoints == []
    session.stop()
    resources.stop()


def test_downloads_give_a_peft_adapter_and_a_merged_model_equal_to_the_served_one(
    shared_server, tmp_path
):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 6})
    for _ in range(3):
        train_step(session, ADAM)
    served = probe_logprobs(session)
    training = session.create_training_checkpoint()
    inference = session.create_inference_checkpoint()
    sdk = Together(base_url=shared_server.base_url, api_key=API_KEY, max_retries=0)
    client = sdk.post_training
    for variant, checkpoint_id in (
        ("CHECKPOINT_VARIANT_ADAPTER", training.id),  # training checkpoints: not downloadable
        ("CHECKPOINT_VARIANT_UNSPECIFIED", inference.id),
    ):
        with pytest.raises(BadRequestError):
            client.checkpoints.download(id=checkpoint_id, variant=variant)
    response = httpx.get(
        f"{shared_server.base_url}/v1/rl/checkpoints/{inference.id}/download", headers=HEADERS
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "variant"

    adapter = download_checkpoint(
        sdk, inference.id, variant="CHECKPOINT_VARIANT_ADAPTER", output_dir=tmp_path / "adapter"
    )
    assert sorted(p.name for p in adapter) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == (
        "LORA",
        4,
        BASE_MODEL,
    )
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors

    merged = download_checkpoint(
        sdk, inference.id, variant="CHECKPOINT_VARIANT_MERGED", output_dir=tmp_path / "merged"
    )
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in merged}
    assert (merged_logprobs(tmp_path / "merged") - torch.tensor(served)).abs().max() <= 1e-5

    listing = client.checkpoints.download(id=inference.id, variant="CHECKPOINT_VARIANT_MERGED")
    signed = listing.data[0].url
    assert signed.startswith("/v1/rl/checkpoints/") and "sig=" in signed
    tampered = signed.replace("sig=", "sig=0")
    assert httpx.get(f"{shared_server.base_url}{tampered}").status_code == 404
    assert httpx.get(f"{shared_server.base_url}{signed}").status_code == 200
    session.stop()
    resources.stop()


def test_full_weight_checkpoints_download_merged_and_resume(shared_server, tmp_path):
    resources = ModelResourcesClient.create(
        base_url=shared_server.base_url,
        api_key=API_KEY,
        base_model=BASE_MODEL,
        lora_enabled=False,
        interval=0.2,
    )
    session = resources.create_session(interval=0.2)
    for _ in range(2):
        train_step(session, ADAM)
    served = probe_logprobs(session)
    training = session.create_training_checkpoint()
    inference = session.create_inference_checkpoint()
    sdk = Together(base_url=shared_server.base_url, api_key=API_KEY, max_retries=0)
    listed = sdk.post_training.checkpoints.retrieve(inference.id)
    assert listed.lora_rank is None and listed.step == 2
    with pytest.raises(BadRequestError) as info:
        sdk.post_training.checkpoints.download(
            id=inference.id, variant="CHECKPOINT_VARIANT_ADAPTER"
        )
    assert info.value.body["error"]["param"] == "variant"
    download_checkpoint(sdk, inference.id, output_dir=tmp_path)  # MERGED is the default
    assert (merged_logprobs(tmp_path) - torch.tensor(served)).abs().max() <= 1e-5
    session.stop()  # a full-weight resource hosts one session at a time

    resumed = resources.create_session(resume_from_checkpoint_id=training.id, interval=0.2)
    assert resumed.retrieve().step == 2
    assert probe_logprobs(resumed) == served
    resumed.stop()
    resources.stop()


# ---------------------------------------------------------------- resume


def test_resume_errors_name_their_reason_and_inference_checkpoints_load_weights_only(
    shared_server,
):
    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 7})
    train_step(session, ADAM)
    training = session.create_training_checkpoint()
    inference = session.create_inference_checkpoint()
    served = probe_logprobs(session)
    with pytest.raises(NotFoundError):
        resources.create_session(resume_from_checkpoint_id="ckpt-doesnotexist")
    with pytest.raises(BadRequestError) as info:
        resources.create_session(resume_from_checkpoint_id=inference.id, load_optimizer=True)
    assert info.value.body["error"]["param"] == "load_optimizer"
    with pytest.raises(BadRequestError) as info:
        resources.create_session(resume_from_checkpoint_id=training.id, lora_config={"rank": 8})
    assert info.value.body["error"]["param"] == "lora_config.rank"
    muon = open_resources(shared_server.base_url, MUON_CONFIG)
    with pytest.raises(BadRequestError) as info:  # AdamW state cannot feed Muon
        muon.create_session(resume_from_checkpoint_id=training.id)
    assert info.value.body["error"]["param"] == "load_optimizer"
    weights_only = muon.create_session(
        resume_from_checkpoint_id=training.id, load_optimizer=False, interval=0.2
    )
    assert probe_logprobs(weights_only) == served
    weights_only.stop()
    muon.stop()

    resumed = resources.create_session(resume_from_checkpoint_id=inference.id, interval=0.2)
    state = resumed.retrieve()
    assert (state.step, state.resume_from_checkpoint_id) == (0, inference.id)
    assert state.lora_config.rank == 4 and state.lora_config.alpha == 16
    assert probe_logprobs(resumed) == served
    # The generator serves the resumed weights, as policy version 0, without a weights-sync.
    sample = resumed.generator.sample(
        {"chunks": [{"encoded_text": {"tokens": PROBE_TOKENS}}]},
        sampling_params={"max_tokens": 1, "temperature": 0.0},
        prompt_logprobs=True,
    )
    assert sample.policy_segments[0].version == 0
    generated = torch.tensor(sample.prompt_logprobs[1:])
    assert (generated - torch.tensor(served)).abs().max() <= 1e-5
    resumed.stop()
    session.stop()
    resources.stop()


def test_resume_after_a_restart_reproduces_training_bit_for_bit(server):
    """Train 3 steps, checkpoint, train 3 more; after a restart, resuming from the checkpoint
    and training the same 3 steps gives identical losses and weights (Adam and Muon)."""
    runs = {}
    for name, optimizer_config, params in (("adam", None, ADAM), ("muon", MUON_CONFIG, MUON)):
        resources = open_resources(server.base_url, optimizer_config)
        session = resources.create_session(lora_config={"rank": 4, "seed": 11}, interval=0.2)
        for _ in range(3):
            train_step(session, params)
        checkpoint = session.create_training_checkpoint()
        assert checkpoint.step == 3
        losses = [train_step(session, params) for _ in range(3)]
        logprobs = probe_logprobs(session)
        runs[name] = (resources.model_resources_id, checkpoint.id, params, losses, logprobs)

    server.stop()
    server.start()

    for name, (resources_id, checkpoint_id, params, losses, logprobs) in runs.items():
        resources = ModelResourcesClient.attach(
            model_resources_id=resources_id, base_url=server.base_url, api_key=API_KEY
        )
        resumed = resources.create_session(
            resume_from_checkpoint_id=checkpoint_id, load_optimizer=True, interval=0.2
        )
        state = resumed.retrieve()
        assert (state.step, state.policy_state.trainer_step) == (3, 0), name
        assert state.resume_from_checkpoint_id == checkpoint_id
        assert state.lora_config.rank == 4
        assert [train_step(resumed, params) for _ in range(3)] == losses, name
        assert probe_logprobs(resumed) == logprobs, name
        assert resumed.retrieve().step == 6

        fresh_optimizer = resources.create_session(
            resume_from_checkpoint_id=checkpoint_id, load_optimizer=False, interval=0.2
        )
        assert fresh_optimizer.retrieve().step == 0
        other = [train_step(fresh_optimizer, params) for _ in range(3)]
        assert other[0] == losses[0], name  # the same weights before the first update
        assert other[1:] != losses[1:], name  # a fresh optimizer state updates differently
        assert probe_logprobs(fresh_optimizer) != logprobs


def test_tinker_shim_resumes_a_training_checkpoint_with_its_optimizer(shared_server):
    import together.post_training.tinker as tinker

    resources, session = open_session(shared_server.base_url, lora_config={"rank": 4, "seed": 8})
    service = tinker.ServiceClient(
        base_url=shared_server.base_url,
        api_key=API_KEY,
        model_resources_id=resources.model_resources_id,
    )
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4)
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(PROBE_TOKENS[:-1]),
            loss_fn_inputs={
                "target_tokens": PROBE_TOKENS[1:],
                "weights": [1.0] * (len(PROBE_TOKENS) - 1),
            },
        )
    ]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = training.save_state("after-one-step").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path)

    def logprobs(client) -> list[float]:
        return list(
            client.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
        )

    assert logprobs(resumed) == logprobs(training)
    state = low_level(shared_server.base_url).post_training.sessions.retrieve(
        resumed._session.session_id
    )
    assert (state.step, state.resume_from_checkpoint_id, state.lora_config.rank) == (1, path, 4)
    resumed.close()
    training.close()
    session.stop()
    resources.stop()
