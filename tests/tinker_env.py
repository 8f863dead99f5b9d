"""The interpreter that runs the Tinker 0.38 client in tests: `.venv-tinker` at the repo root.

The test venv holds `tinker==0.23.1` (the `together` SDK's tinker shim pins it), and the
Tinker-native surface is judged by the unmodified `tinker==0.38.0` SDK and
`tinker-cookbook==0.6.1`: two versions of one package cannot share a venv. This module owns
the second one: created on first use (under a file lock, so parallel pytest processes build it
once), reused after, rebuilt when PINS change. It holds only what the test venv lacks: a `.pth`
file adds the test venv's site-packages after its own, so its tinker shadows 0.23.1 while
torch, transformers and the rest come from the test venv (no second torch install).

The cookbook is installed with `--no-deps`: its metadata asks for torch (already there through
the `.pth`) and tml-renderers>=0.4.1, which only its Inkling, Kimi-K3 and audio paths import.
COOKBOOK_DEPS is the rest of its requirements plus its `math-rl` extra (math_rl, rl_loop).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_DIR = REPO_ROOT / ".venv-tinker"

TINKER_VERSION = "0.38.0"
COOKBOOK_VERSION = "0.6.1"
# Installed with dependencies, resolved against the test venv's packages (pip sees them through
# the .pth, and installs only what they lack or do not satisfy).
COOKBOOK_DEPS = (
    f"tinker=={TINKER_VERSION}",
    "aiohttp==3.14.5",
    "blobfile==3.3.0",
    "chz==0.4.0",
    "cloudpickle==3.1.3",
    "datasets==5.2.0",
    "pillow==13.0.0",
    "pyrage==1.4.0",
    "termcolor==3.3.0",
    "tiktoken==0.14.0",
    "sympy>=1.12",
    "pylatexenc==2.11",
    "math-verify==0.9.0",
)
# Installed without dependencies (see the module docstring).
COOKBOOK = f"tinker-cookbook=={COOKBOOK_VERSION}"

# The cookbook's training entry points the Tinker surface is run with; each must import.
ENTRY_POINTS = (
    "tinker_cookbook.supervised.train",
    "tinker_cookbook.rl.train",
    "tinker_cookbook.preference.train_dpo",
    "tinker_cookbook.distillation.train_on_policy",
    "tinker_cookbook.distillation.train_off_policy",
    "tinker_cookbook.recipes.sl_loop",
    "tinker_cookbook.recipes.rl_loop",
    "tinker_cookbook.recipes.sl_basic",
    "tinker_cookbook.recipes.math_rl.train",
    "tinker_cookbook.recipes.chat_sl.train",
    "tinker_cookbook.recipes.preference.dpo.train",
    "tinker_cookbook.recipes.distillation.on_policy_distillation",
)

STAMP = "posttrain-tinker-env.json"
PTH = "zz-posttrain-test-venv.pth"  # sorts last: the test venv's packages come after all else

# Run in the new interpreter: prints what it found, exits non-zero if anything is off.
VERIFY = """
import importlib, json, sys
import tinker
found = {"tinker": tinker.__version__, "failed": {}}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        found["failed"][name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
sys.exit(1 if found["failed"] or found["tinker"] != %r else 0)
"""


def spec() -> dict[str, object]:
    """What a built venv must match to be reused: the pins and the venv it layers over."""
    return {
        "deps": list(COOKBOOK_DEPS),
        "cookbook": COOKBOOK,
        "base_site_packages": sysconfig.get_path("purelib"),
        "python": sys.version,
    }


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(command: list[str | Path], what: str) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def verify(python: Path) -> dict[str, object]:
    """tinker's version and the entry points' import errors, as the interpreter reports them."""
    done = subprocess.run(
        [str(python), "-c", VERIFY % TINKER_VERSION, *ENTRY_POINTS],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{python} could not check its packages:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def build(venv: Path) -> None:
    """Create `venv` from scratch: a venv layered over this interpreter's site-packages."""
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", venv], "python -m venv")
    own = Path(
        _run(
            [venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            "locating the new venv's site-packages",
        ).strip()
    )
    base = sysconfig.get_path("purelib")
    # addsitedir, not a bare path: the base's own .pth files (editable installs) apply too.
    (own / PTH).write_text(f"import site; site.addsitedir({base!r})\n")
    pip = [venv_python(venv), "-m", "pip", "install", "--quiet"]
    _run([*pip, *COOKBOOK_DEPS], f"pip install {' '.join(COOKBOOK_DEPS)}")
    _run([*pip, "--no-deps", COOKBOOK], f"pip install --no-deps {COOKBOOK}")
    found = verify(venv_python(venv))
    if found["failed"] or found["tinker"] != TINKER_VERSION:
        raise RuntimeError(f"{venv} was built but does not hold what tests need: {found}")
    (venv / STAMP).write_text(json.dumps(spec(), indent=1))


def ensure_tinker_env(venv: Path = VENV_DIR) -> Path:
    """The python of `venv`, built first unless an earlier build with the same spec is there.
    Concurrent callers (pytest processes) wait on one lock; the first builds, the rest reuse."""
    lock_path = venv.parent / f"{venv.name}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = venv / STAMP
        current = json.loads(stamp.read_text()) if stamp.is_file() else None
        if current != spec() or not venv_python(venv).exists():
            build(venv)
    return venv_python(venv)


@pytest.fixture(scope="session")
def tinker_python() -> Path:
    """A python with tinker==0.38.0 and tinker-cookbook==0.6.1 (and this repo's test venv's
    torch and transformers beneath them)."""
    return ensure_tinker_env()
