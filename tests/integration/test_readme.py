"""The README is true where a program can check it: every ```python block runs as written
against a real `posttrain serve`, every relative link and every repository path it names
exists, every flag its `posttrain` command lines use is one the CLI accepts, and its test
command is the one CI runs.

The Python blocks address the server a user starts with a bare `posttrain serve`
(`http://127.0.0.1:8000`); the test runs each against its own server on a free port by
replacing that address, and nothing else, so a block that stops naming it fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ServerProcess

from posttrain.config import BUILTIN_MODELS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEFAULT_URL = "http://127.0.0.1:8000"
REPO_DIRS = ("posttrain", "bench", "examples", "tests", "docs", "scripts", ".ci")


def readme_text() -> str:
    """README.md without HTML comments (notes to maintainers are not what a user reads)."""
    return re.sub(r"<!--.*?-->", "", README.read_text(), flags=re.S)


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", readme_text(), flags=re.S | re.M)


PYTHON_BLOCKS = blocks("python")


def test_the_readme_has_the_blocks_this_test_checks():
    assert len(PYTHON_BLOCKS) >= 2 and len(blocks("bash")) >= 4


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory):
    """The server the README's scaling-out block names: generator replica processes, so its
    resource gets the replicas it asks for (an inline server refuses more than one)."""
    directory = tmp_path_factory.mktemp("readme")
    proc = ServerProcess.started(directory, "--generators", "process")
    yield proc
    proc.stop()


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs_as_written_against_a_server(index, shared_server, tmp_path, request):
    """A block that imports the tinker SDK itself runs in the tinker 0.38 interpreter
    (tests/tinker_env.py), where a call the SDK deprecates fails it; the others in this one,
    with the Together SDK."""
    code = PYTHON_BLOCKS[index]
    is_tinker = re.search(r"^import tinker\b", code, flags=re.M) is not None
    python = request.getfixturevalue("tinker_python") if is_tinker else sys.executable
    assert DEFAULT_URL in code, "a block must address the server `posttrain serve` starts"
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(code.replace(DEFAULT_URL, shared_server.base_url))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TOGETHER_BASE_URL", None)
    env.pop("TOGETHER_API_KEY", None)
    # The SDK warns at the caller's line (stacklevel): warnings raised in the block's own code.
    strict = ["-W", "error::DeprecationWarning:__main__", "-W", "error::FutureWarning:__main__"]
    completed = subprocess.run(
        [python, *(strict if is_tinker else []), str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.strip(), "every block prints what it did"
    losses = [float(x) for x in re.findall(r"step \d+: loss (\d+\.\d+)", completed.stdout)]
    if losses:  # a training block: its steps really train
        assert len(losses) >= 2 and losses[-1] < losses[0], completed.stdout


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    text = readme_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            assert anchor in anchors, f"README link {target!r}: no such heading"
            continue
        assert (ROOT / path).exists(), f"README link {target!r}: no such file in the repository"


def test_every_repository_path_named_exists():
    named = re.findall(r"`([^`\s]+)`", readme_text())
    paths = [
        name.rstrip("/")
        for name in named
        if name.split("/")[0] in REPO_DIRS and "/" in name and name not in BUILTIN_MODELS
    ]
    assert len(paths) > 10
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README names paths the repository does not have: {missing}"
    # A bare file name of a document or module must be one the repository holds somewhere.
    files = {p.name for d in REPO_DIRS for p in (ROOT / d).rglob("*")} | {"README.md"}
    documents = re.findall(r"(?<![\w/.-])([\w-]+\.md)\b", readme_text())
    bare = [n for n in named if re.fullmatch(r"[\w.-]+\.py", n)] + documents
    lacking = [n for n in bare if n not in files]
    assert not lacking, f"README names files a user lacks: {lacking}"


def test_the_readme_tells_no_project_history():
    text = readme_text()
    for pattern in (r"\bissue \d+", r"seed-era", r"\bseed \d{3}\b", r"earlier code", r"\blent\b"):
        assert not re.search(pattern, text, flags=re.I), f"README history: {pattern!r}"


def _help(command: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "posttrain", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    return completed.stdout


def test_every_flag_of_a_posttrain_command_line_exists():
    helps = {command: _help(command) for command in ("serve", "demo")}
    used = 0
    for block in blocks("bash"):
        for line in block.splitlines():
            match = re.search(r"posttrain (serve|demo)\b([^#&]*)", line)
            if match is None:
                continue
            for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", match.group(2)):
                used += 1
                assert re.search(rf"{flag}\b", helps[match.group(1)]), (
                    f"`posttrain {match.group(1)}` has no {flag} (README line: {line.strip()!r})"
                )
    assert used > 10


def test_the_readme_test_command_is_the_one_ci_runs():
    first_block = blocks("bash")[0].splitlines()
    test_command = next(line for line in first_block if "pytest" in line)
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
