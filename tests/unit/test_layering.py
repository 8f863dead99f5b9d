"""The layering of STYLE.md section 1 holds: api -> service -> engine -> model, one way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
ALLOWED = {
    "api": {"service"},
    "service": {"store", "engine"},
    "store": set(),
    "engine": {"model"},
    "model": set(),
}
FOUNDATION = {"config", "errors", "types", "loss_specs"}


def imported_posttrain_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("posttrain.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("posttrain."):
                found.add(node.module)
    return {name.split(".")[1] for name in found}


def test_each_layer_imports_only_the_layers_below_it():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        layer = parts[0] if len(parts) > 1 else None
        if layer not in ALLOWED:
            continue
        for target in imported_posttrain_modules(path):
            if target != layer and target not in ALLOWED[layer] and target not in FOUNDATION:
                violations.append(f"{path.relative_to(PACKAGE)} imports posttrain.{target}")
    assert not violations, violations


def test_foundation_modules_import_nothing_above_them():
    for name in ("errors", "types"):
        imports = imported_posttrain_modules(PACKAGE / f"{name}.py")
        assert imports <= {"errors"}, (name, imports)
    assert imported_posttrain_modules(PACKAGE / "config.py") <= {"errors"}
    assert imported_posttrain_modules(PACKAGE / "loss_specs.py") <= {"errors", "types"}


def test_the_server_never_imports_the_together_sdk():
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "demo":
            continue  # `posttrain demo` is a client of the API, not part of the server
        assert "import together" not in path.read_text(), path
        assert "from together" not in path.read_text(), path


def test_the_cli_loads_neither_the_sdk_nor_torch():
    """`posttrain serve` imports the CLI, which registers `posttrain demo`: the demo's client
    imports (together, transformers, torch) must wait until the demo runs."""
    code = (
        "import sys, posttrain.cli; "
        "print(sorted(m for m in ('together', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
