"""The package layout keeps imports one way (read from the source with ``ast``, nothing imported).

- A capability (loss, packing, optim, parallel, config, plan, diagnostics) never imports the integration layer,
  the CLIs or verify: those sit on top of the capabilities.
- Inside ``integration/``, only ``patching.py`` (the one place that wires ``patch()`` and the callback to a
  trainer) imports the hub ``trainer_fix.py``; every other module takes the shared state and helpers from
  ``integration/state.py`` and the errors from ``hf_gradfix/errors.py``, so ``trainer_fix`` is in no cycle.
- ``config`` never imports ``plan`` (config check and the planner share pure formulas from ``parallel``), and the
  planner's own modules import one way (no cycle, lazy imports included); the ``plan`` command line lives beside
  the other CLIs (``hf_gradfix/plan_cli.py``), not inside the capability.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "hf_gradfix"
CAPABILITIES = ("loss", "packing", "optim", "parallel", "config", "plan", "diagnostics")
ABOVE_CAPABILITIES = ("hf_gradfix.integration", "hf_gradfix.cli", "hf_gradfix.verify_cli", "hf_gradfix.verify",
                      "hf_gradfix.plan_cli")
HUB = "hf_gradfix.integration.trainer_fix"
MAY_IMPORT_HUB = {"trainer_fix.py", "patching.py"}


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


def test_only_the_wiring_module_imports_the_trainer_fix_hub():
    files = sorted((PKG / "integration").glob("*.py")) + [PKG / "verify.py", PKG / "verify_cli.py", PKG / "cli.py"]
    bad = [
        f"{f.relative_to(PKG.parent)} imports {HUB}"
        for f in files
        if f.name not in MAY_IMPORT_HUB and any(_is_under(n, HUB) for n in imported_modules(f))
    ]
    assert not bad, "import GradFixState/state_of/_dp_world from integration.state, errors from hf_gradfix.errors:\n" + "\n".join(bad)


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    # The checker must fail on the bug: a lazy relative import back up into the CLI (what plan/cli.py did).
    bad = tmp_path / "hf_gradfix" / "plan" / "cli.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..cli import resolve_config\n    from .. import verify_cli\n")
    names = imported_modules(bad, package="hf_gradfix.plan")
    assert "hf_gradfix.cli" in names and "hf_gradfix.verify_cli" in names
    assert "hf_gradfix.config.resolve" in imported_modules(PKG / "plan_cli.py")  # `from .config.resolve import resolve_config`, inside a function
    callback = imported_modules(PKG / "integration" / "callback.py")
    assert "hf_gradfix.integration.state" in callback and "hf_gradfix.integration.patching" in callback
    assert HUB in imported_modules(PKG / "integration" / "patching.py")


def test_documented_names_are_still_importable_from_their_old_homes():
    import hf_gradfix
    from hf_gradfix import cli, errors
    from hf_gradfix.config import resolve
    from hf_gradfix.integration import state, trainer_fix

    assert trainer_fix.GradFixError is errors.GradFixError is hf_gradfix.GradFixError
    assert trainer_fix.state_of is state.state_of is hf_gradfix.state_of
    assert trainer_fix.GradFixState is state.GradFixState
    assert cli.resolve_config is resolve.resolve_config and cli.split_config is resolve.split_config
    assert hf_gradfix.install is trainer_fix.install


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of a directed graph, each once (as found by a depth-first walk from each node).

    >>> _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b', 'a']]
    >>> _cycles({"a": {"b"}, "b": set()})
    []
    """
    found, seen = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        found.append(path + [start])
                elif nxt not in path and nxt > start:  # each cycle from its smallest node only
                    stack.append((nxt, path + [nxt]))
    return found


def _package_graph(folder: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (at any depth, lazy imports and TYPE_CHECKING included)."""
    modules = {_module_name(f): f for f in sorted(folder.glob("*.py"))}
    package = _module_name(folder / "__init__.py")
    return {name: {m for m in imported_modules(f) if m in modules and m != name and m != package}
            for name, f in modules.items()}


def test_config_never_imports_plan():
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in sorted((PKG / "config").rglob("*.py"))
           for name in sorted(imported_modules(f)) if _is_under(name, "hf_gradfix.plan")]
    assert not bad, "config must not import the planner (shared formulas go to parallel/ or a pure module):\n" + "\n".join(bad)


def test_no_import_cycles_inside_plan():
    cycles = _cycles(_package_graph(PKG / "plan"))
    assert not cycles, "imports inside hf_gradfix/plan must run one way:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_fails_on_a_cycle(tmp_path):
    # control: the shape plan/ had (activations <-> estimate, lazily inside functions) is found
    pkg = tmp_path / "hf_gradfix" / "plan"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .estimate import estimate\n")
    (pkg / "estimate.py").write_text("def estimate():\n    from .activations import trace\n")
    (pkg / "activations.py").write_text("def trace():\n    from .estimate import PlanError\n")
    global PKG
    saved, PKG = PKG, tmp_path / "hf_gradfix"
    try:
        graph = _package_graph(pkg)
    finally:
        PKG = saved
    assert _cycles(graph) == [["hf_gradfix.plan.activations", "hf_gradfix.plan.estimate", "hf_gradfix.plan.activations"]]


def test_the_plan_command_line_sits_beside_the_other_clis():
    assert (PKG / "plan_cli.py").is_file() and not (PKG / "plan" / "cli.py").exists()
    assert "hf_gradfix.plan_cli" in imported_modules(PKG / "cli.py")


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
