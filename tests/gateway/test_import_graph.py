"""The gateway's import graph (docs/architecture.md, the gateway's floors): its parts
(subpackages and top-level modules) stand on at most eight floors, no module imports from
a part above its own, and no modules import each other in a circle. Read from the source
with ``ast``, every import that runs counted, those inside functions too (those under
``if TYPE_CHECKING:`` are for the type checker only). No model, no Redis."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
MAX_FLOORS = 8

# The gateway's parts, lowest first: a module may import its own part and those below.
PART_FLOORS = {
    "errors": 0, "json_input": 0,
    "config": 1, "retry": 1, "attachments": 1, "chat_import": 1, "reasoning": 1,
    "store": 2,
    "engines": 3,
    "replies": 4,
    "api": 5,
    "server": 6, "client": 6,
    "__main__": 7,
}


def modules() -> dict[str, Path]:
    """Every gateway module by its dotted name (packages by their ``__init__``)."""
    out = {}
    for f in GATEWAY.rglob("*.py"):
        name = ".".join(f.relative_to(GATEWAY.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = f
    return out


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the gateway modules it imports (a package's ``__init__`` counts as none)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name and t.count(".") >= 1
                               and not (GATEWAY / Path(*t.split(".")[1:]) / "__init__.py").exists())
    return graph


def part(module: str) -> str:
    return module.split(".")[1]


def test_every_module_belongs_to_a_part_of_known_floor():
    assert {part(m) for m in modules() if m != "gateway"} <= set(PART_FLOORS)


def test_no_module_imports_from_a_part_above_its_own():
    upward = [f"{m} -> {t}" for m, ts in import_graph().items() for t in ts
              if PART_FLOORS[part(t)] > PART_FLOORS[part(m)]]
    assert upward == []


def test_the_parts_stand_on_at_most_eight_floors():
    assert len(set(PART_FLOORS.values())) <= MAX_FLOORS


def test_no_modules_import_each_other_in_a_circle():
    graph = import_graph()
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a circle
    assert order.index("gateway.store.sessions") < order.index("gateway.replies.manager") < order.index(
        "gateway.server.app")


def test_every_gateway_module_imports_without_torch_and_only_the_engine_modules_the_readme_names():
    # a fresh interpreter in which importing torch fails, as in the gateway's image
    code = """
import importlib, pkgutil, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'torch':
            raise ImportError('no torch in the gateway image')
sys.meta_path.insert(0, NoTorch())
import gateway
for m in pkgutil.walk_packages(gateway.__path__, 'gateway.'):
    importlib.import_module(m.name)
print(' '.join(sorted(k for k in sys.modules if k.startswith('engine.'))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=GATEWAY.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    readme = (GATEWAY.parent / "README.md").read_text()
    loaded = set(out.stdout.split())
    modules = {m for m in loaded if not any(o.startswith(m + ".") for o in loaded)}  # packages aside
    assert "engine.protocol" in modules
    assert [m for m in sorted(modules) if f"`{m}`" not in readme] == []


def test_docs_architecture_lists_every_gateway_module():
    doc = (GATEWAY.parent / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## gateway/"):]
    paths = sorted(str(f.relative_to(GATEWAY)) for f in GATEWAY.rglob("*.py") if f.name != "__init__.py")
    assert [p for p in paths if f"`{p}`" not in table] == []
