"""The documentation: the site builds in strict mode, and every example in README.md and docs/*.md works.

- ``mkdocs build --strict`` into a temporary directory (a broken link, a missing page or a docstring that does
  not render fails); the generated configuration and CLI references hold every schema key and every command;
- every ```python snippet runs: the snippets of one page in order, in one namespace, from a scratch directory
  that sees the repository's ``configs/`` and ``examples/`` (a snippet preceded by ``<!-- not-run: reason -->``
  is skipped, and the reason must be given);
- every ``hf-gradfix ...`` command shown parses with the real parsers (nothing runs), and every YAML / JSON file
  such a command names exists;
- every YAML block with an ``hf_gradfix:`` section validates, and a block that says it is ``configs/X.yaml``
  equals that file;
- every repository path the text names (``configs/...``, ``examples/...``, ``benchmarks/...``, ...) exists.

Without mkdocs the build test skips locally and fails in CI (``CI=true``): ``pip install -e ".[docs]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import hang_bound
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the pages' fenced blocks are read as the fresh-install check reads them (one reader, one not-run marker)
_spec = importlib.util.spec_from_file_location("fresh_install_check", ROOT / "scripts" / "fresh_install_check.py")
_fresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fresh)
fenced_blocks, NOT_RUN = _fresh.fenced_blocks, _fresh.NOT_RUN
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|examples|benchmarks|scripts|docs|tests|hf_gradfix)/[\w./*-]*[\w*])")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# files the text names as what a command writes, not as inputs
WRITTEN_BY_COMMANDS = {"benchmarks/results/gpu-check.md"}  # bash scripts/gpu_check.sh on a CUDA machine


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _mkdocs_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material", "mkdocstrings_handlers"))


# --------------------------------------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not _mkdocs_available():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail('mkdocs, mkdocs-material or mkdocstrings[python] is missing: pip install -e ".[docs]"')
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]"); CI=true makes this a failure')
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    proc = hang_bound.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, step="mkdocs build --strict")
    if proc.returncode != 0:
        problems = [ln for ln in proc.stderr.splitlines() if ln.startswith(("WARNING", "ERROR", "Aborted"))]
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(problems or proc.stderr.splitlines()[-30:]))
    return out


def test_site_builds_strict_with_every_page_in_the_nav(site):
    nav_pages = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav_pages) == on_disk
    for name in on_disk:
        built = site / ("index.html" if name == "index.md" else f"{name[:-3]}/index.html")
        assert built.is_file(), name


def test_generated_references_hold_every_key_and_command(site):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    from hf_gradfix.config import GradFixConfig, config_to_dict

    config_html = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    rows = hooks.config_rows()
    keys = [key for key, *_ in rows]
    expected = []
    for section, values in config_to_dict(GradFixConfig()).items():  # the loader's view of the schema
        expected += [f"{section}.{k}" for k in values] if isinstance(values, dict) else [section]
    assert sorted(keys) == sorted(expected)
    for key, _type, default, _range, _help in rows:
        assert f"<code>{key}</code>" in config_html, key
    assert "<code>4096</code>" in config_html and "&gt;= 8" in config_html  # packing.token_budget's default, range
    cli_html = (site / "cli" / "index.html").read_text(encoding="utf-8")
    for argv in hooks.CLI_COMMANDS:
        usage = " ".join(["hf-gradfix", *argv])
        assert f"usage: {usage}" in cli_html, usage
    assert "--micro-batch" in cli_html and "--tolerance" in cli_html and "--config_file" in cli_html
    for path in REPO_PATH.findall(hooks.cli_reference()):  # the --help examples name real files
        assert (ROOT / path).exists(), f"hf-gradfix --help names {path}, which is not in the repository"
    api_html = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("patch", "unpatch", "GradFixCallback", "TokenWindow", "GaLoreAdamW", "PackedCollator",
                 "ParallelDims", "verify_trainer", "NoiseScaleMonitor", "estimate"):
        assert f'id="{name}"' in api_html or f'.{name}"' in api_html, name


# --------------------------------------------------------------------------------------------- snippets


def _snippets(page: Path) -> list[str]:
    out = []
    for lang, body, before in fenced_blocks(page):
        if lang not in ("python", "py"):
            continue
        marker = NOT_RUN.search(before)
        if marker:
            assert marker["reason"].strip(), f"{_rel(page)}: a not-run marker must give its reason"
            continue
        out.append(body)
    return out


SNIPPET_PAGES = [p for p in PAGES if _snippets(p)]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_GRADFIX_CONFIG", raising=False)
    yield tmp_path
    import hf_gradfix

    if hf_gradfix.is_patched():
        hf_gradfix.unpatch()
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # the snippets' Accelerator / Trainer state stays here
    GradientState._reset_state()


@pytest.mark.parametrize("page", SNIPPET_PAGES, ids=_rel)
def test_python_snippets_run(page, scratch):
    namespace: dict = {"__name__": "__docs__"}
    for i, code in enumerate(_snippets(page)):
        try:
            exec(compile(code, f"{_rel(page)}[snippet {i + 1}]", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{_rel(page)}, python snippet {i + 1} failed: {err!r}\n{code}") from err


def test_not_run_markers_are_few():
    skipped = []
    for page in PAGES:
        for lang, _body, before in fenced_blocks(page):
            if lang in ("python", "py") and NOT_RUN.search(before):
                skipped.append(_rel(page))
    assert len(skipped) <= 3, skipped


# --------------------------------------------------------------------------------------------- commands


def _commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for lang, body, _before in fenced_blocks(page):
            if lang in ("python", "py", "yaml", "yml", "json", "text"):
                continue
            for line in body.splitlines():
                line = line.strip()
                shown = line.startswith("$ hf-gradfix ")
                if shown or (lang in SHELL_LANGS and line.startswith("hf-gradfix ")):
                    out.append((_rel(page), line[2:] if shown else line))
    return out


COMMANDS = _commands()


class _Parsed(BaseException):
    """Raised right after a parser accepted the command line: nothing runs."""


def test_the_docs_show_commands():
    shown = {line.split()[1] for _page, line in COMMANDS}
    assert {"launch", "config", "verify", "plan"} <= shown


@pytest.mark.parametrize("page,line", COMMANDS, ids=[f"{p}:{line[:60]}" for p, line in COMMANDS])
def test_hf_gradfix_commands_parse(page, line, monkeypatch):
    from hf_gradfix.cli import main

    argv = shlex.split(line, comments=True)[1:]
    for arg in argv:
        if re.search(r"\.(ya?ml|json)$", arg):
            assert (ROOT / arg).is_file(), f"{page}: `{line}` names {arg}, which is not a file in the repository"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(ROOT)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(_Parsed):
        try:
            main(argv)
        except SystemExit as exc:
            raise AssertionError(f"{page}: `{line}` does not parse: {err.getvalue().strip()}") from exc


# --------------------------------------------------------------------------------------------- files and YAML


def test_every_repository_path_named_exists():
    missing = []
    for page in PAGES:
        for path in REPO_PATH.findall(page.read_text(encoding="utf-8")):
            path = path.rstrip(".")
            if path in WRITTEN_BY_COMMANDS:
                continue
            found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not found:
                missing.append(f"{_rel(page)}: {path}")
    assert not missing, "\n".join(missing)


def test_yaml_examples_validate_and_match_their_files():
    from hf_gradfix.config import config_from_dict

    checked = 0
    for page in PAGES:
        for lang, body, _before in fenced_blocks(page):
            if lang not in ("yaml", "yml"):
                continue
            data = yaml.safe_load(body)
            if isinstance(data, dict) and "hf_gradfix" in data:
                config_from_dict(data["hf_gradfix"] or {})
                checked += 1
            named = re.match(r"#\s*(configs/[\w./-]+\.ya?ml)(:|\s*$)", body)
            if named:
                assert data == yaml.safe_load((ROOT / named[1]).read_text()), f"{_rel(page)}: differs from {named[1]}"
    assert checked >= 3
