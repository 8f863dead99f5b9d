"""Checkpoint file formats of one session: training state for resume, and servable exports.

Owns what goes into a checkpoint directory and how it reads back. Does not own where
directories live, temporary names or renames (service/durability/checkpoints.py), nor which
session's tensors are saved (hosts/in_process.py hands them over).

Training checkpoint (resume, api.md 1.4.7):
    trainable.safetensors   the session's trainable tensors, keyed by parameter name
                            (`<module>.lora_A` / `<module>.lora_B` for a LoRA session)
    training_state.pt       {"optimizer": SessionOptimizer.state_dict(), "rng": torch RNG
                            states}; tensors and numbers only, read with weights_only=True

Inference checkpoint of a LoRA session (api.md 1.4.8), in PEFT's LoRA format so
`peft.PeftModel` and servers that read PEFT adapters load it unchanged:
    adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, ...
    adapter_model.safetensors   `base_model.model.<module>.lora_A.weight` (and lora_B)
Fused MoE expert weights are PEFT `target_parameters` (its ParamWrapper, see _peft_expert_keys).
Inference checkpoint of a full-weight session: the model directory below, nothing else.

Merged model (CHECKPOINT_VARIANT_MERGED): the base model with W + (alpha / r) * B @ A folded
into every adapted Linear and fused expert parameter (B @ A per expert), or, for a
full-weight session, with its trained parameters, written by transformers' save_pretrained
next to the base model's tokenizer files, so plain `AutoModelForCausalLM.from_pretrained`
loads it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from posttrain.engine.optim.optimizer import OptimizerState
from posttrain.errors import InvalidRequest
from posttrain.model.lora import LoraModel
from posttrain.model.lora_experts import PROJECTIONS, ExpertProjection
from posttrain.types import LoraConfig

TRAINABLE_FILE = "trainable.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE)

# PEFT (0.21, under transformers 5) rewrites the target_modules of a model whose experts
# transformers 5 fused (DeepSeek-V3, Qwen2-MoE, Mixtral): a target named like a transformers 4
# expert projection is taken for the fused experts, and the Linear layers of that name (a dense
# layer's MLP, shared experts) drop out of the adapter. With expert targets, those Linears are
# targeted as their `<module>.weight` parameter instead: PEFT's ParamWrapper, the same keys and
# delta B @ A.
PEFT_V4_EXPERT_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})
# PEFT prefixes every key with the PeftModel / LoraModel wrappers' attribute names.
PEFT_PREFIX = "base_model.model."
# Base-model files a merged directory must not copy: save_pretrained writes the weights and
# the configs itself.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
WRITTEN_BY_SAVE_PRETRAINED = {"config.json", "generation_config.json"}


@dataclass(frozen=True)
class TrainingState:
    tensors: dict[str, Tensor]  # trainable parameter name -> value (CPU)
    optimizer: OptimizerState
    rng: dict[str, Tensor | list[Tensor]]


# ---------------------------------------------------------------- training state


def save_training_state(
    directory: Path, tensors: dict[str, Tensor], optimizer: OptimizerState
) -> None:
    """Write the trainable tensors, the optimizer state and this process's RNG state.

    The RNG state is the one dropout draws from (model/lora.py uses torch's global
    generator), so a resumed session with dropout replays the same masks."""
    save_file(_cpu(tensors), str(directory / TRAINABLE_FILE), metadata={"format": "pt"})
    torch.save({"optimizer": optimizer, "rng": rng_state()}, directory / TRAINING_STATE_FILE)
    _fsync_files(directory, (TRAINABLE_FILE, TRAINING_STATE_FILE))


def load_training_state(directory: Path) -> TrainingState:
    tensors = load_file(str(directory / TRAINABLE_FILE))
    state = torch.load(directory / TRAINING_STATE_FILE, weights_only=True, map_location="cpu")
    return TrainingState(tensors=tensors, optimizer=state["optimizer"], rng=state["rng"])


def rng_state() -> dict[str, Tensor | list[Tensor]]:
    state: dict[str, Tensor | list[Tensor]] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Tensor | list[Tensor]]) -> None:
    """Restore the generators saved by save_training_state (CUDA ones when counts match)."""
    cpu = state["cpu"]
    assert isinstance(cpu, Tensor), "saved CPU RNG state is not a tensor"
    torch.set_rng_state(cpu)
    cuda = state.get("cuda")
    if isinstance(cuda, list) and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------- PEFT adapter


def peft_key(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A` -> PEFT's
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{PEFT_PREFIX}{name}.weight"


def internal_name(key: str) -> str:
    """Inverse of peft_key."""
    assert key.startswith(PEFT_PREFIX) and key.endswith(".weight"), f"not a PEFT key: {key}"
    return key[len(PEFT_PREFIX) : -len(".weight")]


def peft_target_modules(lora: LoraModel, adapted: Iterable[str]) -> list[str]:
    """target_modules for adapter_config.json: the short names (`q_proj`, `lm_head`) when
    PEFT's suffix match picks exactly the adapted modules, else every full module name."""
    # Expert parameters are not modules: they go to target_parameters (save_peft_adapter).
    adapted_set = {n for n in adapted if not isinstance(lora.layers.get(n), ExpertProjection)}
    short = {name.rsplit(".", 1)[-1] for name in adapted_set}
    # The model as PEFT would see it: each LoraLinear stands where its nn.Linear was.
    names = {
        name[: -len(".base")] if name.endswith(".base") else name
        for name, _ in lora.model.named_modules()
    }
    collides = any(
        name.rsplit(".", 1)[-1] in short for name in names if name and name not in adapted_set
    )
    return sorted(adapted_set if collides else short)


