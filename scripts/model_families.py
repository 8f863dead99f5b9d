"""Walk every model type in transformers' causal-LM list and decide which posttrain serves.

What: for each `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, build a tiny random-init
config from its own config class (hidden 64, two layers, the built-in tokenizer's 99-token
vocabulary; the sub-configs of multimodal wrappers shrunk the same way), then classify it:

- encoder-decoder, encoder-only or not causal: refused, not a decoder-only causal LM;
- layers that carry a recurrent state (state-space, RWKV, xLSTM, linear attention, short
  convolutions) which posttrain's caches do not hold: refused, naming the layers;
- no tiny build of it that runs in transformers itself (four variants are tried: two or four
  layers, two or as many KV heads as query heads): refused as not verified, with the error;
- the rest through posttrain end to end at engine level (posttrain's loader into a
  LocalEngine, LoRA sessions): the trainer's logprobs against plain transformers'
  `log_softmax(model(ids).logits)` within 1e-5, and a seeded sample whose sampler logprobs
  equal a forward pass's within 1e-4 (the tolerances of tests/unit/engine/test_family_parity.py).
  Served only when both hold; otherwise refused with the observed failure.

The types the Gated DeltaNet and Qwen3-VL work owns (OWNED_ELSEWHERE) are never refused here:
served when exact, else pending (allowed at start-up with a warning).

A tiny build keeps the family's default config otherwise: a feature its default leaves off
(a sliding window, say) is not what the walk verified; tests/unit/engine/test_family_*.py
switch them on for the families they cover.

It writes docs/model_families.md (the table) and posttrain/model/families.py (the verdicts
the start-up check reads). Why: a user can bring any of these families; each is either
served exactly or stopped at start-up with the reason, and the table says which.

    python scripts/model_families.py              # the whole walk, rewrites both files
    python scripts/model_families.py llama gpt2   # a few types, printed only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from posttrain.config import BUILTIN_MODEL_DIR, EngineConfig
from posttrain.engine.hosts.in_process import LocalEngine
from posttrain.model import families
from posttrain.model.families import SEE_MODELS_MD
from posttrain.model.loader import servable_problem
from posttrain.types import (
    ForwardBackwardRequest,
    LoraConfig,
    LossConfig,
    LossType,
    SampleRequest,
    SamplingParams,
    TrainingSample,
)

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "model_families.md"
MODULE = ROOT / "posttrain" / "model" / "families.py"

SERVED, REFUSED, PENDING = "served", "refused", "pending"
STATUSES = (SERVED, REFUSED, PENDING)
VOCAB = 99  # the built-in tokenizer's
TOKENS = [1, 40, 41, 42, 50, 60, 70, 80, 33, 34, 35, 36, 90, 91, 92, 20]
PROMPT = tuple(TOKENS[:9])
LOGPROB_ATOL = 1e-5  # trainer vs plain transformers, as the family tests
SAMPLER_ATOL = 1e-4  # sampler vs a forward pass, as the family tests
MAX_PARAMETERS = 20_000_000  # a tiny build past this did not shrink: not walked end to end

# Types the other model work owns (Gated DeltaNet hybrids, Qwen3-VL images): never refused
# by this table, marked served (see docs/models.md) when their walk is exact.
OWNED_ELSEWHERE = ("qwen3_next", "qwen3_5", "qwen3_vl")
OWNED_BY = "not verified yet: Gated DeltaNet and Qwen3-VL support is in progress"

# Config fields by the value a tiny build gives them (where the default is an int).
_SIZES: dict[int, tuple[str, ...]] = {
    64: ("hidden_size", "n_embd", "d_model", "embed_dim", "hidden_dim", "n_embed", "dim"),
    128: (
        "intermediate_size",
        "ffn_dim",
        "n_inner",
        "decoder_ffn_dim",
        "encoder_ffn_dim",
        "ffn_hidden_size",
        "d_ff",
        "d_inner",
        "mlp_dim",
        "ff_dim",
        "inner_hidden_size",
    ),
    32: (
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "expert_intermediate_size",
        "moe_ffn_hidden_size",
        "shared_intermediate_size",
        "q_lora_rank",
        "word_embed_proj_dim",
    ),
    16: ("head_dim", "kv_lora_rank", "qk_nope_head_dim", "attention_head_size"),
    12: ("v_head_dim",),
    8: ("qk_rope_head_dim",),
    2: (
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "n_layers",
        "decoder_layers",
        "encoder_layers",
        "num_decoder_layers",
        "num_key_value_heads",
        "num_kv_heads",
        "n_kv_heads",
        "multi_query_group_num",
        "num_experts_per_tok",
        "moe_topk",
        "moe_k",
        "n_group",
        "topk_group",
    ),
    4: (
        "num_attention_heads",
        "n_head",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "num_heads",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
    ),
    256: ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"),
}
_TINY = {name: value for value, names in _SIZES.items() for name in names}
_LAYER_COUNTS = _SIZES[2][:7]
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# Settings a family's default config needs beyond the shrinking (a layer-pattern format).
_FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0}},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "zaya": {"num_experts_per_tok": 1},
    "gemma3n_text": {"num_kv_shared_layers": 2},  # four layers: two share the first two's KV
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    "kolibri1_1": {
        "index_num_heads": 2,
        "index_layers": [1],
        "index_topk": 4,
        "index_pool_size": 64,
        "index_compression": 4,
        "index_num_local_tokens": 4,
        "index_num_sink_tokens": 2,
        "mlp_only_intermediate_size": 128,
    },
}
_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}

# Module class names whose layers keep a recurrent state between tokens, and what it is.
_RECURRENT = {
    "mamba": "Mamba state-space layers (a convolution and an SSM state per sequence)",
    "rwkv": "RWKV time-mixing layers (a recurrent state per sequence)",
    "xlstm": "xLSTM layers (a recurrent cell state per sequence)",
    "recurrent": "recurrent layers (a recurrent state per sequence)",
    "rglru": "RG-LRU recurrent layers (a recurrent state per sequence)",
    "gateddeltanet": "Gated DeltaNet linear attention (a delta-rule state per sequence)",
    "deltanet": "DeltaNet linear attention (a delta-rule state per sequence)",
    "linearattention": "linear attention layers (a recurrent state per sequence)",
    "lightning": "lightning linear attention (a recurrent state per sequence)",
    "shortconv": "short-convolution layers (a convolution state per sequence)",
    "kimidelta": "Kimi delta attention (a recurrent state per sequence)",
    "deltaattention": "delta-rule linear attention (a recurrent state per sequence)",
    "bambamixer": "Mamba-2 state-space layers (a convolution and an SSM state per sequence)",
    # In transformers' causal-LM families every *Mixer is a Mamba-style state-space mixer.
    "mixer": "state-space mixer layers (a convolution and an SSM state per sequence)",
}


@dataclass(frozen=True)
class Verdict:
    status: str  # SERVED or REFUSED
    why: str


def owned_elsewhere(model_type: str) -> bool:
    return model_type.startswith(OWNED_ELSEWHERE)


def model_types() -> list[str]:
    return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny_settings(
    config_class: type[PreTrainedConfig], layers: int = 2, kv_heads: int = 2
) -> dict[str, Any]:
    """Constructor keywords that shrink `config_class`'s defaults (sub-configs included, as
    dicts): only fields its default config has, so a family keeps its own structure."""
    default = config_class()
    fields = default.to_dict()
    settings: dict[str, Any] = {}
    tiny = {**_TINY, **dict.fromkeys(_LAYER_COUNTS, layers), **dict.fromkeys(_KV_HEADS, kv_heads)}
    default_layers = next(
        (fields[n] for n in _LAYER_COUNTS if isinstance(fields.get(n), int)), None
    )
    for name, value in fields.items():
        if name in tiny and isinstance(value, int) and not isinstance(value, bool):
            settings[name] = tiny[name]
        elif name in ("head_dim", "num_key_value_heads", "num_experts_per_tok") and value is None:
            settings[name] = tiny[name]  # derived in the modeling code of some families
        elif isinstance(value, list | str) and len(value) == default_layers and layers < len(value):
            if name in tiny and all(isinstance(v, int) for v in value):
                settings[name] = [tiny[name]] * layers  # a per-layer width
            else:
                settings[name] = _pattern(value, layers)  # one entry per layer: each kind
        elif name in _TOKEN_IDS and isinstance(value, int):
            settings[name] = _TOKEN_IDS[name]
        elif name in ("vocab_size", "vocab_size_per_layer_input") and isinstance(value, int):
            settings[name] = VOCAB
    if "qk_rope_head_dim" in settings and "head_dim" in fields:
        settings["head_dim"] = settings["qk_rope_head_dim"]  # MLA: head_dim is the rope part
    if "rotary_dim" in fields and isinstance(fields["rotary_dim"], int):
        settings["rotary_dim"] = 8  # within a 16-wide head
    settings.update(_FAMILY_SETTINGS.get(config_class.model_type, {}))
    for name in getattr(config_class, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        if isinstance(sub, PreTrainedConfig):
            sub_settings = _tiny_settings(type(sub), layers, kv_heads)
            if not sub_settings:
                continue  # nothing to shrink: its own defaults, as the parent builds them
            if getattr(type(sub), "model_type", ""):
                sub_settings["model_type"] = type(sub).model_type
            settings[name] = sub_settings
    return settings


def _pattern(per_layer: list[Any] | str, layers: int) -> list[Any] | str:
    """A per-layer pattern (layer types, a hybrid's block string) for `layers` layers: each
    kind it has once, in the order of their first use, repeated to fill."""
    kinds: list[Any] = []
    for kind in per_layer:
        if kind not in kinds:
            kinds.append(kind)
    shrunk = [kinds[i % len(kinds)] for i in range(layers)]
    return "".join(shrunk) if isinstance(per_layer, str) else shrunk


def tiny_configs(model_type: str) -> Iterator[PreTrainedConfig]:
    """Tiny configs of `model_type` to try in turn: the shrunk defaults, then as many KV heads
    as query heads (latent attention and families that require it), then four layers (a
    family whose layer pattern puts its first full-attention layer past the second)."""
    config_class = CONFIG_MAPPING[model_type]
    for layers, kv_heads in ((2, 2), (2, 4), (4, 2), (4, 4)):
        variant = _tiny_settings(config_class, layers, kv_heads)
        yield config_class(**variant)


def _recurrent_layers(model: torch.nn.Module) -> str | None:
    return _recurrent_in({type(module).__name__.lower() for module in model.modules()})


def _recurrent_in(names: set[str]) -> str | None:
    for key, what in _RECURRENT.items():
        if any(key in name for name in names):
            return what
    return None


def _family_recurrent_layers(model_type: str) -> str | None:
    """The recurrent layers `model_type`'s modeling code defines, used or not by a tiny build
    (a hybrid whose layer pattern, or whose default config, starts with attention only)."""
    model_class = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    modeling = sys.modules.get(getattr(transformers, model_class).__module__)
    names = {
        name.lower()
        for name, value in vars(modeling).items()
        if isinstance(value, type) and issubclass(value, torch.nn.Module)
    }
    return _recurrent_in(names)


def _not_decoder_only(model_type: str, config: PreTrainedConfig) -> str | None:
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model: not a decoder-only causal LM"
    if model_type in modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or (
        model_type in modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    ):
        return "the decoder half of an encoder-decoder model: not a decoder-only causal LM"
    if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "a bidirectional encoder with an optional causal head: not a decoder-only causal LM"
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(exc).__name__}: {text}"


def _trainer_logprobs(engine: LocalEngine, tokens: list[int]) -> list[float]:
    sample = TrainingSample(
        tokens=tuple(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tuple(float(t) for t in tokens[1:]),
            "weights": (1.0,) * (len(tokens) - 1),
        },
    )
    request = ForwardBackwardRequest(
        (sample,),
        LossConfig(LossType.CROSS_ENTROPY),
        forward_only=True,
        return_loss_fn_outputs=True,
    )
    (outcome,) = engine.forward_backward_batch("r", [("s", request)])
    if isinstance(outcome, Exception):
        raise outcome
    return list(outcome.loss_fn_outputs[0])


def _sampled(engine: LocalEngine) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    ((result,),) = engine.sample_batch("r", [("s", SampleRequest((PROMPT,), 2, params))])
    return [(list(s.tokens), list(s.logprobs)) for s in result.sequences]


def exactness(directory: Path) -> str | None:
    """Why posttrain does not serve the model in `directory` exactly, or None: loaded through
    posttrain's loader into a LocalEngine with a LoRA session, its trainer logprobs against
    plain transformers' and its sampler logprobs against a forward pass."""
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(TOKENS[1:])[:, None])
    engine = LocalEngine(EngineConfig(device="cpu", logprob_chunk_tokens=5), {"m": directory})
    engine.load_resource("r", "m", muon_scaling=None)
    engine.create_session("r", "s", LoraConfig(rank=4, alpha=8, seed=1))
    got = torch.tensor(_trainer_logprobs(engine, TOKENS))
    error = float((got - expected[:, 0]).abs().max())
    if not error <= LOGPROB_ATOL:
        return f"its logprobs differ from transformers' by {error:.1e} (tolerance {LOGPROB_ATOL})"
    for tokens, logprobs in _sampled(engine):
        scored = _trainer_logprobs(engine, [*PROMPT, *tokens])[-len(tokens) :]
        error = float((torch.tensor(logprobs) - torch.tensor(scored)).abs().max())
        if not error <= SAMPLER_ATOL:
            return (
                f"its sampler logprobs differ from a forward pass's by {error:.1e}"
                f" (tolerance {SAMPLER_ATOL})"
            )
    return None


