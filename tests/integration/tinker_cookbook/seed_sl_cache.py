"""Seed a Hugging Face cache so unmodified tinker-cookbook recipes run offline.

The cookbook names its tokenizer and some of its data by hub id: `get_tokenizer(model_name)`
calls `AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")`, and `recipes.sl_loop` calls
`datasets.load_dataset("HuggingFaceH4/no_robots")` with no way to pass another dataset. With
HF_HUB_OFFLINE=1 both libraries read what their own caches hold, so this writes, under
HF_HOME:

- hub/models--<org>--<name>/: revision `main` -> snapshot `local`, holding the tiny model's
  tokenizer and config (the served model's own files, so token ids agree with the server);
- datasets/<org>___<name>/default/0.0.0/local/: the Arrow stream and dataset_info.json that
  `datasets`' cache builder reloads when the hub cannot be reached, one `train` split made of
  the conversations in a JSONL file (one {"messages": [...]} object a line).

Run with the tinker interpreter (its `datasets` writes the cache it will read):
`python seed_sl_cache.py HF_HOME MODEL_NAME MODEL_DIR DATASET_ID CONVERSATIONS_JSONL`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import datasets
import pyarrow as pa
from datasets.naming import camelcase_to_snakecase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def seed_model(hf_home: Path, model_name: str, model_dir: Path) -> Path:
    repo = hf_home / "hub" / f"models--{model_name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return snapshot


def seed_dataset(hf_home: Path, dataset_id: str, conversations: Path) -> Path:
    rows = [json.loads(line) for line in conversations.read_text().splitlines() if line.strip()]
    table = datasets.Dataset.from_list(rows)
    namespace, name = dataset_id.split("/")
    directory = (
        hf_home / "datasets" / f"{namespace}___{camelcase_to_snakecase(name)}"
    ) / "default/0.0.0/local"
    directory.mkdir(parents=True, exist_ok=True)
    arrow = table.data.table
    with pa.OSFile(str(directory / f"{name}-train.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, arrow.schema) as writer:
            writer.write_table(arrow)
    info = table.info.copy()
    info.config_name = "default"
    info.dataset_name = name
    info.version = datasets.Version("0.0.0")
    info.splits = datasets.SplitDict(dataset_name=name)
    info.splits.add(
        datasets.SplitInfo(
            name="train", num_bytes=arrow.nbytes, num_examples=len(rows), dataset_name=name
        )
    )
    info.write_to_directory(str(directory))
    return directory


if __name__ == "__main__":
    home, model_name, model_dir, dataset_id, conversations = sys.argv[1:6]
    seed_model(Path(home), model_name, Path(model_dir))
    seed_dataset(Path(home), dataset_id, Path(conversations))
    print(json.dumps({"hf_home": home}))
