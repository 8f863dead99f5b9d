"""Build the built-in tiny causal LM ``posttrain/tiny-qwen3``.

What: a ~0.8M-parameter ``Qwen3ForCausalLM`` plus a character-level tokenizer, written in
Hugging Face format to ``posttrain/model/builtin/tiny-qwen3/`` (package data).

Why: the server's tests, examples and CPU demos need a real causal LM that loads with the
stock ``AutoModelForCausalLM`` / ``AutoTokenizer`` code paths, fits in the repository (< 4 MB),
and works fully offline -- nothing may be downloaded from a model hub. A randomly initialised
model would emit uniform noise, so it is briefly pretrained here on synthetic text (addition,
string reversal, counting, words). That gives it the character distribution and the rough
line formats, while leaving multi-digit addition clearly imperfect so that SFT warm-up + RL
demos have something measurable to improve.

Everything is generated from fixed seeds on one CPU thread, so rebuilding produces a
byte-identical ``model.safetensors``.

Rebuild with::

    python scripts/build_tiny_model.py            # default --out and --steps
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "posttrain" / "model" / "builtin" / "tiny-qwen3"
MODEL_NAME = "posttrain/tiny-qwen3"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Specials first so their ids (0, 1, 2) are stable regardless of the character set.
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
# One token per printable ASCII character, plus newline.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

SEED = 0
DEFAULT_STEPS = 500
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


def build_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Small Qwen3 config whose vocab matches the tokenizer exactly."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
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
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        # Every training sequence starts with <|im_start|>, so it is the natural BOS for
        # unconditional generation; the tokenizer itself never adds it.
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        dtype="float32",
    )


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


def pretrain(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int
) -> tuple[float, float]:
    """Plain next-token cross-entropy; returns (last-step loss, mean of last 50 steps)."""
    rng = random.Random(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    def lr_factor(step: int) -> float:
        # Linear warm-up then cosine decay to 10%: stable at lr 3e-3 without tuning.
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        input_ids, attention_mask, labels = make_batch(rng, tokenizer, BATCH_SIZE)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f}s)")
    model.eval()
    tail = losses[-50:]
    return losses[-1], sum(tail) / len(tail)


def write_readme(out: Path, n_params: int, steps: int, last: float, avg: float) -> None:
    """Describe provenance next to the weights (no timestamps, so the file is reproducible)."""
    text = f"""# {MODEL_NAME}

Built-in tiny causal LM for tests, examples and CPU demos of posttrain. Not a useful
language model: it only knows printable-ASCII characters and a few synthetic line formats.

- Architecture: `Qwen3ForCausalLM` (hidden 128, 4 layers, 4 heads / 2 KV heads, head_dim 32,
  intermediate 384, untied embeddings), float32, {n_params:,} parameters.
- Tokenizer: character-level (one token per printable ASCII character plus newline) with
  special tokens `{EOS}` (eos and pad), `{IM_START}`, `{IM_END}`; vocab size
  {len(SPECIAL_TOKENS) + len(CHARS)}. Encoding adds no BOS/EOS.
- Training: {steps} steps of next-token cross-entropy (AdamW, lr {LR}, batch {BATCH_SIZE})
  on synthetic lines generated from seed {SEED}: additions (`12+34=46`), string reversal
  (`reverse abc: cba`), counting (`1 2 3 4`) and words, each wrapped as
  `{IM_START}` + text + `{EOS}`. Multi-digit addition is deliberately left imperfect.
- Final training loss: {last:.4f} (last step), {avg:.4f} (mean of last 50 steps).

Rebuild (deterministic; produces a byte-identical `model.safetensors`):

```
python scripts/build_tiny_model.py --steps {steps}
```
"""
    (out / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="pretraining steps")
    args = parser.parse_args()

    # One thread and deterministic kernels: multi-threaded CPU reductions can change the
    # floating-point summation order, which would make the weights differ between runs.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)

    tokenizer = build_tokenizer()
    config = build_config(tokenizer)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}  parameters {n_params:,}")

    last, avg = pretrain(model, tokenizer, args.steps)
    print(f"final training loss {last:.4f} (mean of last 50 steps {avg:.4f})")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors (the old safe_serialization flag is gone).
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_readme(out, n_params, args.steps, last, avg)
    summary = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
