"""Every time bound in tests/ is a hang bound (issue 54): at least 600 s and 10x the step's measured time, named in
``tests/support/hang_bound.py`` and listed in docs/testing.md; the only other time limits are the few that are
what a test proves (``hang_bound.NOT_HANG_BOUNDS``, each with what it proves).

Read from the source (AST of every ``.py`` under tests/), not from a run: a ``timeout=`` keyword not computed by
``hang_bound.bound(...)``, a parameter ``*timeout*`` with a default, a positional wait (``.wait(300)``,
``.join(5)``, ``signal.alarm``, ``settimeout``, ``pytest.mark.timeout``) or a comparison of a clock reading
(``time.perf_counter()``, ``time.monotonic()``, ``time.time()``, ``time.process_time()`` and names computed from
them) outside the listed functions is a finding. The control: the same check on a copy of a test file with a planted
``timeout=300`` (and a planted clock assertion, and a bound hidden in a default) finds each of them.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hang_bound

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
HELPER = "tests/support/hang_bound.py"
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
          "process_time_ns"}
WAITS = {"wait", "join", "acquire", "result", "settimeout", "alarm", "setitimer"}
#: a file without any of these has no time bound (parsing only the others keeps the check under a second)
MAY_BOUND = re.compile(r"timeout|perf_counter|monotonic|process_time|time\.time|time_ns|select\.select|"
                       r"\.(?:wait|join|acquire|result|settimeout|alarm|setitimer)\(\s*[0-9]")


@functools.lru_cache(maxsize=None)
def _parse(text: str) -> ast.AST:
    return ast.parse(text)


def _is_clock(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "time":
        return f.attr in CLOCKS
    return isinstance(f, ast.Name) and f.id in CLOCKS - {"time"}


def _calls_bound(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and ((isinstance(n.func, ast.Attribute) and n.func.attr == "bound")
                                            or (isinstance(n.func, ast.Name) and n.func.id == "bound"))
               for n in ast.walk(node))


def _functions(tree: ast.AST):
    """(qualified name of the innermost function, node) for every function; module level is ``<module>``."""
    out = [("<module>", tree)]

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.name, child))
                visit(child, child.name)
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _own_nodes(fn: ast.AST):
    """The nodes of ``fn`` outside its nested functions."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def scan_source(text: str, rel: str) -> list[str]:
    """Findings of one file (``rel``: its path from the repository root)."""
    findings = []
    if not MAY_BOUND.search(text):
        return findings
    tree = _parse(text)
    for name, fn in _functions(tree):
        nodes = list(_own_nodes(fn))
        if name != "<module>":
            args = fn.args
            defaults = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
            defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for a, d in defaults:
                if "timeout" in a.arg.lower() and not _calls_bound(d):
                    findings.append(f"{rel}:{d.lineno}: parameter {a.arg!r} of {name}() has a default time bound "
                                    "(name the step: hang_bound)")
        clock_names: set[str] = set()
        for _ in range(3):  # names computed from clock readings (t0, elapsed, deadline, best = min(best, ...))
            for node in nodes:
                if isinstance(node, ast.Assign) and any(
                        _is_clock(n) or (isinstance(n, ast.Name) and n.id in clock_names) for n in ast.walk(node.value)):
                    clock_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in nodes:
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "timeout" and not _calls_bound(kw.value):
                        findings.append(f"{rel}:{node.lineno}: timeout={ast.unparse(kw.value)} is not a named hang "
                                        "bound (hang_bound.run / communicate / wait / bound with the step's name)")
                f = node.func
                attr = f.attr if isinstance(f, ast.Attribute) else None
                if attr in WAITS and any(isinstance(a, ast.Constant) and isinstance(a.value, (int, float))
                                         and not isinstance(a.value, bool) for a in node.args):
                    findings.append(f"{rel}:{node.lineno}: {ast.unparse(node)} waits with a positional time bound")
                if attr == "timeout" and isinstance(f.value, ast.Attribute) and f.value.attr == "mark":
                    findings.append(f"{rel}:{node.lineno}: {ast.unparse(node)} is a time bound on a test")
                if attr == "select" and len(node.args) >= 4:
                    findings.append(f"{rel}:{node.lineno}: {ast.unparse(node)} waits with a time bound")
            elif isinstance(node, ast.Compare):
                if any(_is_clock(n) or (isinstance(n, ast.Name) and n.id in clock_names) for n in ast.walk(node)):
                    if f"{rel}::{name}" not in hang_bound.NOT_HANG_BOUNDS:
                        findings.append(f"{rel}:{node.lineno}: {ast.unparse(node)} compares a clock reading in "
                                        f"{name}() (a hang: hang_bound.deadline; a product requirement: list it in "
                                        "hang_bound.NOT_HANG_BOUNDS with what it proves)")
    return findings