def save_peft_adapter(
    directory: Path,
    tensors: dict[str, Tensor],
    *,
    lora: LoraConfig,
    base_model: str,
    target_modules: list[str],
) -> None:
    """Write adapter_config.json and adapter_model.safetensors as PEFT saves a LoRA adapter."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    experts = sorted({n.rsplit(".", 1)[0] for n, t in tensors.items() if t.ndim == 3})
    if experts:
        linears = sorted({n.rsplit(".", 1)[0] for n, t in tensors.items() if t.ndim == 2})
        renamed = [m for m in linears if m.rsplit(".", 1)[-1] in PEFT_V4_EXPERT_NAMES]
        config["target_modules"] = [
            t for t in target_modules if t.rsplit(".", 1)[-1] not in PEFT_V4_EXPERT_NAMES
        ]
        config["target_parameters"] = experts + [f"{m}.weight" for m in renamed]
        # PEFT refuses dropout on parameter targets; it only matters in training, not here.
        config["lora_dropout"] = 0.0
    (directory / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    keyed = {}
    for name, value in _cpu(tensors).items():
        if value.ndim == 3:
            keyed.update(_peft_expert_keys(name, value, lora.rank))
        else:
            keyed[peft_key(name)] = value
    save_file(keyed, str(directory / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    _fsync_files(directory, ADAPTER_FILES)


def load_peft_adapter(directory: Path) -> tuple[dict[str, Tensor], float]:
    """The adapter tensors under their internal names, and the scale alpha / r."""
    config = json.loads((directory / PEFT_CONFIG_FILE).read_text())
    tensors = load_file(str(directory / PEFT_WEIGHTS_FILE))
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / float(rank)
    internal: dict[str, Tensor] = {}
    for parameter in config.get("target_parameters") or ():
        if parameter.endswith(".weight"):  # a Linear's weight: plain keys, read below
            continue
        _, prefix = _peft_expert_prefix(parameter)
        lora_A = tensors.pop(f"{prefix}.lora_A.weight")
        lora_B = tensors.pop(f"{prefix}.lora_B.weight")
        internal.update(_internal_expert_factors(parameter, lora_A, lora_B, rank))
    internal.update({internal_name(key): value for key, value in tensors.items()})
    return internal, scale


# PEFT wraps each targeted parameter of a module in its own ParamWrapper, the first parameter
# (definition order: gate_up_proj, then down_proj) innermost, so its keys carry one
# `.base_layer` per wrapper outside it. For a 3-D [E, out, in] parameter (transformers' experts,
# not `is_transposed`) a ParamWrapper has lora_A [E * r, in] and lora_B [out, r * E] and adds
# einsum("o r e, e r i -> e o i", B, A) (B as [out, r, E], A as [E, r, in]): A_peft is our
# A [E, r, in] flattened, and B_peft[o, r * E + e] = B_e[o, r] of ours (peft 0.21,
# tuners/lora/layer.py ParamWrapper; tests load the export in PEFT).


def _peft_expert_prefix(parameter: str) -> tuple[str, str]:
    module, _, name = parameter.rpartition(".")
    wrappers_outside = len(PROJECTIONS) - 1 - PROJECTIONS.index(name)
    return module, f"{PEFT_PREFIX}{module}{'.base_layer' * wrappers_outside}"


def _peft_expert_keys(name: str, value: Tensor, rank: int) -> dict[str, Tensor]:
    """Our factor `<experts>.<param>.lora_A` [E, r, in] or `.lora_B` [E, out, r] as PEFT's."""
    parameter, _, factor = name.rpartition(".")
    _, prefix = _peft_expert_prefix(parameter)
    if factor == "lora_A":  # -> PEFT lora_A [E * r, in]
        experts, _, in_features = value.shape
        peft = value.reshape(experts * rank, in_features)
        return {f"{prefix}.lora_A.weight": peft.contiguous()}
    experts, out_features, _ = value.shape  # lora_B -> PEFT lora_B [out, r * E]
    peft = value.permute(1, 2, 0).reshape(out_features, rank * experts)
    return {f"{prefix}.lora_B.weight": peft.contiguous()}


def _internal_expert_factors(
    parameter: str, peft_A: Tensor, peft_B: Tensor, rank: int
) -> dict[str, Tensor]:
    """Inverse of _peft_expert_keys for one expert parameter."""
    experts = peft_A.shape[0] // rank
    lora_A = peft_A.reshape(experts, rank, -1)
    lora_B = peft_B.reshape(peft_B.shape[0], rank, experts).permute(2, 0, 1)
    return {
        f"{parameter}.lora_A": lora_A.contiguous(),
        f"{parameter}.lora_B": lora_B.contiguous(),
    }


