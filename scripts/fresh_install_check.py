#!/usr/bin/env python3
"""What a new user gets from the README's Install lines alone: a fresh virtualenv, those ``pip install`` lines and
nothing else, then every python snippet of README.md and docs/quickstart.md, the ``plan --timeline`` example and the
first CLI commands, from a scratch directory outside the clone.

    python3 scripts/fresh_install_check.py              # what CI runs (scripts/test.sh, skipped by
                                                        # HF_GRADFIX_SKIP_FRESH_INSTALL=1)
    python3 scripts/fresh_install_check.py --dry-run    # print the install lines and checks, run nothing
    python3 scripts/fresh_install_check.py --unlocked   # the newest releases the ranges allow (users' view)
    python3 scripts/fresh_install_check.py --newest-canary   # then: the newest releases in that venv, and the
                                                              # tests that caught the last release's breakage

The install lines are read from the README's "## Install" block (the quickstart must show the same lines: one
install text), so the check follows the README as it changes. CI passes the transformers 5.x lock as pip
constraints (``-c``), like every other CI install, so that a release between two runs cannot turn CI red;
``--unlocked`` drops it. The torch line is run as written (its ``--index-url`` included). Exit 0 when every step
passed; otherwise the failing step's command and output tail, and exit 1.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]
LOCK = ROOT / "requirements" / "lock-tf5.txt"
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(?P<reason>\S[^>]*?)\s*-->\s*$")
# the --timeline example at a size a CPU traces in seconds (docs/plan.md's Llama 8B trace takes minutes); no
# --dtype: the default must be one the simulation runs (issue 39)
TIMELINE = ["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--micro-batch", "2", "--timeline", "timeline.png"]
CLI_CHECKS = [["--version"], ["env"], ["configs", "list"], ["config", "check", "--config_file", "cpu_pp"]]
#: --newest-canary: the packages hf_gradfix integrates with, moved to the newest releases its ranges allow (what the
#: README's install brings a new user the day a release lands), and the tests that caught such a release before: a
#: packed row of one document on every hybrid family (transformers 5.25), TRL's packed rows, the composition matrix
CANARY_PACKAGES = ["transformers", "accelerate", "peft", "trl", "datasets"]
CANARY_TESTS = ["tests/packing/test_packing_hybrid.py::test_rows_of_one_document_train_exactly_on_every_hybrid_family",
                "tests/packing/test_packing_hybrid.py::test_trainer_rows_of_one_document_and_the_last_row_train_exactly",
                "tests/packing/test_packing_already_packed.py", "tests/trainer/test_composition_matrix.py"]


def install_lines(page: Path = PAGES[0]) -> list[str]:
    """The ``pip install`` lines of a page's "## Install" bash block (comments dropped)."""
    text = page.read_text(encoding="utf-8")
    section = text.split("## Install", 1)
    if len(section) < 2:
        raise SystemExit(f"{page.relative_to(ROOT)}: no '## Install' section; fix: keep the install lines there")
    match = FENCE.search(section[1])
    lines = []
    for line in (match["body"] if match else "").splitlines():
        command = line.split("  #", 1)[0].split(" # ", 1)[0].strip()
        if command.startswith("pip install"):
            lines.append(command)
    if not lines:
        raise SystemExit(f"{page.relative_to(ROOT)}: no 'pip install' line in its Install block")
    return lines


def fenced_blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, body, the text just before the fence) of every fenced block of a page, bodies dedented (a block
    inside a list item). ``tests/project/test_docs.py`` reads the pages with this too."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        n = len(m["indent"])
        body = "\n".join(line[n:] if line[:n].strip() == "" else line for line in m["body"].splitlines())
        out.append((m["lang"], body, text[: m.start()].rstrip()[-300:]))
    return out


def python_snippets(page: Path) -> list[str]:
    """Every ```python block of a page not marked ``<!-- not-run: reason -->`` (what tests/project/test_docs.py runs)."""
    return [body for lang, body, before in fenced_blocks(page)
            if lang in ("python", "py") and not NOT_RUN.search(before)]


RUN_PAGE = """
import sys
namespace = {"__name__": "__docs__"}
for i, path in enumerate(sys.argv[2:]):
    code = open(path, encoding="utf-8").read()
    exec(compile(code, f"{sys.argv[1]}[snippet {i + 1}]", "exec"), namespace)
print(f"{sys.argv[1]}: {len(sys.argv) - 2} snippet(s) ran")
"""


def _reachable_index(words: list[str]) -> list[str]:
    """A line's ``--index-url URL`` as written when that host answers; else the line without it, said on stdout
    (CI machines reach the package registries only, not download.pytorch.org: the torch pin is then served by the
    default index and pip's find-links, as scripts/setup_env.sh's default ``torch==2.13.0`` is)."""
    import socket
    from urllib.parse import urlparse

    if "--index-url" not in words:
        return words
    i = words.index("--index-url")
    url = urlparse(words[i + 1])
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
        return words
    except OSError as err:
        print(f"    note: {url.hostname} is unreachable from here ({err.__class__.__name__}); this line runs without "
              f"--index-url {words[i + 1]} (the default index)", flush=True)
        return words[:i] + words[i + 2:]