def scan_tree(root: Path) -> list[str]:
    findings = []
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel != HELPER:
            findings += scan_source(path.read_text(), rel)
    return findings


def _step_uses(root: Path) -> set[str]:
    """Every step name the tests and benchmarks wait on: ``step="..."`` literals, ``deadline("...")`` /
    ``bound("...")`` arguments, and ``launch_cases("<worker>", ...)`` without ``step=`` (``"<worker> launch"``)."""
    used = set()
    for folder in ("tests", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            if path.relative_to(root).as_posix() in (HELPER, "tests/project/test_time_bounds.py"):
                continue
            text = path.read_text()
            if not re.search(r"\bstep=\"|deadline\(|bound\(|launch_cases\(", text):
                continue
            for node in ast.walk(_parse(text)):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                for kw in node.keywords:
                    if kw.arg == "step" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                        used.add(kw.value.value)
                if fname in ("deadline", "bound") and node.args and isinstance(node.args[0], ast.Constant):
                    used.add(node.args[0].value)
                if (fname == "launch_cases" and node.args and isinstance(node.args[0], ast.Constant)
                        and not any(kw.arg == "step" for kw in node.keywords)):
                    used.add(f"{node.args[0].value} launch")
    return used


def test_no_time_bound_in_tests_is_left_outside_the_helper():
    findings = scan_tree(ROOT)
    assert not findings, "\n".join(findings)


def test_every_bound_is_a_hang_bound_and_every_step_is_named_and_used():
    assert hang_bound.FLOOR_S >= 600 and hang_bound.FACTOR >= 10
    for name, step in hang_bound.STEPS.items():
        assert step.bound_s >= 600 and step.bound_s >= 10 * step.measured_s, (name, step)
        assert hang_bound.bound(name) == step.bound_s
        for m in re.finditer(r"((?:tests|benchmarks)/[\w/]+\.py)(?:::(\w+))?", step.used_by):  # where, as it is now
            assert (ROOT / m[1]).exists() and (m[2] is None or f"def {m[2]}(" in (ROOT / m[1]).read_text()), (name, m[0])
    used = _step_uses(ROOT)
    assert used <= set(hang_bound.STEPS), f"steps waited on but not in hang_bound.STEPS: {sorted(used - set(hang_bound.STEPS))}"
    assert set(hang_bound.STEPS) <= used, f"steps in hang_bound.STEPS that nothing waits on: {sorted(set(hang_bound.STEPS) - used)}"


def test_each_exception_is_a_real_clock_comparison_with_its_reason():
    """The listed exceptions exist (the function is there and does compare a clock reading; a stale entry would
    quietly widen what the check accepts) and say what they prove."""
    for key, why in list(hang_bound.NOT_HANG_BOUNDS.items()):
        rel, fn = key.split("::")
        text = (ROOT / rel).read_text()
        assert f"def {fn}(" in text, key
        assert len(why) > 40, key
        saved = hang_bound.NOT_HANG_BOUNDS.pop(key)
        try:
            assert any(f"in {fn}()" in f for f in scan_source(text, rel)), f"{key}: no clock comparison there"
        finally:
            hang_bound.NOT_HANG_BOUNDS[key] = saved


def test_docs_list_every_bound_with_its_measured_time():
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(
        r"^\| `([^`]+)` \| [^|]* \| ([0-9.]+) \| ([0-9.]+) \|", text, re.M)}
    for name, step in hang_bound.STEPS.items():
        assert name in rows, f"docs/testing.md has no row for the step {name!r}"
        assert rows[name] == (step.measured_s, step.bound_s), (name, rows[name], step)
    for key in hang_bound.NOT_HANG_BOUNDS:
        assert key.split("::")[1] in text, f"docs/testing.md does not list the exception {key}"