def _perturbed(model: torch.nn.Module) -> None:
    """Random-init norms are ones and biases zeros: perturb every parameter so that no family
    feature is invisible to the comparisons (as tests/unit/model/families.py does)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)


def _built(model_type: str, workdir: Path) -> tuple[PreTrainedConfig, Path] | Verdict:
    """The first tiny config of `model_type` that transformers builds and runs, saved in
    `workdir`; or the verdict when none does (the first variant's failure)."""
    failure: Verdict | None = None
    recurrent = None if owned_elsewhere(model_type) else _family_recurrent_layers(model_type)
    if recurrent is not None:
        return Verdict(REFUSED, f"posttrain has no cache for its {recurrent}")
    configs = tiny_configs(model_type)
    while True:
        try:
            config = next(configs)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - any failure is the family's verdict
            failure = failure or Verdict(
                REFUSED,
                f"not verified: its tiny config does not build in transformers ({_one_line(exc)})",
            )
            continue
        not_decoder = _not_decoder_only(model_type, config)
        if not_decoder is not None:
            return Verdict(REFUSED, not_decoder)
        try:
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # noqa: BLE001
            failure = failure or Verdict(
                REFUSED,
                f"not verified: transformers builds no tiny model from it ({_one_line(exc)})",
            )
            continue
        recurrent = _recurrent_layers(meta)
        if recurrent is not None and not owned_elsewhere(model_type):
            return Verdict(REFUSED, f"posttrain has no cache for its {recurrent}")
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_PARAMETERS:
            failure = failure or Verdict(
                REFUSED, f"not verified: its tiny build kept {size / 1e6:.0f}M parameters"
            )
            continue
        directory = workdir / model_type
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            _perturbed(model)
            with torch.no_grad():
                model(input_ids=torch.tensor([TOKENS]))
            model.save_pretrained(directory)
        except Exception as exc:  # noqa: BLE001
            failure = failure or Verdict(
                REFUSED,
                f"not verified: transformers' own forward fails on a tiny one ({_one_line(exc)})",
            )
            continue
        return config, directory
    assert failure is not None
    return failure


def classify(model_type: str, workdir: Path) -> Verdict:
    verdict = _classified(model_type, workdir)
    if verdict.status == REFUSED and owned_elsewhere(model_type):
        # Another part of the model work is making it served: never refused by this table.
        return Verdict(PENDING, f"{OWNED_BY}; the walk saw: {verdict.why}")
    return verdict


def _classified(model_type: str, workdir: Path) -> Verdict:
    built = _built(model_type, workdir)
    if isinstance(built, Verdict):
        return built
    _, directory = built
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, directory / name)
    problem = servable_problem(directory)
    if problem is not None:
        return Verdict(REFUSED, problem)
    try:
        inexact = exactness(directory)
    except Exception as exc:  # noqa: BLE001
        return Verdict(REFUSED, f"posttrain fails on it ({_one_line(exc)})")
    if inexact is not None:
        return Verdict(REFUSED, inexact)
    if owned_elsewhere(model_type):
        return Verdict(SERVED, SEE_MODELS_MD)
    return Verdict(SERVED, "exact: logprobs and sampler equal plain transformers'")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' and posttrain's warnings about each tiny family, not the table's."""
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _table_unread() -> Iterator[None]:
    """The walk judges every family afresh: servable_problem must not refuse a type because
    the table the walk is about to rewrite refused it before."""
    refused = dict(families.REFUSED)
    families.REFUSED.clear()
    try:
        yield
    finally:
        families.REFUSED.update(refused)


