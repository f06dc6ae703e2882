"""The import table of docs/architecture.md, checked on the source: the runtime (edgespec/) imports neither the exporter
(export/ = edgespec.export) nor the robots package (robots/ = edgespec.robots), nor torch, transformers or
optimum, and export/ and robots/ never import each other. Every `import` / `from ... import` statement counts, relative ones included, wherever it sits
(module level or inside a function), with one named exception below.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"edgespec": "edgespec", "export": "edgespec.export", "robots": "edgespec.robots"}  # folder -> package
FORBIDDEN = {  # folder -> packages it must never import
    "edgespec": ("edgespec.export", "edgespec.robots", "torch", "transformers", "optimum"),
    "export": ("edgespec.robots",),
    "robots": ("edgespec.export",),
}
# `edgespec demo` imports the bundled-engine helper (export/bundled.py) inside its function, to re-export the
# demo pair when it is missing or stale: `import edgespec` on a device never reaches it. Nothing else may.
# (`edgespec export` and `edgespec robot` come from the "edgespec.commands" entry points: the runtime names
# neither package.)
LAZY_ALLOWED = {("edgespec/cli.py", "edgespec.export")}


def module_name(path: Path, root: Path = ROOT) -> tuple[str, str]:
    """-> (the file's module name, the package its relative imports start from)."""
    rel = path.relative_to(root)
    pkg = ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:-1]])
    if path.name == "__init__.py":
        return pkg, pkg
    return f"{pkg}.{path.stem}", pkg


