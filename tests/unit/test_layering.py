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
FOUNDATION = {"config", "errors", "statuses", "types", "records", "units", "loss_specs"}


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
    assert imported_posttrain_modules(PACKAGE / "statuses.py") == set()
    for name in ("errors", "types"):
        imports = imported_posttrain_modules(PACKAGE / f"{name}.py")
        assert imports <= {"errors", "statuses"}, (name, imports)
    assert imported_posttrain_modules(PACKAGE / "records.py") <= {"statuses", "types"}
    assert imported_posttrain_modules(PACKAGE / "units.py") == set()
    assert imported_posttrain_modules(PACKAGE / "config_flags.py") == set()
    assert imported_posttrain_modules(PACKAGE / "config.py") <= {"config_flags", "errors", "units"}
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


# Inside engine/: the compute core (what the engine computes) knows nothing of where it runs.
ENGINE = PACKAGE / "engine"
HOSTS = "posttrain.engine.hosts"
BUILD = "posttrain.engine.build"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_edges(path: Path) -> set[str]:
    """The posttrain modules `path` imports anywhere (module level, functions, TYPE_CHECKING),
    by full dotted name: `from a.b import c` is an edge to a.b.c where c is a module."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            ]
        else:
            continue
        edges |= {target for target in targets if target in MODULES}
    return edges - {module_name(path)}


def test_the_engine_core_never_imports_its_hosts():
    """Only engine/hosts/ (where the engine runs: processes, ranks, replicas, Ray) and
    engine/build.py (which picks them) may import engine/hosts/."""
    violations = []
    for name, path in MODULES.items():
        if not name.startswith("posttrain.engine") or name.startswith(HOSTS) or name == BUILD:
            continue
        for target in import_edges(path):
            if target.startswith(HOSTS) or target == BUILD:
                violations.append(f"{name} imports {target}")
    assert not violations, violations


def test_parallel_knows_nothing_of_optimizers():
    """engine/optim/ steps FSDP2 shards through the layout engine/parallel/ owns, one way:
    parallel/ never imports optim/."""
    violations = [
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.startswith("posttrain.engine.parallel")
        for target in import_edges(path)
        if target.startswith("posttrain.engine.optim")
    ]
    assert not violations, violations


def test_the_import_graph_has_no_cycle():
    """No module reaches itself through imports, counting those inside functions: an import
    inside a function is for an optional or heavy dependency loaded at call time (ray,
    torch.distributed, the demo's client), never to dodge a circle."""
    graph = {name: import_edges(path) for name, path in MODULES.items()}
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append(trail[trail.index(name) :] + [name])
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, cycles


# What the service may import of the engine: the protocol, the builder, the engine's files as
# the service reads them, and the request rules checked before an operation is queued.
ENGINE_SURFACE = {
    "posttrain.engine.interface",
    "posttrain.engine.build",
    "posttrain.engine.files",
    "posttrain.engine.images",
    "posttrain.engine.optim.step_settings",
    "posttrain.engine.train.expert_routes",
}


def test_the_service_sees_the_engine_through_its_surface():
    """The engine owns its file formats and its hosts: the service names neither
    engine/checkpoint/ nor engine/hosts/, only ENGINE_SURFACE."""
    violations = [
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.startswith(("posttrain.service", "posttrain.api"))
        for target in import_edges(path)
        if target.startswith("posttrain.engine") and target not in ENGINE_SURFACE
    ]
    assert violations == [], violations


MAX_FOLDER_MODULES = 16


def test_no_folder_holds_more_than_16_modules():
    """A folder names one concept; past 16 modules it holds several, and wants subfolders."""
    counts: dict[Path, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {
        str(folder.relative_to(PACKAGE.parent)): n
        for folder, n in counts.items()
        if n > MAX_FOLDER_MODULES
    }
    assert crowded == {}, crowded


def package_of(name: str) -> str:
    """posttrain.engine.generate.sampler -> posttrain.engine.generate; modules directly in
    engine/ count as the package posttrain.engine."""
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else ".".join(parts[:2])


def test_the_engine_packages_depend_one_way():
    """Inside engine/, the packages (generate, memory, optim, parallel, train, checkpoint, hosts)
    form no cycle: each depends on the ones below it, never back."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if not name.startswith("posttrain.engine.") or package_of(name) == "posttrain.engine":
            continue
        source = package_of(name)
        for target in import_edges(path):
            if target.startswith("posttrain.engine.") and package_of(target) not in {
                source,
                "posttrain.engine",
            }:
                graph.setdefault(source, set()).add(package_of(target))

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            package = todo.pop()
            if package not in seen:
                seen.add(package)
                todo.extend(graph.get(package, ()))
        return seen

    assert [package for package in sorted(graph) if package in reaches(package)] == []