# ---------------------------------------------------------------- merged model


def merge_adapter_(model: PreTrainedModel, tensors: dict[str, Tensor], scale: float) -> None:
    """Fold W <- W + scale * B @ A into each adapted weight of a plain HF model, in place:
    an nn.Linear's [out, in] weight, or a fused 3-D expert parameter [E, out, in] with one
    pair per expert (A [E, R, in], B [E, out, R]; model/lora_experts.py).

    The sum is formed in float64 and rounded once to W's dtype, so the merged weights are as
    close to the adapter-applied forward as the storage dtype allows."""
    modules = sorted({name.rsplit(".", 1)[0] for name in tensors})
    for module in modules:
        weight = _adapted_weight(model, module)
        A = tensors[f"{module}.lora_A"].double()
        B = tensors[f"{module}.lora_B"].double()
        assert weight.shape == (*B.shape[:-1], A.shape[-1]), f"{module}: adapter shape mismatch"
        with torch.no_grad():
            merged = weight.double() + scale * (B.to(A.device) @ A)
            weight.copy_(merged.to(weight.dtype))


def _adapted_weight(model: PreTrainedModel, name: str) -> Tensor:
    """The weight an adapter named `name` trains: a Linear's, or an expert parameter itself."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        return model.get_parameter(name)
    assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}, not Linear"
    if linear is _output_embeddings(model) and _head_is_tied(model):
        _untie_head(model, linear)
    return linear.weight


def _output_embeddings(model: PreTrainedModel) -> nn.Module | None:
    """The model's output projection; None for a model without one."""
    # transformers leaves get_output_embeddings unannotated.
    head: nn.Module | None = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    return head


def _head_is_tied(model: PreTrainedModel) -> bool:
    head, embed = _output_embeddings(model), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def _untie_head(model: PreTrainedModel, head: nn.Linear) -> None:
    """A head adapter changes only the output projection (`head`); with tied weights it would
    change the input embeddings too, so the merged model gets its own head matrix."""
    head.weight = nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False


def export_merged(base_dir: Path, adapter_dir: Path, output_dir: Path) -> None:
    """Write the merged model of a PEFT adapter (adapter_dir) over the base model in base_dir.

    Weights keep the base checkpoint's dtype; output_dir holds flat files only."""
    tensors, scale = load_peft_adapter(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    merge_adapter_(model, tensors, scale)
    _save_model(model, base_dir, output_dir)


def export_full_weights(base_dir: Path, tensors: dict[str, Tensor], output_dir: Path) -> None:
    """Write a full-weight session's parameters (Hugging Face names) as a model directory
    shaped like the base model in base_dir: its config, dtype and tokenizer files."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    own = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(own))
    assert not unknown, f"parameters not in the base model: {unknown[:3]}"
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value.to(own[name].dtype))
    _save_model(model, base_dir, output_dir)


def _save_model(model: PreTrainedModel, base_dir: Path, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    for source in sorted(base_dir.iterdir()):
        if source.is_file() and _copied_from_base(source.name):
            shutil.copyfile(source, output_dir / source.name)
    _fsync_files(output_dir, [p.name for p in output_dir.iterdir() if p.is_file()])


def _copied_from_base(name: str) -> bool:
    """Tokenizer and other side files; not weights or configs (save_pretrained writes those),
    nor a model card, which describes the base model rather than this export."""
    is_weights = name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")
    return not is_weights and name not in WRITTEN_BY_SAVE_PRETRAINED and not name.endswith(".md")


# ---------------------------------------------------------------- helpers


def _cpu(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def _fsync_files(directory: Path, names: Iterable[str]) -> None:
    """Flush file contents before the caller renames the directory into place."""
    for name in names:
        with open(directory / name, "rb") as handle:
            os.fsync(handle.fileno())


def copy_into(named_params: list[tuple[str, torch.nn.Parameter]], saved: dict[str, Tensor]) -> None:
    """Overwrite parameters in place with saved tensors of the same names and shapes."""
    check_names(named_params, saved)
    params = dict(named_params)
    with torch.no_grad():
        for name, value in saved.items():
            if value.shape != params[name].shape:
                raise InvalidRequest(
                    f"checkpoint tensor {name} has shape {tuple(value.shape)}, the session's"
                    f" has {tuple(params[name].shape)}",
                    param="resume_from_checkpoint_id",
                )
            params[name].copy_(value)


def check_names(
    named_params: list[tuple[str, torch.nn.Parameter]], saved: dict[str, Tensor]
) -> None:
    """InvalidRequest unless `saved` has exactly the parameters' names."""
    params = dict(named_params)
    if set(saved) != set(params):
        missing = sorted(set(params) - set(saved))[:3]
        extra = sorted(set(saved) - set(params))[:3]
        raise InvalidRequest(
            f"checkpoint parameters do not match this session (missing {missing}, extra {extra})",
            param="resume_from_checkpoint_id",
        )
