"""The package's layers (``hopsched/__init__.py``): no module imports from a layer above
its own, so the pure core never reaches for I/O and the transport never for settings."""

from __future__ import annotations

import ast
from pathlib import Path

import hopsched

PACKAGE = Path(hopsched.__file__).parent
#: From the bottom up; a module may import from its own layer or any below. The client
#: and the relay share a layer and never import each other.
LAYERS = [
    {"errors", "version", "urls"},
    {"amqp"},
    {"core"},
    {"settings", "connect", "topology"},
    {"journal"},
    {"broker"},
    {"client", "relay"},
    {"cli", "integrations", "testing"},
    {"__init__", "__main__"},
]
RANK = {part: rank for rank, layer in enumerate(LAYERS) for part in layer}


def part_of(module: str) -> str:
    """``hopsched.core.ladder`` -> ``core``; ``hopsched`` -> ``__init__``."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """The parts of hopsched that ``path`` imports from (at module level or in a function)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hopsched":
                found |= {alias.name for alias in node.names if alias.name in RANK}
            elif node.module.startswith("hopsched."):
                found.add(part_of(node.module))
        elif isinstance(node, ast.Import):
            found |= {part_of(a.name) for a in node.names if a.name.startswith("hopsched.")}
    return found


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")}
    assert parts - {"__pycache__", "py.typed"} <= set(RANK)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for other in imports_of(path) - {own}:
            if RANK[other] > RANK[own] or {own, other} == {"client", "relay"}:
                upward.append(f"{path.relative_to(PACKAGE)} imports hopsched.{other}")
    assert upward == []
