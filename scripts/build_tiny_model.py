"""Build the built-in tiny causal LMs ``posttrain/tiny-qwen3`` and ``posttrain/tiny-qwen3-moe``.

What: ``--arch dense`` (the default) writes a ~0.8M-parameter ``Qwen3ForCausalLM``,
``--arch moe`` a ~1.4M-parameter ``Qwen3MoeForCausalLM`` (8 experts, top-2); both with the
same character-level tokenizer, in Hugging Face format under ``posttrain/model/builtin/``
(package data).

Why: the server's tests, examples and CPU demos need a real causal LM that loads with the
stock ``AutoModelForCausalLM`` / ``AutoTokenizer`` code paths, fits in the repository (< 4 MB),
and works fully offline -- nothing may be downloaded from a model hub. A randomly initialised
model would emit uniform noise, so it is briefly pretrained here on synthetic text (addition,
string reversal, counting, words). That gives it the character distribution and the rough
line formats, while leaving multi-digit addition clearly imperfect so that SFT warm-up + RL
demos have something measurable to improve.

The MoE model exists for routed-expert replay: its router must spread tokens over the
experts, so its pretraining adds transformers' load-balancing loss (``output_router_logits``
while training; the saved config has it off, so serving computes no auxiliary loss), and its
README records the tokens each expert receives on the demo's prompts.

Both share the tokenizer, the data, the optimizer and the training loop; the dense path is
unchanged by the MoE one (it reproduces the committed ``model.safetensors`` byte for byte).
Everything is generated from fixed seeds on one CPU thread, so rebuilding produces a
byte-identical ``model.safetensors``.

Rebuild with::

    python scripts/build_tiny_model.py                # dense: default --out and --steps
    python scripts/build_tiny_model.py --arch moe     # MoE: default --out and --steps
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN_DIR = REPO_ROOT / "posttrain" / "model" / "builtin"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Specials first so their ids (0, 1, 2) are stable regardless of the character set.
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
# One token per printable ASCII character, plus newline.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

SEED = 0
MOE_STEPS = 500
NUM_LOAD_LINES = 64  # demo lines the README's expert-load table routes
BATCH_SIZE = 32
LR = 3e-3
WARMUP_STEPS = 30
MAX_LEN = 512

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "light",
    "music",
    "table",
    "water",
    "house",
    "tiger",
    "bread",
    "chair",
    "dream",
    "earth",
    "flame",
    "grape",
    "heart",
    "input",
    "juice",
    "knife",
    "lemon",
    "money",
    "night",
    "ocean",
    "paper",
    "queen",
    "robot",
    "sugar",
    "train",
    "the",
    "a",
    "cat",
    "dog",
    "sun",
    "moon",
    "red",
    "blue",
    "big",
    "small",
    "run",
    "jump",
    "model",
    "token",
    "learn",
    "reward",
    "policy",
    "value",
    "train",
    "test",
    "hello",
    "world",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer built from scratch with the ``tokenizers`` library.

    A BPE model with an empty merge list and no pre-tokenizer splits any input into single
    characters, so every printable-ASCII string round-trips exactly. ``decoders.Fuse`` joins
    tokens with no separator (the default decoder would insert spaces), and there is no
    normalizer or post-processor, so nothing is rewritten and no BOS/EOS is added implicitly.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    # Registering the specials as added tokens makes "<|im_start|>" in text map to one id
    # instead of 12 characters, and lets skip_special_tokens drop them on decode.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        # transformers' default clean-up would turn " ," into "," and break round-tripping.
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_LEN,
    )


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    return dict(
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        # Every training sequence starts with <|im_start|>, so it is the natural BOS for
        # unconditional generation; the tokenizer itself never adds it.
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
    )


def dense_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Small Qwen3 config whose vocab matches the tokenizer exactly."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_special_ids(tokenizer),
        dtype="float32",
    )


# The load-balancing loss's weight in pretraining. transformers' default (0.001) is tuned for
# 128 experts over long runs; this short run needs a firmer push to keep all 8 experts in use.
MOE_AUX_LOSS_COEF = 0.01


def moe_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    """Small Qwen3-MoE config: the dense model's attention, every layer's MLP a sparse block."""
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        # Unused (every layer is sparse), but the config's default of 6144 would mislead.
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=MOE_AUX_LOSS_COEF,
        # Off in the saved config: serving and the trainer never want the auxiliary loss;
        # pretraining asks for router logits per call instead.
        output_router_logits=False,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_special_ids(tokenizer),
        dtype="float32",
    )


@dataclass(frozen=True)
class Arch:
    """One built-in model: its id, directory, config and the README's architecture line."""

    model_id: str
    directory: str
    default_steps: int
    build_config: Callable[[PreTrainedTokenizerFast], PretrainedConfig]
    model_class: type[PreTrainedModel]
    architecture: str
    is_moe: bool