class Step:
    def __init__(self, start: float):
        self.start = start
        self.failed: list[str] = []

    def __call__(self, title: str, cmd: list[str], cwd: Path, env: dict, timeout: float = 1800,
                 shown: str | None = None) -> bool:
        t0 = time.monotonic()
        print(f"[fresh-install +{t0 - self.start:.0f}s] {title}: {shown or shlex.join(cmd)}", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
            ok, output = proc.returncode == 0, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            ok, output = False, f"timed out after {timeout:.0f} s\n{err.stdout or ''}{err.stderr or ''}"
        took = time.monotonic() - t0
        if ok:
            print(f"    ok ({took:.0f} s)", flush=True)
        else:
            print(f"    FAILED ({took:.0f} s); the output's tail:\n" + "\n".join(
                "    | " + line for line in output[-4000:].splitlines()), flush=True)
            self.failed.append(title)
        return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the install lines and the checks; run nothing")
    parser.add_argument("--unlocked", action="store_true", help="no lock constraints: the newest releases")
    parser.add_argument("--keep", action="store_true", help="keep the scratch venv and directory")
    parser.add_argument("--newest-canary", action="store_true",
                        help="after the checks: move the integrated packages to their newest releases in that venv and "
                             "run the canary tests; reported, never the verdict (CI stays on the locks)")
    args = parser.parse_args(argv)

    lines = install_lines(PAGES[0])
    quick = install_lines(PAGES[1])
    if quick != lines:
        print(f"docs/quickstart.md's install lines differ from the README's:\n  README: {lines}\n  quickstart: {quick}\n"
              "fix: one install text, the same lines in both", file=sys.stderr)
        return 1
    snippets = {page: python_snippets(page) for page in PAGES}
    print("install lines (README.md, docs/quickstart.md):", *("  " + line for line in lines), sep="\n")
    print("then: " + ", ".join(f"{p.relative_to(ROOT)} ({len(s)} python snippets)" for p, s in snippets.items())
          + ", hf-gradfix " + shlex.join(TIMELINE) + ", " + ", ".join("hf-gradfix " + shlex.join(c) for c in CLI_CHECKS))
    if args.dry_run:
        return 0

    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hgf_fresh_install_"))
    venv, scratch = work / "venv", work / "user"
    scratch.mkdir()
    # the snippets name the clone's configs/ and examples/ as a user in the clone would (tests/project/test_docs.py alike)
    for name in ("configs", "examples"):
        (scratch / name).symlink_to(ROOT / name, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "HF_GRADFIX_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", MPLBACKEND="Agg")
    step = Step(start)
    try:
        if not step("a fresh virtualenv", [sys.executable, "-m", "venv", str(venv)], work, env):
            return 1
        for line in lines:
            words = _reachable_index(shlex.split(line))
            cmd = [str(venv / "bin" / "python"), "-m", *words,  # "pip install ..." as the venv's pip
                   "--disable-pip-version-check", "--progress-bar", "off"]
            if not args.unlocked:
                cmd += ["-c", str(LOCK)]
            if not step("README install line", cmd, ROOT, env):
                return 1
        python = str(venv / "bin" / "python")
        for page, codes in snippets.items():
            files = []
            for i, code in enumerate(codes):
                f = work / f"{page.stem}_{i + 1}.py"
                f.write_text(code, encoding="utf-8")
                files.append(str(f))
            step(f"{page.relative_to(ROOT)}'s python snippets, in order, in one namespace",
                 [python, "-c", RUN_PAGE, str(page.relative_to(ROOT)), *files], scratch, env,
                 shown=f"python {' '.join(Path(f).name for f in files)} (from {scratch})")
        if step("the plan --timeline example (default dtype)", [str(venv / "bin" / "hf-gradfix"), *TIMELINE], scratch,
                env, shown="hf-gradfix " + shlex.join(TIMELINE)):
            if not (scratch / "timeline.png").stat().st_size:
                print("    FAILED: timeline.png is empty")
                step.failed.append("timeline.png written")
        for command in CLI_CHECKS:
            step("a first CLI command", [str(venv / "bin" / "hf-gradfix"), *command], scratch, env,
                 shown="hf-gradfix " + shlex.join(command))
        if args.newest_canary:
            canary = Step(start)
            newest = _newest_canary(canary, python, env)
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - start
    if args.newest_canary:
        print(f"[fresh-install +{took:.0f}s] newest releases (a canary, not the verdict: CI installs the locks): "
              + (f"FAILED: {', '.join(canary.failed)} on {newest}; run `bash scripts/test.sh --latest` and fix before "
                 "the locks move (docs/testing.md#locked-versions)" if canary.failed else f"passed on {newest}"))
    if step.failed:
        print(f"[fresh-install +{took:.0f}s] FAILED: {', '.join(step.failed)}")
        return 1
    print(f"[fresh-install +{took:.0f}s] passed: a fresh venv with only the README's install lines ran every step")
    return 0


def _newest_canary(step: Step, python: str, env: dict) -> str:
    """The newest releases of :data:`CANARY_PACKAGES` in the fresh venv (no lock), then :data:`CANARY_TESTS` from the
    clone; returns what was installed. Failures land in ``step.failed``, which the caller reports apart."""
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    step("newest releases of the integrated packages (no lock)", [*pip, "-U", *CANARY_PACKAGES, "pytest>=8"], ROOT, env)
    versions = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
                       f"{CANARY_PACKAGES!r}))"], capture_output=True, text=True, env=env)
    installed = versions.stdout.strip() or "(versions unknown)"
    print(f"    {installed}", flush=True)
    step("the canary tests on them", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CANARY_TESTS], ROOT,
         env, timeout=1800)
    return installed


if __name__ == "__main__":
    sys.exit(main())
