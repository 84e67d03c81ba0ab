"""The package layout keeps imports one way and its rooms apart (read from the source with ``ast``, nothing imported).

- A capability (loss, packing, optim, parallel, config, plan, diagnostics) never imports the integration layer,
  the command line, its commands or verify: those sit on top of the capabilities. The plan command lives in the
  plan room (``plan/command.py``) and imports only capabilities.
- No import circle between files anywhere in the package, lazy imports inside functions included.
- The Trainer class layers (``integration/trainer/``) are reached through the ways in only: ``patching.py`` (which
  wires ``patch()`` and the callback), the package's lazy ``install`` / ``uninstall`` and the old home
  ``trainer_fix.py``; they never import the ways in back. Their top layer is a list of overrides that delegate, one
  screen long.
- The top level holds only what every room shares; no class grows past a few hundred lines.
- ``config`` never imports ``plan`` (config check and the planner share pure formulas from ``parallel``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hf_gradfix"
CAPABILITIES = ("loss", "packing", "optim", "parallel", "config", "plan", "diagnostics")
ABOVE_CAPABILITIES = ("hf_gradfix.integration", "hf_gradfix.cli", "hf_gradfix.commands", "hf_gradfix.verify",
                      "hf_gradfix.plan.command")
# the Trainer class layers' entry points: the generated class and the class swap
TRAINER_LAYERS = "hf_gradfix.integration.trainer"
TRAINER_HUB = ("hf_gradfix.integration.trainer.top", "hf_gradfix.integration.trainer.class_swap")
MAY_IMPORT_TRAINER_HUB = ("hf_gradfix/integration/patching.py", "hf_gradfix/integration/trainer_fix.py",
                          "hf_gradfix/__init__.py")
WAYS_IN = ("hf_gradfix.integration.patching", "hf_gradfix.integration.callback")
# what every room shares stays at the top level; the rest lives in its room
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "errors.py", "files.py", "probe_mode.py", "progress.py",
             "torch_private.py"}
LARGEST_CLASS_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Absolute names of every module a file imports, at any depth (lazy imports inside functions included).

    >>> "hf_gradfix.errors" in imported_modules(PKG / "config" / "schema.py")   # `from ..errors import ...`
    True
    """
    if package is None:  # the package a relative import starts from
        package = _module_name(path)
        if path.name != "__init__.py":
            package = package.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)  # `from . import cli` names a module too
    return out


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_never_import_the_layers_above_them(capability):
    files = sorted((PKG / capability).rglob("*.py"))
    assert files, f"no modules under hf_gradfix/{capability}"
    bad = [
        f"{f.relative_to(PKG.parent)} imports {name}"
        for f in files
        for name in sorted(imported_modules(f))
        if any(_is_under(name, above) for above in ABOVE_CAPABILITIES)
    ]
    assert not bad, "capabilities must not import the integration layer, the CLIs or verify:\n" + "\n".join(bad)


def test_only_the_ways_in_reach_the_trainer_layers():
    files = sorted(PKG.rglob("*.py"))
    inside = PKG / "integration" / "trainer"
    bad = [
        f"{f.relative_to(PKG.parent)} imports {name}"
        for f in files
        if inside not in f.parents and str(f.relative_to(PKG.parent)) not in MAY_IMPORT_TRAINER_HUB
        for name in sorted(imported_modules(f))
        if name == TRAINER_LAYERS or any(_is_under(name, hub) for hub in TRAINER_HUB)
    ]
    assert not bad, ("the generated trainer class and the class swap are reached through patching.py (patch(), "
                     "GradFixCallback) only; take shared state from integration/state.py:\n" + "\n".join(bad))
    back = [f"{f.relative_to(PKG.parent)} imports {name}" for f in sorted(inside.glob("*.py"))
            for name in sorted(imported_modules(f)) if any(_is_under(name, way) for way in WAYS_IN)]
    assert not back, "the Trainer class layers never import the ways in:\n" + "\n".join(back)