def imports(path: Path, root: Path = ROOT) -> list[tuple[list[str], int, bool]]:
    """Every import statement in `path` -> [(the absolute module names it names, line, inside a function)].
    `from a import b` names both a and a.b (b may be a submodule)."""
    _, pkg = module_name(path, root)
    found: list[tuple[list[str], int, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.append(([a.name for a in child.names], child.lineno, in_func))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = pkg.split(".")
                    if child.level - 1 >= len(parts):
                        raise ValueError(f"{path}:{child.lineno}: relative import beyond the top package")
                    base = ".".join(parts[:len(parts) - (child.level - 1)] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                found.append(([base] + [f"{base}.{a.name}" for a in child.names if a.name != "*"], child.lineno,
                              in_func))
            elif isinstance(child, ast.Call) and _dynamic_import(child):  # importlib.import_module("..."), __import__
                name = child.args[0].value
                if name.startswith("."):  # import_module(".x", package): relative to this file's package
                    dots = len(name) - len(name.lstrip("."))
                    parts = pkg.split(".")
                    name = ".".join(parts[:len(parts) - (dots - 1)] + ([name.lstrip(".")] if name.lstrip(".") else []))
                found.append(([name], child.lineno, in_func))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _dynamic_import(call: ast.Call) -> bool:
    """A call of importlib.import_module / import_module / __import__ with a literal module name."""
    f = call.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
        (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))
    return named and bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)


def violations(root: Path = ROOT) -> list[str]:
    """One line per import statement against the table."""
    out = []
    for folder, banned in FORBIDDEN.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for names, line, in_func in imports(path, root):
                hit = [(m, b) for m in names for b in banned if m == b or m.startswith(b + ".")]
                if hit and not (in_func and (rel, hit[0][1]) in LAZY_ALLOWED):
                    out.append(f"{rel}:{line} imports {hit[0][0]} ({folder}/ may not import {hit[0][1]})")
    return out


def test_no_package_imports_against_the_table():
    bad = violations()
    assert not bad, "imports against docs/architecture.md's import table:\n" + "\n".join(bad)


def test_the_shipped_exporter_never_imports_the_training_scripts():
    """export/training/ trains the bundled models (torch training loops, data); the exporter a user ships
    (export/*.py) must not need it: model definitions it shares with training live in export/ itself."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {n}"
           for p in sorted((ROOT / "export").glob("*.py"))
           for names, line, _ in imports(p) for n in names if n.startswith("edgespec.export.training")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder,source,banned", [
    ("edgespec", "from edgespec.export import vla\n", True),
    ("edgespec", "import edgespec.robots.reacher\n", True),
    ("edgespec", "from . import robots\n", True),                       # edgespec/x.py: . is edgespec
    ("edgespec", "def f():\n    from .robots import loop\n", True),     # inside a function counts too
    ("export", "from ..robots.reacher import ThreeTargetReacher\n", True),
    ("export", "def f():\n    from edgespec.robots.reacher import ThreeTargetReacher\n", True),
    ("robots", "from edgespec.export.training.train_vla import WORDS\n", True),
    ("robots", "from .. import export\n", True),
    ("robots", "from ..export import vla\n", True),
    ("export", "from ..policy import load_policy\nfrom .vla import export_policy\n", False),
    ("robots", "from edgespec.policy import load_policy\nfrom .reacher import ThreeTargetReacher\n", False),
    ("edgespec", "import numpy\nfrom .contract import Manifest\n", False),
    ("edgespec", "import importlib\nm = importlib.import_module('edgespec.robots.cli')\n", True),
    ("edgespec", "def f():\n    return __import__('edgespec.export.vla')\n", True),
    ("edgespec", "from importlib import import_module\nimport_module('.robots', 'edgespec')\n", True),
    ("robots", "import importlib\nimportlib.import_module('edgespec.export.vla')\n", True),
    ("edgespec", "import importlib\nimportlib.import_module('json')\n", False),
])
def test_the_check_sees_absolute_relative_and_lazy_imports(tmp_path, folder, source, banned):
    for f in PACKAGES:
        (tmp_path / f).mkdir()
    (tmp_path / folder / "x.py").write_text(source)
    assert bool(violations(tmp_path)) == banned, violations(tmp_path)


def test_the_cli_exception_covers_lazy_imports_only(tmp_path):
    for f in PACKAGES:
        (tmp_path / f).mkdir()
    (tmp_path / "edgespec" / "cli.py").write_text(
        "def cmd():\n    from edgespec.export.vla import export_policy\n")
    assert violations(tmp_path) == []
    (tmp_path / "edgespec" / "cli.py").write_text("from edgespec.export.vla import export_policy\n")
    assert len(violations(tmp_path)) == 1
    (tmp_path / "edgespec" / "cli.py").write_text("def cmd():\n    import edgespec.robots.cli\n")
    assert len(violations(tmp_path)) == 1  # the exception is for the exporter only


def test_export_and_robot_subcommands_come_from_their_own_packages():
    """edgespec/cli.py names neither package: their subcommands arrive through the entry-point group."""
    from importlib.metadata import entry_points

    from edgespec.cli import COMMANDS_GROUP, build_parser
    eps = {e.name: e.value for e in entry_points(group=COMMANDS_GROUP)}
    assert eps == {"export": "edgespec.export.commands:register", "robot": "edgespec.robots.commands:register"}
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"export", "export-policy", "robot", "demo", "generate"} <= set(sub.choices)
    assert sub.choices["export"].get_default("func").__module__ == "edgespec.export.commands"
    assert sub.choices["robot"].get_default("func").__module__ == "edgespec.robots.commands"


def import_cycles(folder: str, root: Path = ROOT) -> list[list[str]]:
    """Cycles among the modules of one folder, counting every import of a sibling module (module level or in a
    function): [[a, b, ..., a], ...], each cycle once, from its smallest module name."""
    mods = {module_name(p, root)[0]: p for p in sorted((root / folder).rglob("*.py"))}
    def targets(names: list[str]) -> list[str]:  # `from pkg import mod` imports mod, not pkg's __init__ too
        subs = [n for n in names[1:] if n in mods]
        return subs or [n for n in names if n in mods]

    graph = {m: sorted({n for names, _, _ in imports(p, root) for n in targets(names) if n != m})
             for m, p in mods.items()}
    cycles, seen = [], set()

    def walk(path: list[str]) -> None:
        for n in graph[path[-1]]:
            if n == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    cycles.append(path + [n])
            elif n not in path and n > path[0]:  # each cycle found from its smallest member only
                walk(path + [n])

    for m in sorted(graph):
        walk([m])
    return cycles


@pytest.mark.parametrize("folder", ["edgespec", "export", "robots"])
def test_no_import_cycle_in_any_package(folder):
    assert import_cycles(folder) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    for f in PACKAGES:
        (tmp_path / f).mkdir()
    (tmp_path / "robots" / "a.py").write_text("from .b import x\n")
    (tmp_path / "robots" / "b.py").write_text("def x():\n    from . import a\n")
    (tmp_path / "robots" / "c.py").write_text("from .a import y\n")
    assert import_cycles("robots", tmp_path) == [["edgespec.robots.a", "edgespec.robots.b", "edgespec.robots.a"]]


def test_every_package_folder_is_packaged():
    """pyproject.toml lists its packages by name: a new subpackage (edgespec/backends/, export/training/) left
    out of the list would be missing from a wheel while an editable install still finds it."""
    import re
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*)\]$", text, re.M).group(1)))
    found = {module_name(p)[0] for folder in PACKAGES for p in (ROOT / folder).rglob("__init__.py")}
    assert listed == found