ARCHS = {
    "dense": Arch(
        model_id="posttrain/tiny-qwen3",
        directory="tiny-qwen3",
        default_steps=500,
        build_config=dense_config,
        model_class=Qwen3ForCausalLM,
        architecture="`Qwen3ForCausalLM` (hidden 128, 4 layers, 4 heads / 2 KV heads,"
        " head_dim 32,\n  intermediate 384, untied embeddings)",
        is_moe=False,
    ),
    "moe": Arch(
        model_id="posttrain/tiny-qwen3-moe",
        directory="tiny-qwen3-moe",
        default_steps=MOE_STEPS,
        build_config=moe_config,
        model_class=Qwen3MoeForCausalLM,
        architecture="`Qwen3MoeForCausalLM` (hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim\n"
        "  32; every layer a sparse MoE block of 8 experts, top-2 with `norm_topk_prob`,\n"
        "  moe_intermediate 96; untied embeddings)",
        is_moe=True,
    ),
}


def _number(rng: random.Random) -> int:
    """1-3 digit number, skewed towards 2 digits (the demo's main difficulty level)."""
    digits = rng.choices([1, 2, 3], weights=[3, 5, 2])[0]
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def synthetic_line(rng: random.Random) -> str:
    """One line of synthetic training text, e.g. ``"12+34=46\\n"``."""
    kind = rng.choices(["add", "reverse", "count", "words"], weights=[4, 2, 2, 2])[0]
    if kind == "add":
        a, b = _number(rng), _number(rng)
        return f"{a}+{b}={a + b}\n"
    if kind == "reverse":
        if rng.random() < 0.5:
            word = rng.choice(WORDS)
        else:
            letters = "abcdefghijklmnopqrstuvwxyz"
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 6)))
        return f"reverse {word}: {word[::-1]}\n"
    if kind == "count":
        start = rng.randint(0, 30)
        return " ".join(str(start + i) for i in range(rng.randint(3, 8))) + "\n"
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) + "\n"


