"""The generator side of a model resource: what each session's generator serves, publishing the
trainer's weights to it, and running sample operations through the decode loop (sampler.py).

A LoRA session's generator is a second adapter on the shared model (`<session>@generator`);
a full-weight session's is its own frozen copy of the model (train/full_weight.py). Each
generator serves a WeightsVersion: a generation that changes on every publish (it keys the
prefix cache, so stale prompt KV never hits) and the policy version of those weights
(api.md 2.4), which the decode loop reads live so a PIPELINE weights-sync between decode passes
takes effect at the next token.

Not here: the trainer's weights and gradients (train/trainer.py) and which sessions exist
(hosts/in_process.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import cast

from torch import Tensor, nn
from transformers import PreTrainedModel

from posttrain.config import EngineConfig
from posttrain.engine.checkpoint.formats import copy_into
from posttrain.engine.generate.joins import GenerationRequest
from posttrain.engine.generate.prefill import GeneratorModel
from posttrain.engine.generate.sampler import generate
from posttrain.engine.state import ResourceState, SessionState, WeightsVersion
from posttrain.engine.train import full_weight
from posttrain.types import SampleRequest, SampleResult


def generator_key(session_id: str) -> str:
    """The adapter key (and prefix-cache owner) of a session's generator."""
    return f"{session_id}@generator"


def served(resource: ResourceState, session: SessionState) -> WeightsVersion:
    """What the session's generator serves; a new session serves policy version 0."""
    key = session.generator_key
    if key not in resource.served:
        resource.served[key] = WeightsVersion(next(resource.generations), 0)
    return resource.served[key]


def refresh(resource: ResourceState, session: SessionState) -> None:
    """The generator serves a copy of the trainer's current weights (same policy version)."""
    if session.is_full_weight and resource.param_shards is not None:
        # Each parameter's slices gathered into rank 0's copy (parallel/fsdp.py).
        resource.param_shards.publish(resource.loaded.model, session.generator_model)
    elif session.generator_model is not None:
        full_weight.publish(resource.loaded.model, session.generator_model)
    else:
        resource.lora.copy_adapter(session.trainer_key, session.generator_key)
    # New weights, new generation: no prefix-cache entry of the old weights can hit again.
    version = served(resource, session).version
    resource.served[session.generator_key] = WeightsVersion(next(resource.generations), version)
    resource.prefix_cache.drop_owner(session.generator_key)


def publish(resource: ResourceState, session: SessionState, *, version: int) -> None:
    """weights-sync: the generator's weights become a copy of the trainer's, which are
    policy version `version` (api.md 2.4). Safe between decode passes (PIPELINE)."""
    refresh(resource, session)
    resource.served[session.generator_key] = replace(served(resource, session), version=version)


def forget(resource: ResourceState, session: SessionState) -> None:
    """A dropped session's generator serves nothing and holds no cached prompt KV."""
    resource.served.pop(session.generator_key, None)
    resource.prefix_cache.drop_owner(session.generator_key)


def parameters(resource: ResourceState, session: SessionState) -> list[tuple[str, nn.Parameter]]:
    """What the session's generator serves: its adapter, or a full-weight session's model."""
    if session.generator_model is not None:
        return list(session.generator_model.named_parameters())
    if session.has_no_generator:  # a sharded session's rank other than 0: rank 0 has the copy
        return []
    return list(resource.lora.adapter_parameters(session.generator_key))


def state(resource: ResourceState, session: SessionState) -> tuple[dict[str, Tensor], int]:
    """What the session's generator serves (its tensors, detached copies) and their policy
    version: what a generator replica installs (hosts/replicas/engine.py)."""
    tensors = {n: p.detach().clone() for n, p in parameters(resource, session)}
    return tensors, served(resource, session).version


def install(
    resource: ResourceState, session: SessionState, tensors: dict[str, Tensor], *, version: int
) -> None:
    """The session's generator serves these tensors (a trainer's `state`) as policy version
    `version`; a new generation, so no prefix-cache entry of the old weights hits again."""
    if not session.has_no_generator:
        copy_into(parameters(resource, session), tensors)
    resource.served[session.generator_key] = WeightsVersion(next(resource.generations), version)
    resource.prefix_cache.drop_owner(session.generator_key)


def sampling_model(resource: ResourceState, session: SessionState) -> PreTrainedModel:
    """The model sample runs (with the session's generator adapter routed, for LoRA)."""
    if session.generator_model is not None:
        # A full-weight session's generator is a copy of the loaded PreTrainedModel
        # (full_weight.generator_copy), or on a replica that model itself; SessionState holds
        # it as the nn.Module the trainer side sees.
        return cast(PreTrainedModel, session.generator_model)
    return resource.loaded.model


def sample_batch(
    config: EngineConfig,
    resource: ResourceState,
    items: list[tuple[SessionState, SampleRequest]],
    *,
    between_tokens: Callable[[], None] | None = None,
) -> list[list[SampleResult]]:
    """Several sample operations of one resource in one generation: their rows share prefill
    and decode passes, each routed to its session's generator adapter. Returns one list of
    results (one per prompt) per item."""
    models = {id(m): m for m in (sampling_model(resource, s) for s, _ in items)}
    assert len(models) == 1, "one generation runs on one model"
    model = generator_model(config, resource, next(iter(models.values())))
    requests: list[GenerationRequest] = []
    for session, request in items:
        served(resource, session)
        requests.extend(
            GenerationRequest(
                prompt,
                request.num_samples,
                request.sampling_params,
                session.generator_key,
                prompt_logprobs=request.prompt_logprobs,
                topk_prompt_logprobs=request.topk_prompt_logprobs,
                return_routed_experts=request.return_routed_experts,
                images=request.images_of(index),
            )
            for index, prompt in enumerate(request.prompts)
        )
    results = generate(model, requests, versions=resource.served, between_tokens=between_tokens)
    split: list[list[SampleResult]] = []
    for _, request in items:
        split.append(results[: len(request.prompts)])
        results = results[len(request.prompts) :]
    return split


def generator_model(
    config: EngineConfig, resource: ResourceState, model: PreTrainedModel
) -> GeneratorModel:
    """What the decode loop needs of the resource to sample `model` (sampling_model)."""
    loaded = resource.loaded
    return GeneratorModel(
        model=model,
        lora=resource.lora,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        prefix_cache=resource.prefix_cache,
        logprob_chunk_tokens=config.logprob_chunk_tokens,
        kv=loaded.kv,
        moe=loaded.moe,
        cuda_graphs=config.cuda_graphs,
        vision=loaded.vision,
    )