def test_control_a_planted_bound_is_found(tmp_path):
    """A copy of a test file with ``timeout=300`` planted where it waits on its probe, a clock assertion planted in
    a test, and a bound hidden in a parameter's default: the check names each; the unplanted copy is clean."""
    rel = "tests/plan/test_plan_lean_head.py"
    text = (ROOT / rel).read_text()
    copy = tmp_path / rel
    copy.parent.mkdir(parents=True)
    shutil.copy(ROOT / rel, copy)
    assert scan_tree(tmp_path) == []
    planted = text.replace('step="plan lean head probe"', "timeout=300")
    assert planted != text
    copy.write_text(planted)
    found = scan_tree(tmp_path)
    assert len(found) == 1 and found[0].startswith(f"{rel}:") and "timeout=300" in found[0], found
    copy.write_text(text + "\n\ndef test_fast():\n    import time\n    t0 = time.perf_counter()\n"
                    "    work = sum(range(10))\n    dt = time.perf_counter() - t0\n    assert dt < 5, work\n"
                    "\n\ndef _run(cmd, timeout=300):\n    return cmd\n"
                    "\n\ndef _wait(p):\n    return p.wait(300)\n")
    found = scan_tree(tmp_path)
    assert len(found) == 3, found
    assert "dt < 5" in found[0] and "test_fast()" in found[0]
    assert "parameter 'timeout' of _run()" in found[1] and "p.wait(300)" in found[2], found


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_a_fired_bound_says_hang_in_one_line_and_kills_the_whole_group(tmp_path, monkeypatch, capsys):
    """The helper itself, with the floor lowered to 0.5 s for the test: a step that sleeps (and started a child that
    sleeps) ends at the bound with the one line naming the step, the bound and the measured time, and nothing it
    started is left running; a step inside its bound returns as subprocess.run does."""
    monkeypatch.setattr(hang_bound, "FLOOR_S", 0.5)
    monkeypatch.setitem(hang_bound.STEPS, "test sleeper", hang_bound.Step(0.02, "this test", how="this test"))
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError) as info:
        hang_bound.run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; echo waiting; wait"], step="test sleeper",
                       capture_output=True, text=True)
    line = str(info.value)  # (had the bound not fired, the step would have ended after 60 s without an error)
    assert "\n" not in line and line == hang_bound.message("test sleeper"), line
    assert line.startswith("HANG: step 'test sleeper' exceeded its hang bound of 0.5 s ")
    assert "measured ~0.02 s alone on the slower 2-core host" in line
    assert "waiting" in capsys.readouterr().err  # the step's output tail, for the record
    child = int(pid_file.read_text())
    for _ in range(100):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the step's child {child} survived the hang")
    done = hang_bound.run([sys.executable, "-c", "print('ok')"], step="test sleeper", capture_output=True, text=True)
    assert isinstance(done, subprocess.CompletedProcess) and done.returncode == 0 and done.stdout == "ok\n"
    with pytest.raises(KeyError, match="not in STEPS"):
        hang_bound.bound("a step nobody measured")
