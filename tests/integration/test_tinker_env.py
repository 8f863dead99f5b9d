"""The Tinker 0.38 client's interpreter (tests/tinker_env.py): the SDK and cookbook versions
the Tinker-native surface is judged by, over this venv's torch rather than a second copy."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from tinker_env import COOKBOOK_VERSION, ENTRY_POINTS, TINKER_VERSION, verify

REPORT = """
import importlib.metadata as md, json, sys
import tinker, torch, transformers, tinker_cookbook
print(json.dumps({
    "tinker": tinker.__version__,
    "tinker_dist": md.version("tinker"),
    "cookbook_dist": md.version("tinker-cookbook"),
    "tinker_file": tinker.__file__,
    "torch_file": torch.__file__,
    "transformers_file": transformers.__file__,
}))
"""


def test_the_interpreter_holds_tinker_038_and_cookbook_061_over_this_venvs_torch(tinker_python):
    done = subprocess.run(
        [str(tinker_python), "-c", REPORT], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["tinker"], found["tinker_dist"]) == (TINKER_VERSION, TINKER_VERSION)
    assert found["cookbook_dist"] == COOKBOOK_VERSION
    venv = tinker_python.parent.parent
    assert Path(found["tinker_file"]).is_relative_to(venv)
    base = Path(sysconfig.get_path("purelib"))
    assert Path(found["torch_file"]).is_relative_to(base)
    assert Path(found["transformers_file"]).is_relative_to(base)
    # This interpreter keeps the shim's tinker: the two versions never meet in one process.
    import tinker

    assert tinker.__version__ != TINKER_VERSION
    assert Path(sys.executable).parent.parent != venv


def test_the_cookbook_training_entry_points_import(tinker_python):
    found = verify(tinker_python)
    assert found == {"tinker": TINKER_VERSION, "failed": {}}
    assert "tinker_cookbook.preference.train_dpo" in ENTRY_POINTS
