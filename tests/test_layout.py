"""The package layout keeps imports one way (read from the source with ``ast``, nothing imported).

- A capability (loss, packing, optim, parallel, config, plan, diagnostics) never imports the integration layer,
  the CLIs or verify: those sit on top of the capabilities.
- Inside ``integration/``, only ``patching.py`` (the one place that wires ``patch()`` and the callback to a
  trainer) imports the hub ``trainer_fix.py``; every other module takes the shared state and helpers from
  ``integration/state.py`` and the errors from ``hf_gradfix/errors.py``, so ``trainer_fix`` is in no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "hf_gradfix"
CAPABILITIES = ("loss", "packing", "optim", "parallel", "config", "plan", "diagnostics")
ABOVE_CAPABILITIES = ("hf_gradfix.integration", "hf_gradfix.cli", "hf_gradfix.verify_cli", "hf_gradfix.verify")
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
    assert "hf_gradfix.config.resolve" in imported_modules(PKG / "plan" / "cli.py")  # `from ..config.resolve import resolve_config`, inside a function
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
