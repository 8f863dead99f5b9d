"""Single-process engine: owns loaded base models, each session's adapters and optimizer.

State is keyed by model resource and session. A resource's methods are called from that
resource's one worker thread (service/scheduler.py), so per-resource state needs no lock; the
resource table itself is guarded because resources come and go from other threads.

Each LoRA session has two adapters on its resource's model: the trainer's (what
forward-backward and optim-step change) and the generator's (what sample uses), which
weights-sync overwrites with a copy of the trainer's.

Legend: S = samples, T = tokens.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from posttrain.config import EngineConfig
from posttrain.engine.batching import PackedBatch, pack, unpack
from posttrain.engine.interface import ModelInfo
from posttrain.engine.logprobs import log_softmax_float32, target_logprobs
from posttrain.engine.losses import LOSSES, validate_loss_inputs
from posttrain.engine.optim import SessionOptimizer
from posttrain.engine.sampler import generate
from posttrain.errors import InvalidRequest, NonFiniteLoss, NotFound
from posttrain.model.loader import LoadedModel, load_model, resolve_device
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    MuonScaling,
    OptimStepRequest,
    PolicySegment,
    SampledSequence,
    SampleRequest,
    SampleResult,
    TopkPromptLogprobs,
)


@dataclass
class SessionState:
    trainer_key: str
    generator_key: str
    optimizer: SessionOptimizer


@dataclass
class ResourceState:
    loaded: LoadedModel
    lora: LoraModel
    muon_scaling: MuonScaling | None
    sessions: dict[str, SessionState] = field(default_factory=dict)


class LocalEngine:
    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        self.config = config
        self.model_paths = model_paths
        self.device = resolve_device(config.device)
        self._resources: dict[str, ResourceState] = {}
        self._lock = threading.Lock()
        self._info: dict[str, ModelInfo] = {}

    # ------------------------------------------------------------ models and resources

    def model_info(self, base_model: str) -> ModelInfo:
        """Limits of a base model, read from its config.json without loading weights."""
        if base_model not in self._info:
            config = json.loads((self.model_paths[base_model] / "config.json").read_text())
            context_length = int(config.get("max_position_embeddings", 2048))
            self._info[base_model] = ModelInfo(
                vocab_size=int(config["vocab_size"]),
                context_length=context_length,
                max_seq_length=min(self.config.max_seq_length, context_length),
                max_batch_size=self.config.max_batch_size,
                max_lora_rank=self.config.max_lora_rank,
            )
        return self._info[base_model]

    def load_resource(
        self, resource_id: str, base_model: str, *, muon_scaling: MuonScaling | None
    ) -> None:
        with self._lock:
            if resource_id in self._resources:
                return
        loaded = load_model(self.model_paths[base_model], self.device)
        state = ResourceState(loaded, LoraModel(loaded.model), muon_scaling)
        with self._lock:
            self._resources.setdefault(resource_id, state)

    def unload_resource(self, resource_id: str) -> None:
        with self._lock:
            self._resources.pop(resource_id, None)

    def is_loaded(self, resource_id: str) -> bool:
        with self._lock:
            return resource_id in self._resources

    def _resource(self, resource_id: str) -> ResourceState:
        with self._lock:
            state = self._resources.get(resource_id)
        if state is None:
            raise NotFound(f"model resource {resource_id} is not loaded")
        return state

    def _session(self, resource_id: str, session_id: str) -> tuple[ResourceState, SessionState]:
        resource = self._resource(resource_id)
        session = resource.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id} has no state on resource {resource_id}")
        return resource, session

    # ------------------------------------------------------------ sessions

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig) -> None:
        resource = self._resource(resource_id)
        spec = AdapterSpec(lora.rank, lora.alpha, lora.dropout, lora.seed, lora.train_unembed)
        named = resource.lora.add_adapter(session_id, spec)
        generator_key = f"{session_id}@generator"
        resource.lora.copy_adapter(session_id, generator_key)
        optimizer = SessionOptimizer(named, muon_scaling=resource.muon_scaling)
        resource.sessions[session_id] = SessionState(session_id, generator_key, optimizer)

    def drop_session(self, resource_id: str, session_id: str) -> None:
        with self._lock:
            resource = self._resources.get(resource_id)
        if resource is None or session_id not in resource.sessions:
            return
        session = resource.sessions.pop(session_id)
        resource.lora.remove_adapter(session.trainer_key)
        resource.lora.remove_adapter(session.generator_key)

    # ------------------------------------------------------------ training

    def _forward_logprobs(self, resource: ResourceState, key: str, packed: PackedBatch) -> Tensor:
        """float32 [S, T] logprob of each target token under adapter `key` (routing active)."""
        model = resource.loaded.model
        hidden_STH = model.base_model(
            input_ids=packed.tokens_ST, attention_mask=packed.attention_mask_ST
        ).last_hidden_state
        return target_logprobs(
            model.get_output_embeddings(),
            hidden_STH,
            packed.targets_ST,
            chunk_tokens=self.config.logprob_chunk_tokens,
        )

    def validate_forward_backward(self, request: ForwardBackwardRequest) -> None:
        """The loss checks that need tensors; raises InvalidRequest naming the field."""
        validate_loss_inputs(request.loss, pack(request.samples, torch.device("cpu")).loss_batch)

    def forward_backward(
        self, resource_id: str, session_id: str, request: ForwardBackwardRequest
    ) -> ForwardBackwardResult:
        resource, session = self._session(resource_id, session_id)
        packed = pack(request.samples, resource.loaded.device)
        validate_loss_inputs(request.loss, packed.loss_batch)
        loss_fn = LOSSES[request.loss.type]
        train = not request.forward_only
        with resource.lora.route([(session.trainer_key, None)]), torch.set_grad_enabled(train):
            logprobs_ST = self._forward_logprobs(resource, session.trainer_key, packed)
            output = loss_fn(logprobs_ST, packed.loss_batch, request.loss.params)
            loss_value = float(output.loss.detach())
            if not math.isfinite(loss_value):
                raise NonFiniteLoss(f"loss is {loss_value}; nothing was accumulated")
            if train:
                self._accumulate(session, output.loss)
        reported_ST = torch.where(output.included_ST, logprobs_ST.detach(), 0.0)
        outputs = unpack(reported_ST, packed.lengths_S) if request.return_loss_fn_outputs else None
        return ForwardBackwardResult(loss_value, output.metrics, outputs)

    def custom_forward_backward(
        self, resource_id: str, session_id: str, request: CustomForwardBackwardRequest
    ) -> None:
        """Back-propagate sum_i sum_t g_it * logp_it (api.md 1.4.3); weights/mask not applied."""
        resource, session = self._session(resource_id, session_id)
        packed = pack(request.samples, resource.loaded.device)
        width = packed.tokens_ST.shape[1]
        gradients_ST = torch.zeros(len(request.samples), width, device=resource.loaded.device)
        for index, gradient in enumerate(request.gradients):
            gradients_ST[index, : len(gradient)] = torch.tensor(gradient)
        with resource.lora.route([(session.trainer_key, None)]):
            logprobs_ST = self._forward_logprobs(resource, session.trainer_key, packed)
            valid_ST = packed.loss_batch.valid_ST
            surrogate = torch.where(valid_ST, gradients_ST * logprobs_ST, 0.0).sum()
            self._accumulate(session, surrogate)

    def _accumulate(self, session: SessionState, loss: Tensor) -> None:
        """Add d loss / d params to the session's gradients, or change nothing at all.

        Backward runs into empty .grad buffers; only when every new gradient is finite are the
        earlier accumulated gradients added back, so a failure leaves them exactly as they were."""
        params = [p for _, p in session.optimizer.named_params]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss.backward()
        new = [p.grad for p in params]
        if not all(g is None or bool(torch.isfinite(g).all()) for g in new):
            for p, g in zip(params, earlier, strict=True):
                p.grad = g
            raise NonFiniteLoss("gradient is not finite; nothing was accumulated")
        for p, old, g in zip(params, earlier, new, strict=True):
            p.grad = g if old is None else (old if g is None else old + g)

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        _, session = self._session(resource_id, session_id)
        session.optimizer.step(request)

    def publish(self, resource_id: str, session_id: str) -> None:
        """weights-sync: the generator adapter becomes a copy of the trainer adapter."""
        resource, session = self._session(resource_id, session_id)
        resource.lora.copy_adapter(session.trainer_key, session.generator_key)

    # ------------------------------------------------------------ sampling

    def sample(
        self, resource_id: str, session_id: str, request: SampleRequest, *, version: int
    ) -> list[SampleResult]:
        resource, session = self._session(resource_id, session_id)
        loaded = resource.loaded
        rows_G = [list(p) for p in request.prompts for _ in range(request.num_samples)]
        pad = loaded.tokenizer.pad_token_id
        with resource.lora.route([(session.generator_key, None)]):
            states = generate(
                loaded.model,
                loaded.tokenizer,
                rows_G,
                request.sampling_params,
                eos_token_ids=loaded.eos_token_ids,
                pad_token_id=pad if pad is not None else min(loaded.eos_token_ids),
            )
            results = []
            for index, prompt in enumerate(request.prompts):
                chunk = states[index * request.num_samples : (index + 1) * request.num_samples]
                sequences = [
                    SampledSequence(s.tokens, s.logprobs, s.stop_reason, 0)  # type: ignore[arg-type]
                    for s in chunk
                ]
                prompt_lp, topk = self._prompt_logprobs(resource, prompt, request)
                results.append(
                    SampleResult(sequences, [PolicySegment(0, version)], prompt_lp, topk)
                )
        return results

    @torch.no_grad()
    def _prompt_logprobs(
        self, resource: ResourceState, prompt: tuple[int, ...], request: SampleRequest
    ) -> tuple[list[float] | None, list[TopkPromptLogprobs] | None]:
        """Teacher-forced logprobs of the prompt (entry 0 is a 0.0 placeholder) and top-k."""
        if not request.prompt_logprobs and request.topk_prompt_logprobs == 0:
            return None, None
        prompt_lp: list[float] | None = [0.0] if request.prompt_logprobs else None
        topk: list[TopkPromptLogprobs] | None = (
            [TopkPromptLogprobs([], [])] if request.topk_prompt_logprobs else None
        )
        if len(prompt) < 2:
            return prompt_lp, topk
        model = resource.loaded.model
        device = resource.loaded.device
        tokens_1T = torch.tensor([prompt[:-1]], device=device)
        targets_1T = torch.tensor([prompt[1:]], device=device)
        hidden_1TH = model.base_model(input_ids=tokens_1T).last_hidden_state
        head = model.get_output_embeddings()
        if request.prompt_logprobs:
            values = target_logprobs(
                head, hidden_1TH, targets_1T, chunk_tokens=self.config.logprob_chunk_tokens
            )
            prompt_lp = [0.0] + values[0].cpu().tolist()
        if topk is not None:
            k = request.topk_prompt_logprobs
            for position in range(hidden_1TH.shape[1]):
                logprobs_V = log_softmax_float32(head(hidden_1TH[:, position]))[0]
                values_k, ids_k = torch.topk(logprobs_V, min(k, logprobs_V.shape[-1]))
                topk.append(TopkPromptLogprobs(ids_k.cpu().tolist(), values_k.cpu().tolist()))
        return prompt_lp, topk

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        vocab = self.model_info(base_model).vocab_size
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"{param}[{index}] = {token} is outside the vocabulary [0, {vocab})",
                    param=param,
                )
