"""The page's ES modules (static/app.js, static/js/*.js) import each other without
circles, and the icon table lives in one leaf module. Reads the files only: no
browser, no server."""

from __future__ import annotations

import re
from pathlib import Path

STATIC = Path(__file__).resolve().parents[2] / "static"
IMPORT = re.compile(r"""^\s*import\s[^;]*?from\s+["'](\.{1,2}/[^"']+)["']""", re.MULTILINE | re.DOTALL)


def import_graph() -> dict[Path, set[Path]]:
    """Each of our modules (not the vendored ones) and the modules it imports."""
    mods = [STATIC / "app.js", *sorted((STATIC / "js").glob("*.js"))]
    return {m: {(m.parent / spec).resolve() for spec in IMPORT.findall(m.read_text())} for m in mods}


def test_the_page_modules_import_each_other_without_a_circle() -> None:
    graph = import_graph()
    done: set[Path] = set()

    def visit(m: Path, path: list[Path]) -> None:
        if m in path:
            circle = path[path.index(m):] + [m]
            raise AssertionError("import circle: " + " -> ".join(p.name for p in circle))
        if m in done or m not in graph:
            return
        for dep in graph[m]:
            visit(dep, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])
    assert all(dep.exists() for deps in graph.values() for dep in deps)


def test_icons_come_from_one_leaf_module() -> None:
    graph = import_graph()
    icons = STATIC / "js" / "icons.js"
    assert graph[icons] == set()
    path_data = re.compile(r'"M[\d.\s]+[\d.hvlLHVzac\s-]*"')  # an SVG path literal
    holders = [m.name for m in graph if m != icons and path_data.search(m.read_text())]
    assert holders == [], f"icon path data outside js/icons.js: {holders}"


def test_the_service_worker_caches_every_file_of_the_app_shell() -> None:
    text = (STATIC / "sw.js").read_text()
    listed = set(re.findall(r'^\s*"(/[^"]*)",$', text[text.index("const SHELL"):text.index("];")], re.MULTILINE))
    served_at_root = {"sw.js", "manifest.webmanifest"}  # gateway/server/app.py serves these from /
    files = {p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*") if p.is_file()}
    shell = {f for f in files if f not in served_at_root and not f.endswith(".md")
             and not f.split("/")[-1].startswith("LICENSE")}
    assert listed == {"/", "/manifest.webmanifest"} | {f"/static/{f}" for f in shell}