def walk(types: Iterable[str], *, echo: bool = False) -> dict[str, Verdict]:
    verdicts: dict[str, Verdict] = {}
    with tempfile.TemporaryDirectory() as workdir, _table_unread():
        for model_type in types:
            start = time.perf_counter()
            with _quiet():
                verdicts[model_type] = classify(model_type, Path(workdir))
            shutil.rmtree(Path(workdir) / model_type, ignore_errors=True)
            if echo:
                verdict = verdicts[model_type]
                seconds = time.perf_counter() - start
                print(f"{model_type}: {verdict.status} ({seconds:.1f}s) {verdict.why}", flush=True)
    return verdicts


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(verdicts: dict[str, Verdict]) -> str:
    counts = {status: sum(v.status == status for v in verdicts.values()) for status in STATUSES}
    version = transformers.__version__
    lines = [
        "# Model families",
        "",
        f"Every model type in transformers {version}'s causal-LM list",
        "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`): served exactly, or refused at start-up by",
        "`posttrain serve` with the model type and the reason below.",
        f"{counts[SERVED]} served, {counts[REFUSED]} refused, {counts[PENDING]} pending.",
        "",
        "Generated by `python scripts/model_families.py`, which also writes",
        "`posttrain/model/families.py` (the verdicts the start-up check reads;",
        "`tests/unit/model/test_model_families.py` checks that the two agree and re-walks a",
        "fixed set of types). Each type is built random-init from its own config class, shrunk",
        "(hidden 64, two layers, a 99-token vocabulary), and walked on a CPU in float32:",
        "",
        "- **served**: loaded through posttrain's loader into an engine with a LoRA session, its",
        "  logprobs equal plain transformers' `log_softmax(model(ids).logits)` within 1e-5, and",
        "  a seeded sample's sampler logprobs equal a forward pass's within 1e-4;",
        "- **refused**: not a decoder-only causal LM; layers with a recurrent state posttrain's",
        "  caches do not hold; posttrain failing or inexact on it (the observed failure); or",
        "  *not verified*: no tiny build of it runs in transformers itself;",
        "- **pending**: a type the Gated DeltaNet and Qwen3-VL work is adding, never refused",
        "  here; it starts with a warning, as does a type missing from this table (a newer",
        "  transformers).",
        "",
        "| model type | status | why |",
        "|---|---|---|",
    ]
    for model_type in sorted(verdicts):
        verdict = verdicts[model_type]
        lines.append(f"| `{model_type}` | {verdict.status} | {_cell(verdict.why)} |")
    return "\n".join(lines) + "\n"