def test_the_trainer_top_layer_is_a_list_of_delegating_overrides():
    path = PKG / "integration" / "trainer" / "top.py"
    source = path.read_text().splitlines()
    top = next(n for n in ast.walk(ast.parse("\n".join(source))) if isinstance(n, ast.ClassDef) and n.name == "_GradFixTop")
    assert top.end_lineno - top.lineno + 1 <= 130, f"_GradFixTop is {top.end_lineno - top.lineno + 1} lines: one screen"
    methods = [n for n in top.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) >= 15
    for m in methods:
        why = source[m.body[0].lineno - 2].strip()  # the line above the body's one statement
        assert len(m.body) == 1 and isinstance(m.body[0], (ast.Return, ast.Expr)), \
            f"_GradFixTop.{m.name}: one statement that hands on to the module of its concern"
        assert why.startswith("#") and len(why) > 10, f"_GradFixTop.{m.name}: a one-line comment saying why it exists"


def test_the_top_level_keeps_only_what_every_room_shares():
    modules = {f.name for f in PKG.glob("*.py")}
    assert modules == TOP_LEVEL, f"put {sorted(modules - TOP_LEVEL)} in its room (verify/, plan/, commands/, integration/)"
    assert (PKG / "verify" / "__init__.py").is_file() and (PKG / "commands" / "__init__.py").is_file()


def test_no_class_is_longer_than_a_few_hundred_lines():
    sizes = sorted(((n.end_lineno - n.lineno + 1, f"{f.relative_to(PKG.parent)}::{n.name}")
                    for f in sorted(PKG.rglob("*.py")) for n in ast.walk(ast.parse(f.read_text()))
                    if isinstance(n, ast.ClassDef)), reverse=True)
    assert sizes and sizes[0][0] <= LARGEST_CLASS_LINES, f"split by concern (mixins or modules): {sizes[:3]}"


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    # The checker must fail on the bug: a lazy relative import back up into the CLI (what plan/cli.py did).
    bad = tmp_path / "hf_gradfix" / "plan" / "cli.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..cli import resolve_config\n    from .. import verify_cli\n")
    names = imported_modules(bad, package="hf_gradfix.plan")
    assert "hf_gradfix.cli" in names and "hf_gradfix.verify_cli" in names
    assert "hf_gradfix.config.resolve" in imported_modules(PKG / "plan" / "command.py")  # `from ..config.resolve import resolve_config`, inside a function
    callback = imported_modules(PKG / "integration" / "callback.py")
    assert "hf_gradfix.integration.state" in callback and "hf_gradfix.integration.patching" in callback
    assert "hf_gradfix.integration.trainer.class_swap" in imported_modules(PKG / "integration" / "patching.py")


def test_documented_names_are_still_importable_from_their_old_homes():
    import hf_gradfix
    from hf_gradfix import cli, errors
    from hf_gradfix.config import resolve
    from hf_gradfix.integration import state, trainer_fix

    from hf_gradfix.integration import moe, rl_packing, versions
    from hf_gradfix.integration.rl import packing
    from hf_gradfix.optim.lowrank import LowRankAdamW
    from hf_gradfix.verify import VerifyReport, verify, verify_trainer

    assert trainer_fix.GradFixError is errors.GradFixError is hf_gradfix.GradFixError
    assert trainer_fix.state_of is state.state_of is hf_gradfix.state_of
    assert trainer_fix.GradFixState is state.GradFixState
    assert cli.resolve_config is resolve.resolve_config and cli.split_config is resolve.split_config
    assert hf_gradfix.install is trainer_fix.install
    assert rl_packing.attach is packing.attach and callable(moe.RouterHealthCallback) and versions.UntestedVersionWarning
    assert hf_gradfix.verify_trainer is verify_trainer and hf_gradfix.VerifyReport is VerifyReport and callable(verify)
    assert hf_gradfix.optim.LowRankAdamW is LowRankAdamW


