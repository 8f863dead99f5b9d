"""Single-process engine: owns loaded base models, each session's adapters and optimizer.

State is keyed by model resource and session. A resource's methods are called from that
resource's one worker thread (service/scheduler.py), so per-resource state needs no lock; the
resource table itself is guarded because resources come and go from other threads.

Each LoRA session has two adapters on its resource's model: the trainer's (what
forward-backward and optim-step change) and the generator's (what sample uses), which
weights-sync overwrites with a copy of the trainer's. A full-weight session (the only session
of its resource) trains the model itself and samples from its own copy of it
(engine/full_weight.py).

Legend: S = samples, T = tokens.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from posttrain.config import EngineConfig
from posttrain.engine import full_weight, weights
from posttrain.engine.batching import PackedBatch, pack, unpack
from posttrain.engine.buckets import Routing, assemble, bucket_routing, plan_buckets
from posttrain.engine.interface import ModelInfo
from posttrain.engine.logprobs import target_logprobs
from posttrain.engine.losses import LOSSES, validate_loss_inputs
from posttrain.engine.model_passes import GeneratorModel
from posttrain.engine.optim import SessionOptimizer
from posttrain.engine.prefix_cache import PrefixCache
from posttrain.engine.sampler import GenerationRequest, WeightsVersion, generate
from posttrain.errors import InvalidRequest, NonFiniteLoss, NotFound
from posttrain.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from posttrain.model.lora import AdapterSpec, LoraModel
from posttrain.types import (
    CustomForwardBackwardRequest,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoraConfig,
    MuonScaling,
    OptimStepRequest,
    SampleRequest,
    SampleResult,
)


@dataclass
class SessionState:
    trainer_key: str
    generator_key: str
    optimizer: SessionOptimizer
    # Full-weight sessions only: the generator's own copy of the model (engine/full_weight.py).
    # LoRA sessions sample through their generator adapter on the shared model instead.
    generator_model: nn.Module | None = None

    @property
    def is_full_weight(self) -> bool:
        return self.generator_model is not None


@dataclass
class ResourceState:
    loaded: LoadedModel
    lora: LoraModel
    muon_scaling: MuonScaling | None
    sessions: dict[str, SessionState] = field(default_factory=dict)
    # Where the base weights come from; a full-weight session's end restores them from here.
    model_path: Path | None = None
    # The sampler's KV of prompt prefixes, keyed by generator adapter and weights generation.
    prefix_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0))
    # What each generator (by adapter key) serves; read live by the decode loop (PIPELINE).
    served: dict[str, WeightsVersion] = field(default_factory=dict)
    generations: itertools.count = field(default_factory=lambda: itertools.count(1))


class LocalEngine:
    def __init__(self, config: EngineConfig, model_paths: dict[str, Path]) -> None:
        self.config = config
        self.model_paths = model_paths
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._resources: dict[str, ResourceState] = {}
        self._lock = threading.Lock()
        self._info: dict[str, ModelInfo] = {}

    # ------------------------------------------------------------ models and resources

    def device_name(self) -> str:
        """What the weights run on: `cpu`, or the CUDA device's product name (`NVIDIA H200`)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return self.device.type

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
        loaded = load_model(self.model_paths[base_model], self.device, self.dtype)
        state = ResourceState(
            loaded,
            LoraModel(loaded.model),
            muon_scaling,
            model_path=self.model_paths[base_model],
            prefix_cache=PrefixCache(self.config.prefix_cache_mib << 20),
        )
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

    def create_session(self, resource_id: str, session_id: str, lora: LoraConfig | None) -> None:
        """A LoRA session (its own adapter on the shared base), or with `lora` None the one
        full-weight session of the resource (engine/full_weight.py)."""
        resource = self._resource(resource_id)
        assert not any(s.is_full_weight for s in resource.sessions.values()), (
            f"resource {resource_id} already hosts a full-weight session"
        )
        if lora is None:
            self._create_full_weight_session(resource, session_id)
            return
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
        resource.served.pop(session.generator_key, None)
        resource.prefix_cache.drop_owner(session.generator_key)
        if session.is_full_weight:
            assert resource.model_path is not None, "full-weight resource without a model path"
            full_weight.restore_base(resource.lora, resource.model_path, resource.loaded.device)
            return
        resource.lora.remove_adapter(session.trainer_key)
        resource.lora.remove_adapter(session.generator_key)

    def _create_full_weight_session(self, resource: ResourceState, session_id: str) -> None:
        assert not resource.sessions, "a full-weight session shares its resource with no one"
        # The copy is taken while the model is frozen, so it never holds gradients.
        generator_model = full_weight.generator_copy(resource.loaded.model)
        named = full_weight.trainable_parameters(resource.lora)
        optimizer = SessionOptimizer(named, muon_scaling=resource.muon_scaling)
        resource.sessions[session_id] = SessionState(
            session_id, f"{session_id}@generator", optimizer, generator_model=generator_model
        )

    def _refresh_generator(self, resource: ResourceState, session: SessionState) -> None:
        """The generator serves a copy of the trainer's current weights."""
        if session.generator_model is not None:
            full_weight.publish(resource.loaded.model, session.generator_model)
        else:
            resource.lora.copy_adapter(session.trainer_key, session.generator_key)
        # New weights, new generation: no prefix-cache entry of the old weights can hit again.
        version = self._served(resource, session).version
        resource.served[session.generator_key] = WeightsVersion(next(resource.generations), version)
        resource.prefix_cache.drop_owner(session.generator_key)

    def _served(self, resource: ResourceState, session: SessionState) -> WeightsVersion:
        """What the session's generator serves; a new session serves policy version 0."""
        key = session.generator_key
        if key not in resource.served:
            resource.served[key] = WeightsVersion(next(resource.generations), 0)
        return resource.served[key]

    def _sampling_model(self, resource: ResourceState, session: SessionState) -> nn.Module:
        """The model sample runs (with the session's generator adapter routed, for LoRA)."""
        if session.generator_model is not None:
            return session.generator_model
        return resource.loaded.model

    # ------------------------------------------------------------ training

    def _forward_logprobs(
        self, resource: ResourceState, packed: PackedBatch, routing: Routing
    ) -> Tensor:
        """float32 [S, T] logprob of each target token, 0.0 at padding, with each adapter of
        `routing` applied to its rows (positions in `packed`; None: every row).

        Rows of similar length share a forward (engine/buckets.py), each padded only to its own
        longest row; the result has the layout of one padded forward over the whole batch."""
        buckets = plan_buckets(packed.lengths_S, self.config.bucket_overhead_tokens)
        pieces_BL = [
            self._bucket_logprobs(resource, packed, rows, bucket_routing(routing, rows))
            for rows in buckets
        ]
        logprobs_ST = assemble(pieces_BL, buckets, packed.tokens_ST.shape[1])
        # Padding is computed inside a bucket but belongs to no sample: make it the same zeros
        # whichever bucket a row landed in.
        return torch.where(packed.loss_batch.valid_ST, logprobs_ST, 0.0)

    def _bucket_logprobs(
        self,
        resource: ResourceState,
        packed: PackedBatch,
        rows: list[int],
        routing: list[tuple[str, list[int] | None]],
    ) -> Tensor:
        """float32 [B, L] logprobs of one bucket's rows, L its longest row; `routing` in
        bucket positions."""
        device = resource.loaded.device
        index_B = torch.tensor(rows, device=device)
        width = max(packed.lengths_S[row] for row in rows)

        def take(values_ST: Tensor) -> Tensor:
            return values_ST.index_select(0, index_B)[:, :width]

        assignments = [
            (key, None if local is None else torch.tensor(local, device=device))
            for key, local in routing
        ]
        model, lora = resource.loaded.model, resource.lora
        with lora.route(assignments):
            hidden_BLH = model.base_model(
                input_ids=take(packed.tokens_ST), attention_mask=take(packed.attention_mask_ST)
            ).last_hidden_state
            # The backward of all buckets runs after this block: a head chunk recomputed then
            # must see this bucket's routing again.
            return target_logprobs(
                model.get_output_embeddings(),
                hidden_BLH,
                take(packed.targets_ST),
                chunk_tokens=self.config.logprob_chunk_tokens,
                recompute_context=lambda: lora.route(assignments),
            )

    def validate_forward_backward(self, request: ForwardBackwardRequest) -> None:
        """The loss checks that need tensors; raises InvalidRequest naming the field."""
        validate_loss_inputs(request.loss, pack(request.samples, torch.device("cpu")).loss_batch)

    def forward_backward(
        self, resource_id: str, session_id: str, request: ForwardBackwardRequest
    ) -> ForwardBackwardResult:
        (outcome,) = self.forward_backward_batch(resource_id, [(session_id, request)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def forward_backward_batch(
        self, resource_id: str, items: list[tuple[str, ForwardBackwardRequest]]
    ) -> list[ForwardBackwardResult | Exception]:
        """Forward-backward of several sessions' requests in one shared pass.

        Rows are routed to their session's adapter, so each session's loss and gradients depend
        on its own rows only; one backward over the sum of the trainable losses fills every
        session's gradients. Each item succeeds or fails on its own: an invalid or non-finite
        item returns its exception and leaves its session's accumulated gradients untouched.
        At most one item per session (the scheduler keeps each session's order)."""
        resource = self._resource(resource_id)
        device = resource.loaded.device
        outcomes: list[ForwardBackwardResult | Exception | None] = [None] * len(items)
        live: list[tuple[int, SessionState, ForwardBackwardRequest, PackedBatch]] = []
        for index, (session_id, request) in enumerate(items):
            try:
                _, session = self._session(resource_id, session_id)
                packed = pack(request.samples, device)
                validate_loss_inputs(request.loss, packed.loss_batch)
            except (InvalidRequest, NotFound) as exc:
                outcomes[index] = exc
                continue
            live.append((index, session, request, packed))
        assert len({s.trainer_key for _, s, _, _ in live}) == len(live), "one item per session"
        if not live:
            return outcomes  # type: ignore[return-value]
        samples = tuple(sample for _, _, request, _ in live for sample in request.samples)
        merged = pack(samples, device)
        routing: Routing = []
        offsets, start = [], 0
        for _, session, request, _ in live:
            rows = range(start, start + len(request.samples))
            routing.append((session.trainer_key, rows if len(live) > 1 else None))
            offsets.append(start)
            start += len(request.samples)
        train = any(not request.forward_only for _, _, request, _ in live)
        scoring_only = [s for _, s, request, _ in live if request.forward_only]
        with (
            torch.set_grad_enabled(train),
            _frozen([p for s in scoring_only for _, p in s.optimizer.named_params]),
        ):
            logprobs_ST = self._forward_logprobs(resource, merged, routing)
            trainable: list[tuple[int, SessionState, Tensor]] = []
            results: dict[int, tuple[float, dict[str, float], Tensor, PackedBatch]] = {}
            for (index, session, request, packed), offset in zip(live, offsets, strict=True):
                width = packed.tokens_ST.shape[1]
                rows_ST = logprobs_ST[offset : offset + len(request.samples), :width]
                output = LOSSES[request.loss.type](rows_ST, packed.loss_batch, request.loss.params)
                loss_value = float(output.loss.detach())
                if not math.isfinite(loss_value):
                    outcomes[index] = NonFiniteLoss(
                        f"loss is {loss_value}; nothing was accumulated"
                    )
                    continue
                reported_ST = torch.where(output.included_ST, rows_ST.detach(), 0.0)
                results[index] = (loss_value, output.metrics, reported_ST, packed)
                if not request.forward_only:
                    trainable.append((index, session, output.loss))
            if trainable:
                failed = self._accumulate_many([(s, loss) for _, s, loss in trainable])
                for (index, _, _), error in zip(trainable, failed, strict=True):
                    if error is not None:
                        outcomes[index] = error
                        results.pop(index)
        is_always = self.config.loss_fn_outputs == "always"
        for index, (loss_value, metrics, reported_ST, packed) in results.items():
            wanted = is_always or items[index][1].return_loss_fn_outputs
            outputs = unpack(reported_ST, packed.lengths_S) if wanted else None
            outcomes[index] = ForwardBackwardResult(loss_value, metrics, outputs)
        return outcomes  # type: ignore[return-value]

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
        logprobs_ST = self._forward_logprobs(resource, packed, [(session.trainer_key, None)])
        valid_ST = packed.loss_batch.valid_ST
        surrogate = torch.where(valid_ST, gradients_ST * logprobs_ST, 0.0).sum()
        self._accumulate(session, surrogate)

    def _accumulate(self, session: SessionState, loss: Tensor) -> None:
        (error,) = self._accumulate_many([(session, loss)])
        if error is not None:
            raise error

    def _accumulate_many(
        self, items: list[tuple[SessionState, Tensor]]
    ) -> list[NonFiniteLoss | None]:
        """Add d loss_i / d params_i to each session's gradients, all-or-nothing per session.

        One backward over the summed losses runs into empty .grad buffers (sessions own disjoint
        parameters, and rows never mix, so each session receives only its own loss's gradient).
        Only when a session's new gradients are all finite are its earlier accumulated
        gradients added back; otherwise they are restored exactly and its item fails."""
        stashed = []
        for session, _ in items:
            params = [p for _, p in session.optimizer.named_params]
            stashed.append((params, [p.grad for p in params]))
            for p in params:
                p.grad = None
        torch.stack([loss for _, loss in items]).sum().backward()
        errors: list[NonFiniteLoss | None] = []
        for params, earlier in stashed:
            new = [p.grad for p in params]
            if not all(g is None or bool(torch.isfinite(g).all()) for g in new):
                for p, g in zip(params, earlier, strict=True):
                    p.grad = g
                errors.append(NonFiniteLoss("gradient is not finite; nothing was accumulated"))
                continue
            for p, old, g in zip(params, earlier, new, strict=True):
                p.grad = g if old is None else (old if g is None else old + g)
            errors.append(None)
        return errors

    def optim_step(self, resource_id: str, session_id: str, request: OptimStepRequest) -> None:
        _, session = self._session(resource_id, session_id)
        session.optimizer.step(request)

    def publish(self, resource_id: str, session_id: str, *, version: int) -> None:
        """weights-sync: the generator's weights become a copy of the trainer's, which are
        policy version `version` (api.md 2.4). Safe between decode passes (PIPELINE)."""
        resource, session = self._session(resource_id, session_id)
        self._refresh_generator(resource, session)
        served = self._served(resource, session)
        resource.served[session.generator_key] = replace(served, version=version)

    # ------------------------------------------------------------ checkpoints (engine/weights.py)

    def save_training_state(self, resource_id: str, session_id: str, directory: Path) -> None:
        """Trainable tensors, optimizer state and RNG state of a session into `directory`."""
        _, session = self._session(resource_id, session_id)
        tensors = dict(session.optimizer.named_params)
        weights.save_training_state(directory, tensors, session.optimizer.state_dict())

    def save_adapter(
        self,
        resource_id: str,
        session_id: str,
        directory: Path,
        *,
        lora: LoraConfig,
        base_model: str,
    ) -> None:
        """The trainer adapter of a LoRA session, in PEFT format, into `directory`."""
        resource, session = self._session(resource_id, session_id)
        tensors = resource.lora.adapter_state(session.trainer_key)
        modules = {name.rsplit(".", 1)[0] for name in tensors}
        targets = weights.peft_target_modules(resource.lora, modules)
        weights.save_peft_adapter(
            directory, tensors, lora=lora, base_model=base_model, target_modules=targets
        )

    def load_training_state(
        self, resource_id: str, session_id: str, directory: Path, *, load_optimizer: bool
    ) -> None:
        """Resume: the session's weights (and optimizer and RNG state) from a training
        checkpoint; the generator then serves the loaded weights."""
        resource, session = self._session(resource_id, session_id)
        state = weights.load_training_state(directory)
        _copy_into(session.optimizer.named_params, state.tensors)
        if load_optimizer:
            session.optimizer.load_state_dict(state.optimizer)
            weights.restore_rng(state.rng)
        self._refresh_generator(resource, session)

    def load_adapter(self, resource_id: str, session_id: str, directory: Path) -> None:
        """Resume weights only, from an inference checkpoint's PEFT adapter."""
        resource, session = self._session(resource_id, session_id)
        tensors, _ = weights.load_peft_adapter(directory)
        _copy_into(session.optimizer.named_params, tensors)
        self._refresh_generator(resource, session)

    def save_full_model(
        self, resource_id: str, session_id: str, directory: Path, *, base_model: str
    ) -> None:
        """A full-weight session's weights as a complete model directory (its MERGED variant)."""
        _, session = self._session(resource_id, session_id)
        tensors = {name: p.detach() for name, p in session.optimizer.named_params}
        weights.export_full_weights(self.model_paths[base_model], tensors, directory)

    def export_merged(self, base_model: str, adapter_dir: Path, output_dir: Path) -> None:
        """A merged model directory from a PEFT adapter over `base_model`'s own files."""
        weights.export_merged(self.model_paths[base_model], adapter_dir, output_dir)

    # ------------------------------------------------------------ sampling

    def sample(
        self,
        resource_id: str,
        session_id: str,
        request: SampleRequest,
        *,
        between_tokens: Callable[[], None] | None = None,
    ) -> list[SampleResult]:
        """One sample operation; see sample_batch."""
        items = [(session_id, request)]
        return self.sample_batch(resource_id, items, between_tokens=between_tokens)[0]

    def sample_batch(
        self,
        resource_id: str,
        items: list[tuple[str, SampleRequest]],
        *,
        between_tokens: Callable[[], None] | None = None,
    ) -> list[list[SampleResult]]:
        """Several sample operations of one resource (any sessions) in one generation: their
        rows share prefill and decode passes, each routed to its session's generator adapter.

        `between_tokens` runs between decode passes and may call `publish` (PIPELINE
        weights-sync); rows of a session whose generator changed continue on the new weights
        and their results record the switch in policy_segments. Returns one list of results
        (one per prompt) per item."""
        resource = self._resource(resource_id)
        sessions = [self._session(resource_id, session_id)[1] for session_id, _ in items]
        models = {id(m): m for m in (self._sampling_model(resource, s) for s in sessions)}
        assert len(models) == 1, "one generation runs on one model"
        loaded = resource.loaded
        generator = GeneratorModel(
            model=next(iter(models.values())),
            lora=resource.lora,
            tokenizer=loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            prefix_cache=resource.prefix_cache,
            logprob_chunk_tokens=self.config.logprob_chunk_tokens,
        )
        requests = []
        for (_, request), session in zip(items, sessions, strict=True):
            self._served(resource, session)
            requests.extend(
                GenerationRequest(
                    prompt,
                    request.num_samples,
                    request.sampling_params,
                    session.generator_key,
                    prompt_logprobs=request.prompt_logprobs,
                    topk_prompt_logprobs=request.topk_prompt_logprobs,
                )
                for prompt in request.prompts
            )
        results = generate(
            generator, requests, versions=resource.served, between_tokens=between_tokens
        )
        split: list[list[SampleResult]] = []
        for _, request in items:
            split.append(results[: len(request.prompts)])
            results = results[len(request.prompts) :]
        return split

    def check_tokens(self, base_model: str, tokens: tuple[int, ...], param: str) -> None:
        vocab = self.model_info(base_model).vocab_size
        if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
            return  # min and max run in C: no Python work per token on the common path
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"{param}[{index}] = {token} is outside the vocabulary [0, {vocab})",
                    param=param,
                )


@contextmanager
def _frozen(params: list[nn.Parameter]) -> Iterator[None]:
    """Keep forward_only sessions out of a shared pass's graph, so the backward of the other
    sessions' losses leaves their .grad exactly as it was (not a tensor of zeros)."""
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)


def _copy_into(
    named_params: list[tuple[str, torch.nn.Parameter]], saved: dict[str, Tensor]
) -> None:
    """Overwrite parameters in place with saved tensors of the same names and shapes."""
    params = dict(named_params)
    if set(saved) != set(params):
        missing = sorted(set(params) - set(saved))[:3]
        extra = sorted(set(saved) - set(params))[:3]
        raise InvalidRequest(
            f"checkpoint parameters do not match this session (missing {missing}, extra {extra})",
            param="resume_from_checkpoint_id",
        )
    with torch.no_grad():
        for name, value in saved.items():
            if value.shape != params[name].shape:
                raise InvalidRequest(
                    f"checkpoint tensor {name} has shape {tuple(value.shape)}, the session's"
                    f" has {tuple(params[name].shape)}",
                    param="resume_from_checkpoint_id",
                )
            params[name].copy_(value)