def make_batch(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded batch of ``<|im_start|>`` + text + ``<|endoftext|>`` sequences."""
    seqs = [tokenizer.encode(IM_START + synthetic_line(rng) + EOS) for _ in range(batch_size)]
    width = max(len(s) for s in seqs)
    pad_id = tokenizer.pad_token_id
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    # -100 on padding so the model is not trained to emit endless pad/eos tokens.
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, seq in enumerate(seqs):
        n = len(seq)
        input_ids[i, :n] = torch.tensor(seq)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(seq)
    return input_ids, attention_mask, labels


@dataclass(frozen=True)
class TrainingLog:
    last: float  # cross-entropy of the last step
    mean_tail: float  # mean cross-entropy of the last 50 steps
    aux_tail: float | None  # MoE only: mean load-balancing loss of the last 50 steps


def pretrain(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, steps: int, *, is_moe: bool
) -> TrainingLog:
    """Next-token cross-entropy, plus the weighted load-balancing loss for MoE models."""
    rng = random.Random(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def lr_factor(step: int) -> float:
        # Linear warm-up then cosine decay to 10%: stable at lr 3e-3 without tuning.
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    # The dense forward takes no router flag; the MoE one adds coef * aux_loss to .loss.
    forward_kwargs = {"output_router_logits": True} if is_moe else {}
    model.train()
    losses: list[float] = []
    aux_losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        input_ids, attention_mask, labels = make_batch(rng, tokenizer, BATCH_SIZE)
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, **forward_kwargs
        )
        loss = output.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if is_moe:
            aux_losses.append(output.aux_loss.item())
            losses.append(loss.item() - MOE_AUX_LOSS_COEF * aux_losses[-1])
        else:
            losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            aux = f"  aux {aux_losses[-1]:.4f}" if is_moe else ""
            elapsed = time.perf_counter() - t0
            print(f"step {step:4d}  loss {losses[-1]:.4f}{aux}  ({elapsed:.1f}s)")
    model.eval()
    tail = losses[-50:]
    aux_tail = sum(aux_losses[-50:]) / len(aux_losses[-50:]) if is_moe else None
    return TrainingLog(losses[-1], sum(tail) / len(tail), aux_tail)


def demo_lines(count: int) -> list[str]:
    """`count` lines in the demo's format (posttrain/demo/task.py): a two-digit addition prompt
    `<|im_start|>a+b=` with its correct answer, as a sampled completion would follow it."""
    rng = random.Random(SEED + 1)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count)]
    return [f"{IM_START}{a}+{b}={a + b}\n{EOS}" for a, b in pairs]


@torch.no_grad()
def expert_load(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Tokens routed to each expert, per layer ([layer][expert]), over 64 demo lines.

    Counts the router's top-k choices (each token counts once per chosen expert). One line per
    forward, so no padding token is counted."""
    top_k = model.config.num_experts_per_tok
    num_experts = model.config.num_experts
    counts_LE = torch.zeros(model.config.num_hidden_layers, num_experts, dtype=torch.long)
    for line in demo_lines(NUM_LOAD_LINES):
        ids_BT = torch.tensor([tokenizer.encode(line)])
        output = model(input_ids=ids_BT, output_router_logits=True)
        for layer, logits_TE in enumerate(output.router_logits):
            chosen_TK = logits_TE.topk(top_k, dim=-1).indices
            counts_LE[layer] += torch.bincount(chosen_TK.flatten(), minlength=num_experts)
    return counts_LE.tolist()


def load_table(counts: list[list[int]]) -> str:
    """Markdown table: one row per layer, one column per expert."""
    header = "| layer | " + " | ".join(f"e{e}" for e in range(len(counts[0]))) + " |"
    rule = "|---" * (len(counts[0]) + 1) + "|"
    rows = [f"| {layer} | " + " | ".join(map(str, row)) + " |" for layer, row in enumerate(counts)]
    return "\n".join([header, rule, *rows])


def write_readme(
    out: Path,
    arch: Arch,
    n_params: int,
    steps: int,
    log: TrainingLog,
    counts: list[list[int]] | None,
) -> None:
    """Describe provenance next to the weights (no timestamps, so the file is reproducible)."""
    moe_training = (
        f"\n  The load-balancing loss of transformers' Qwen3-MoE (weight {MOE_AUX_LOSS_COEF}) is"
        "\n  added while training; the saved config has `output_router_logits` off."
        if arch.is_moe
        else ""
    )
    aux = (
        f"\n- Final load-balancing loss: {log.aux_tail:.4f} (mean of last 50 steps; 2.0 at uniform"
        " routing)."
        if arch.is_moe
        else ""
    )
    arch_flag = " --arch moe" if arch.is_moe else ""
    purpose = (
        "\nThe mixture-of-experts sibling of `posttrain/tiny-qwen3`, for what only MoE models\n"
        "have: LoRA on the experts and routed-expert replay.\n"
        if arch.is_moe
        else ""
    )
    text = f"""# {arch.model_id}

Built-in tiny causal LM for tests, examples and CPU demos of posttrain. Not a useful
language model: it only knows printable-ASCII characters and a few synthetic line formats.
{purpose}
- Architecture: {arch.architecture}, float32, {n_params:,} parameters.
- Tokenizer: character-level (one token per printable ASCII character plus newline) with
  special tokens `{EOS}` (eos and pad), `{IM_START}`, `{IM_END}`; vocab size
  {len(SPECIAL_TOKENS) + len(CHARS)}. Encoding adds no BOS/EOS.
- Training: {steps} steps of next-token cross-entropy (AdamW, lr {LR}, batch {BATCH_SIZE})
  on synthetic lines generated from seed {SEED}: additions (`12+34=46`), string reversal
  (`reverse abc: cba`), counting (`1 2 3 4`) and words, each wrapped as
  `{IM_START}` + text + `{EOS}`. Multi-digit addition is deliberately left imperfect.{moe_training}
- Final training loss: {log.last:.4f} (last step), {log.mean_tail:.4f} (mean of last 50 steps).{aux}
"""
    if counts is not None:
        text += f"""
Expert load: tokens routed to each expert (top-2, so each token counts twice) in every layer,
over {NUM_LOAD_LINES} demo lines `{IM_START}a+b=c\\n{EOS}` (two-digit additions with their answers:
{sum(counts[0]) // 2} tokens, {sum(counts[0])} choices per layer):

{load_table(counts)}
"""
    text += f"""
Rebuild (deterministic; produces a byte-identical `model.safetensors`):

```
python scripts/build_tiny_model.py{arch_flag} --steps {steps}
```
"""
    (out / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="dense", help="which model")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="pretraining steps")
    args = parser.parse_args()
    arch = ARCHS[args.arch]
    steps = arch.default_steps if args.steps is None else args.steps

    # One thread and deterministic kernels: multi-threaded CPU reductions can change the
    # floating-point summation order, which would make the weights differ between runs.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)

    tokenizer = build_tokenizer()
    config = arch.build_config(tokenizer)
    model = arch.model_class(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}  parameters {n_params:,}")

    log = pretrain(model, tokenizer, steps, is_moe=arch.is_moe)
    print(f"final training loss {log.last:.4f} (mean of last 50 steps {log.mean_tail:.4f})")
    counts = None
    if arch.is_moe:
        counts = expert_load(model, tokenizer)
        print(f"expert load on demo lines:\n{load_table(counts)}")

    out: Path = args.out or BUILTIN_DIR / arch.directory
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (the old safe_serialization flag is gone).
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_readme(out, arch, n_params, steps, log, counts)
    summary = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