def module(verdicts: dict[str, Verdict]) -> str:
    """posttrain/model/families.py: its hand-written head, then the verdicts as data."""
    served = sorted(t for t, v in verdicts.items() if v.status == SERVED)
    refused = {t: v.why for t, v in sorted(verdicts.items()) if v.status == REFUSED}
    pending = {t: v.why for t, v in sorted(verdicts.items()) if v.status == PENDING}
    source = MODULE.read_text()
    lines = [source[: source.index(_GENERATED)] + _GENERATED]
    lines += [f'TRANSFORMERS_VERSION = "{transformers.__version__}"', ""]
    lines += ["SERVED: frozenset[str] = frozenset(", "    {"]
    lines += [f'        "{t}",' for t in served]
    lines += ["    }", ")", ""]
    lines += _dict_lines("REFUSED", refused) + [""] + _dict_lines("PENDING", pending)
    return "\n".join(lines) + "\n"


def _dict_lines(name: str, reasons: dict[str, str]) -> list[str]:
    lines = [f"{name}: dict[str, str] = {{"]
    for model_type, why in reasons.items():
        line = f"    {model_type!r}: {why!r},"
        if len(line) <= 100:
            lines.append(line)
            continue
        lines.append(f"    {model_type!r}: (")
        lines += [f"        {chunk!r}" for chunk in _chunks(why, 80)]
        lines.append("    ),")
    lines.append("}")
    return lines


def _chunks(text: str, width: int) -> list[str]:
    """`text` cut at spaces into pieces of at most about `width` characters (joined, `text`)."""
    pieces: list[str] = []
    while len(text) > width:
        cut = text.rfind(" ", 0, width)
        cut = width if cut <= 0 else cut + 1
        pieces.append(text[:cut])
        text = text[cut:]
    return [*pieces, text]


_GENERATED = "# Generated by scripts/model_families.py: do not edit below this line."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", help="walk these types only and print (no files)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    verdicts = walk(args.types or model_types(), echo=True)
    seconds = time.perf_counter() - start
    print(f"{len(verdicts)} types in {seconds:.0f}s", flush=True)
    if not args.types:
        TABLE.write_text(table(verdicts))
        MODULE.write_text(module(verdicts))
        # The generated data in the repository's style (ruff format, as CI checks the tree).
        subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(MODULE)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
