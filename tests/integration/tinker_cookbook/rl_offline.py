"""An offline Hugging Face home for the cookbook's RL recipes: what they would download,
written where the `transformers` and `datasets` libraries look first when HF_HUB_OFFLINE=1.

- The tokenizer of each hub name (`Qwen/Qwen3-8B`, ...): the cookbook calls
  `AutoTokenizer.from_pretrained(name)`; a hub cache entry whose `refs/main` names a local
  snapshot holding the tiny model's tokenizer files answers it in every process.
- `openai/gsm8k` (config `main`; rl_loop, rl_basic, math_rl env=gsm8k),
  `zwhe99/DeepMath-103K` and `allenai/tulu-3-sft-mixture` (config `default`; on-policy
  distillation, with one teacher or one per dataset): offline, `load_dataset(repo)` falls back
  to the prepared-dataset cache (`<ns>___<snake name>/<config>/0.0.0/<hash>/` holding
  `dataset_info.json` and `<snake name>-<split>.arrow`), which this writes with the datasets
  library's own writer. Every question is a one-digit sum: short prompts for a model with a
  512-token context.

Run with the tinker 0.38 interpreter (it holds `datasets`):
`python rl_offline.py HF_HOME TOKENIZER_DIR HUB_NAME...`. Prints the problems as JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import datasets
from datasets.arrow_writer import ArrowWriter
from datasets.naming import camelcase_to_snakecase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
PAIRS = [(1, 2), (3, 4), (2, 2), (1, 5), (4, 4), (2, 3), (0, 9), (1, 1)]


def problems() -> list[dict[str, object]]:
    return [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in PAIRS]


def seed_tokenizer(hf_home: Path, tokenizer_dir: Path, hub_name: str) -> None:
    repo = hf_home / "hub" / f"models--{hub_name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, snapshot / name)


def seed_dataset(cache: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    namespace, name = repo.split("/")
    snake = camelcase_to_snakecase(name)
    directory = cache / f"{namespace}___{snake}" / config / "0.0.0" / "local"
    directory.mkdir(parents=True, exist_ok=True)
    features = datasets.Dataset.from_list(next(iter(splits.values()))).features
    infos = {}
    for split, rows in splits.items():
        with ArrowWriter(features=features, path=str(directory / f"{snake}-{split}.arrow")) as out:
            for row in rows:
                out.write(row)
            count, size = out.finalize()
        infos[split] = datasets.SplitInfo(
            name=split, num_bytes=size, num_examples=count, dataset_name=snake
        )
    datasets.DatasetInfo(
        features=features,
        config_name=config,
        dataset_name=snake,
        splits=datasets.SplitDict(infos, dataset_name=snake),
    ).write_to_directory(str(directory))


def main(hf_home: Path, tokenizer_dir: Path, hub_names: list[str]) -> None:
    for hub_name in hub_names:
        seed_tokenizer(hf_home, tokenizer_dir, hub_name)
    items = problems()
    gsm8k = [{"question": p["question"], "answer": f"#### {p['answer']}"} for p in items]
    seed_dataset(hf_home / "datasets", "openai/gsm8k", "main", {"train": gsm8k, "test": gsm8k})
    deepmath = [
        {"question": p["question"], "final_answer": str(p["answer"]), "difficulty": 1.0}
        for p in items
    ]
    seed_dataset(hf_home / "datasets", "zwhe99/DeepMath-103K", "default", {"train": deepmath})
    tulu3 = [
        {
            "id": f"sum-{i}",
            "messages": [
                {"role": "user", "content": p["question"]},
                {"role": "assistant", "content": str(p["answer"])},
            ],
            "source": "posttrain",
        }
        for i, p in enumerate(items)
    ]
    seed_dataset(hf_home / "datasets", "allenai/tulu-3-sft-mixture", "default", {"train": tulu3})
    print(json.dumps(items))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
