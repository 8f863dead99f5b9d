"""The family table (docs/model_families.md) and the verdicts the start-up check reads
(posttrain/model/families.py), both written by scripts/model_families.py: they agree, every
causal-LM model type of the installed transformers has a row, the walk reproduces the verdicts
of a fixed set of families (served ones exactly, against plain transformers), and a refused
type stops at the start-up check naming the model type and the table's reason."""

from __future__ import annotations

import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import model_families  # noqa: E402

from posttrain import cli  # noqa: E402
from posttrain.config import BUILTIN_MODEL_DIR  # noqa: E402
from posttrain.model import families  # noqa: E402
from posttrain.model.loader import servable_problem  # noqa: E402

ROW = re.compile(r"^\| `([^`]+)` \| (served|refused|pending) \| (.*) \|$")
# Walked again here (the table's verdicts must come out): served families of each kind (dense,
# GPT-2's fused qkv, latent attention with MoE, eager soft-capped attention, a mixture
# of experts, attention sinks, fused qkv and gate_up, a multimodal wrapper served through its
# text config, another family's MLA, a router Linear inside a gate module), refused ones of
# each kind (an encoder, a decoder half of an encoder-decoder, a state-space model, short
# convolutions, posttrain failing on it: DeepSeek-V3.2's sparse attention indexer), and a
# Gated DeltaNet hybrid (served: docs/models.md). A change to posttrain that turns one of
# these fails here until the table is generated again.
WALKED = (
    *("llama", "gpt2", "deepseek_v3", "gemma2", "mixtral", "gpt_oss", "phi3", "gemma3"),
    *("bert", "bart", "mamba", "lfm2", "xglm", "youtu", "deepseek_v32", "qwen3_next"),
    "hunyuan_v1_moe",
)
SERVED_HERE = {
    *("llama", "gpt2", "deepseek_v3", "gemma2", "mixtral", "gpt_oss", "phi3", "gemma3"),
    *("youtu", "qwen3_next", "hunyuan_v1_moe"),
}


def table_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (ROOT / "docs" / "model_families.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match[1]] = (match[2], match[3].replace("\\|", "|"))
    return rows


def test_the_table_and_the_verdicts_agree_and_cover_every_installed_causal_lm_type():
    rows = table_rows()
    verdicts = {t: ("served", "") for t in families.SERVED}
    verdicts |= {t: ("refused", why) for t, why in families.REFUSED.items()}
    verdicts |= {t: ("pending", why) for t, why in families.PENDING.items()}
    assert {t: status for t, (status, _) in rows.items()} == {
        t: status for t, (status, _) in verdicts.items()
    }
    for status, reasons in (("refused", families.REFUSED), ("pending", families.PENDING)):
        assert {t: why for t, (s, why) in rows.items() if s == status} == reasons
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(rows)
    assert list(rows) == sorted(rows)
    # The other model work's types are never refused by the table, and only they are pending.
    assert not [t for t in families.REFUSED if model_families.owned_elsewhere(t)]
    assert all(model_families.owned_elsewhere(t) for t in families.PENDING)


def test_the_walk_reproduces_the_table_for_a_fixed_set_of_families():
    rows = table_rows()
    walked = model_families.walk(WALKED)
    assert {t: (v.status, v.why) for t, v in walked.items()} == {t: rows[t] for t in WALKED}
    assert {t for t, v in walked.items() if v.status == "served"} == SERVED_HERE


def test_a_refused_type_stops_the_start_up_check_naming_it_and_the_reason(tmp_path, capsys):
    config = next(model_families.tiny_configs("mamba"))
    config.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, tmp_path / name)
    problem = servable_problem(tmp_path)
    assert problem == f"model_type 'mamba' is not served: {families.REFUSED['mamba']}"
    assert "Mamba state-space layers" in problem
    with pytest.raises(SystemExit) as exit_info:  # `posttrain serve` stops before it starts
        cli.main(["serve", "--model", str(tmp_path)])
    assert exit_info.value.code == 2
    assert problem in capsys.readouterr().err


def test_a_type_the_table_does_not_list_or_lists_as_pending_is_allowed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert families.refusal("a-newer-family") is None
    assert "'a-newer-family' is not in posttrain's family table" in caplog.text
    for model_type in families.PENDING:  # the Gated DeltaNet and Qwen3-VL work's types
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="posttrain"):
            assert families.refusal(model_type) is None
        assert f"{model_type!r} is served unverified" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        assert families.refusal("llama") is None
    assert caplog.text == ""