def test_config_never_imports_plan():
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in sorted((PKG / "config").rglob("*.py"))
           for name in sorted(imported_modules(f)) if _is_under(name, "hf_gradfix.plan")]
    assert not bad, "config must not import the planner (shared formulas go to parallel/ or a pure module):\n" + "\n".join(bad)


def test_the_plan_command_lives_in_the_plan_room():
    assert (PKG / "plan" / "command.py").is_file() and not (PKG / "plan_cli.py").exists()
    assert "hf_gradfix.plan.command" in imported_modules(PKG / "cli.py")


def test_the_suite_process_never_sees_the_kernel_stand_ins():
    """tests/support/kernel_standins (pure-PyTorch causal_conv1d / fla / mamba_ssm) stay out of the suite's own processes:
    were they importable here, transformers would bind them as installed kernels for every hybrid model the suite
    builds (tests/conftest.py's collect_ignore keeps `--doctest-modules tests` from putting them on sys.path)."""
    import importlib.util
    import sys

    standins = (PKG.parent / "tests" / "support" / "kernel_standins").resolve()
    assert not any(Path(p).resolve() == standins for p in sys.path if p)
    for name in ("causal_conv1d", "fla", "mamba_ssm"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or standins not in origin.parents, f"{name} imports from {origin}"


def module_graph(root: Path) -> dict[str, set[str]]:
    """File -> the files of the package it imports (at any depth: lazy imports inside functions and TYPE_CHECKING
    blocks included). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module of its own, else to
    ``pkg``'s ``__init__.py``; ``import a.b.c`` is an edge to the deepest of ``a.b.c``, ``a.b``, ``a`` that is a file.

    >>> sorted(module_graph(PKG)["hf_gradfix.config.schema"])[:1]
    ['hf_gradfix.errors']
    """
    global PKG
    saved, PKG = PKG, root
    try:
        files = {_module_name(f): f for f in sorted(root.rglob("*.py"))}
    finally:
        PKG = saved
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in files:
                        target = target.rpartition(".")[0]
                    if target:
                        edges.add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    if f"{mod}.{alias.name}" in files:
                        edges.add(f"{mod}.{alias.name}")
                    elif mod in files:
                        edges.add(mod)
        edges.discard(name)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected component of more than one file (Tarjan), each sorted.

    >>> strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    [['a', 'b', 'c']]
    >>> strongly_connected({"a": {"b"}, "b": set()})
    []
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's file count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circle_between_files_anywhere_in_the_package():
    circles = strongly_connected(module_graph(PKG))
    assert not circles, ("files that import each other (lazy imports count): move the shared name down to the "
                         "module that defines the concept, or to a small lower module:\n"
                         + "\n".join(" <-> ".join(c) for c in circles))


def test_the_circle_check_fails_on_a_planted_file_circle(tmp_path):
    # control: a circle across two rooms, closed by a lazy import inside a function, and one through a package's
    # __init__ (`from .. import name`), are both found; a `from . import module` edge is not mistaken for one
    pkg = tmp_path / "hf_gradfix"
    (pkg / "integration").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def patch():\n    from .integration import wiring\n")
    (pkg / "integration" / "__init__.py").write_text("")
    (pkg / "integration" / "wiring.py").write_text("from . import hub\nfrom .. import patch\n")
    (pkg / "integration" / "hub.py").write_text("from .lower import x\n")
    (pkg / "integration" / "lower.py").write_text("x = 1\ndef f():\n    from .hub import y\n")
    circles = strongly_connected(module_graph(pkg))
    assert circles == [["hf_gradfix", "hf_gradfix.integration.wiring"],
                       ["hf_gradfix.integration.hub", "hf_gradfix.integration.lower"]], circles
    (pkg / "integration" / "lower.py").write_text("x = 1\n")
    (pkg / "__init__.py").write_text("")
    assert strongly_connected(module_graph(pkg)) == []
