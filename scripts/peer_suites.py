"""Run the peers' own Trainer test suites stock and with ``hf_gradfix.patch()``; print every test whose outcome differs.

"Never worse than stock" (issue 34): TRL's trainer tests and transformers' Trainer tests are run twice each, in
separate pytest processes, against the same offline stand-ins (tiny random-init models, tokenizers and datasets built
here; see ``scripts/peer_suites/peer_suites_standins.py``):

- stock:   ``pytest FILE -p peer_suites_offline``
- patched: ``pytest FILE -p peer_suites_offline -p peer_suites_gradfix`` (the second plugin calls
  ``hf_gradfix.patch()`` at configure time and nothing else)

Per file it prints passed/failed/skipped/error stock vs patched, then every test whose outcome differs with the
patched run's one-line reason, then the tests that fail alike in both runs, by cause (a hub id without an offline
stand-in, a name the installed peer removed, ...). Exit status 1 when a test passes stock and fails patched, unless
it is one of the upstream negative controls in ``NEGATIVE_CONTROLS`` (tests that assert stock's inexact loss, each
listed with its reason); 2 when a run produced no results at all.

The peers' sources are not on the package index, so this is not part of CI. Get them first (outside this repo;
docs/testing.md says how): a TRL checkout (its ``tests/`` and ``scripts/``), and a folder holding transformers'
``tests/trainer`` files. Example::

    PYTHONPATH=/work/main /work/.peer-venv/bin/python scripts/peer_suites.py \
        --trl /work/peer-src/trl --transformers /work/peer-src/transformers --out /tmp/peer_suites --jobs 2

    # one file, a few tests, hf_gradfix from another checkout:
    python scripts/peer_suites.py --trl /work/peer-src/trl --only 'trl:*sft*' -k moe --gradfix-path /work/main

``--report`` re-prints the comparison from an earlier ``--out`` without running anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGINS = HERE / "peer_suites"
REPO = HERE.parent
sys.path.insert(0, str(PLUGINS))

import peer_suites_standins  # noqa: E402  (lives next to the plugins)

#: the files run by default, per peer (those that exist in the given checkout)
DEFAULT_FILES = {
    "trl": [f"tests/test_{name}_trainer.py" for name in ("sft", "dpo", "reward", "grpo", "rloo", "kto")],
    "transformers": ["tests/trainer/test_*.py"],
}
#: what each peer's own CI deselects on a CPU machine (GPU-only tests skip themselves through their markers)
MARKERS = {"trl": "not slow", "transformers": None}

#: Upstream negative controls: tests that pass stock *because* stock is wrong and fail once the loss is exact.
#: node id (as printed below) -> why. Only tests verified by reading them belong here.
NEGATIVE_CONTROLS: dict[str, str] = {
    "transformers:tests/trainer/test_trainer.py::TrainerGradientAccumulationTest::"
    "test_gradient_accumulation_loss_alignment_with_loss_func": (
        "its third training uses a compute_loss_func that ignores num_items_in_batch (each micro-batch's mean, "
        "GA 2) and asserts that this 'broken' loss curve differs from the GA-1 curve by more than 3; with "
        "hf_gradfix the window is normalized exactly for that loss function too, so the curves agree (~1e-6)"
    ),
    "transformers:tests/trainer/test_trainer_moe_loss.py::TrainerMoELossTest::"
    "test_unscaled_model_loss_0_averaging_disabled": (
        "asserts that with average_tokens_across_devices=False (2 ranks simulated) compute_loss returns the "
        "rank's own mean unscaled, i.e. that ranks are weighted equally; hf_gradfix turns the averaging on "
        "(with a warning saying why) and returns the rank's share of the exact global token mean, 2x here"
    ),
}

#: Why a test fails the same way in both runs, by its reason (first match wins). These are not about hf_gradfix;
#: they are counted so that the report says how much of each suite really ran.
SAME_FAILURE_CAUSES = [
    ("needs the hub (an id without an offline stand-in)", re.compile(
        r"offline|OfflineModeIsEnabled|LocalEntryNotFound|couldn't connect|Cannot find the requested files|"
        r"not a valid model identifier|is not a local folder|ConnectionError|Failed to resolve|Max retries exceeded|"
        r"does not appear to have a file named|Repository Not Found|Couldn't reach|NameResolutionError",
        re.IGNORECASE)),
    ("uses a name the installed peer no longer has", re.compile(r"PeerSuitesRemovedName")),
    ("hard-codes the real tokenizer's token ids (e.g. Qwen2.5's 151645)", re.compile(r"index out of range in self")),
    ("other (the test files are older than the installed peer, or the stand-ins differ)", re.compile(r"")),
]


# ----------------------------------------------------------------------------------------------------------------------
# Selection and sources
# ----------------------------------------------------------------------------------------------------------------------


def select_files(peers: dict[str, Path], only: list[str]) -> list[tuple[str, str]]:
    """``[(peer, relative path)]`` of the test files to run."""
    chosen = []
    for peer, root in peers.items():
        for pattern in DEFAULT_FILES[peer]:
            for path in sorted(root.glob(pattern)):
                rel = path.relative_to(root).as_posix()
                if path.is_file() and (not only or any(fnmatch.fnmatch(f"{peer}:{rel}", p) or
                                                       fnmatch.fnmatch(rel, p) for p in only)):
                    chosen.append((peer, rel))
    return chosen


def source_of(root: Path) -> str:
    """Where a checkout came from: its git commit, or what its ``PEER_SOURCE.txt`` says."""
    marker = root / "PEER_SOURCE.txt"
    if marker.exists():
        return marker.read_text().strip().splitlines()[0]
    if (root / ".git").exists():
        proc = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%H %cd"], capture_output=True, text=True)
        return proc.stdout.strip() or "git checkout (commit unknown)"
    return "unknown origin"


def stage(peer: str, root: Path, work: Path) -> Path:
    """Copy the peer's tests (and its pytest configuration) into ``work``.

    Run from a copy, not from the checkout: a checkout's root holds the peer's own package (``trl/``), and pytest
    puts the root on ``sys.path`` for ``tests/`` packages, which would import the checkout's TRL instead of the
    installed one the comparison is about.
    """
    dest = work / peer
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(root / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.cfg", "pytest.ini", "conftest.py"):
        if (root / name).exists():
            shutil.copy2(root / name, dest / name)
    if not (dest / "pyproject.toml").exists() and not (dest / "pytest.ini").exists():
        (dest / "pytest.ini").write_text("[pytest]\n")  # pin the rootdir here, away from any parent configuration
    return dest


_ID = re.compile(r"""["']([A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)["']""")


def hub_ids(files: list[Path]) -> set[str]:
    """Every quoted string in the test files that names a hub id: one the stand-ins know (``"bert-base-cased"``,
    ``"trl-internal-testing/zen"``, any ``tiny-<Class>``), or any ``"org/name"`` under a testing organisation (those
    without a stand-in are reported as such). Metric names like ``"completions/mean_length"`` are not ids."""
    ids = set()
    for path in files:
        for match in _ID.finditer(path.read_text(encoding="utf-8")):
            value = match.group(1)
            kind, _ = peer_suites_standins.classify(value)
            if kind != "unknown" or ("/" in value and value.split("/")[0] in ("trl-internal-testing",
                                                                            "hf-internal-testing")):
                ids.add(value)
    return ids


# ----------------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------------


def child_env(args, standins: Path, mode: str, run_dir: Path, threads: int) -> dict:
    env = dict(os.environ)
    paths = [str(PLUGINS)]
    if args.gradfix_path:
        paths.append(str(Path(args.gradfix_path).resolve()))
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not args.gradfix_path:
        paths.append(str(REPO))  # fallback after any PYTHONPATH: the checkout this runner lives in
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_HUB_CACHE=str(standins / "hub"), HF_HOME=str(run_dir / "hf_home"),
        HF_DATASETS_CACHE=str(run_dir / "datasets_cache"), HF_HUB_DISABLE_TELEMETRY="1",
        PEER_SUITES_DATASETS=str(standins / "datasets"), PEER_SUITES_TIMEOUT=str(args.timeout),
        WANDB_DISABLED="true", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
        PYTHONDONTWRITEBYTECODE="1",
    )
    for name in ("HF_GRADFIX_CONFIG", "RUN_SLOW", "HF_TOKEN", "PYTEST_ADDOPTS"):
        env.pop(name, None)  # patch() uses its defaults; slow tests stay off as in the peers' CPU CI
    return env


def run_one(args, peer: str, rel: str, mode: str, work: Path, standins: Path, threads: int) -> dict:
    """One pytest process over one file in one mode; returns where its records are."""
    run_dir = args.out / "runs" / mode / peer
    run_dir.mkdir(parents=True, exist_ok=True)
    stem = rel.replace("/", "__").removesuffix(".py")
    record, meta, log = run_dir / f"{stem}.jsonl", run_dir / f"{stem}.meta.json", run_dir / f"{stem}.log"
    for path in (record, meta):
        path.unlink(missing_ok=True)
    env = child_env(args, standins, mode, run_dir, threads)
    env.update(PEER_SUITES_RECORD=str(record), PEER_SUITES_META=str(meta))
    cmd = [args.python, "-m", "pytest", rel, "-p", "peer_suites_offline", "-q", "-rN", "-p", "no:cacheprovider",
           "--rootdir", str(work / peer), "-o", "addopts=", "--basetemp", str(run_dir / f"tmp_{stem}")]
    if mode == "patched":
        cmd += ["-p", "peer_suites_gradfix"]
    if MARKERS[peer]:
        cmd += ["-m", MARKERS[peer]]
    if args.k:
        cmd += ["-k", args.k]
    start = time.time()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, cwd=work / peer, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.file_timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = "file timeout"
    return {"peer": peer, "file": rel, "mode": mode, "record": str(record), "meta": str(meta), "log": str(log),
            "returncode": returncode, "seconds": round(time.time() - start, 1)}


# ----------------------------------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------------------------------


def outcomes(record: Path) -> dict[str, tuple[str, str]]:
    """node id -> (passed | failed | skipped | error | xfailed | xpassed, one-line reason)."""
    result: dict[str, tuple[str, str]] = {}
    if not record.exists():
        return result
    for line in record.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        nodeid, when, outcome, reason = entry["nodeid"], entry["when"], entry["outcome"], entry.get("reason", "")
        previous = result.get(nodeid, ("", ""))[0]
        if when == "collect":
            result[nodeid] = ("error", f"collection: {reason}")
        elif when == "setup":
            if outcome == "failed":
                result[nodeid] = ("error", f"setup: {reason}")
            elif outcome == "skipped":
                result[nodeid] = ("skipped", reason)
        elif when == "call":
            if entry.get("xfail"):
                result[nodeid] = ("xfailed" if outcome == "skipped" else "xpassed", reason)
            else:
                result[nodeid] = (outcome, reason)
        elif when == "teardown" and outcome == "failed" and previous in ("passed", ""):
            result[nodeid] = ("error", f"teardown: {reason}")
    return result


def same_failure_cause(reason: str, missing_ids: set[str]) -> str:
    if any(repo_id in reason for repo_id in missing_ids):
        return SAME_FAILURE_CAUSES[0][0]
    return next(cause for cause, pattern in SAME_FAILURE_CAUSES if pattern.search(reason))


def compare(runs: list[dict], manifest: dict) -> dict:
    """Counts per file, differing tests, regressions, and the tests failing alike in both runs (by cause)."""
    by_file: dict[tuple[str, str], dict[str, dict]] = {}
    for run in runs:
        by_file.setdefault((run["peer"], run["file"]), {})[run["mode"]] = run
    missing_ids = set(manifest.get("missing", {}))
    report = {"files": [], "differences": [], "regressions": [], "allowed": [], "same_failure": [], "broken_runs": []}
    for (peer, rel), modes in sorted(by_file.items()):
        stock = outcomes(Path(modes["stock"]["record"])) if "stock" in modes else {}
        patched = outcomes(Path(modes["patched"]["record"])) if "patched" in modes else {}
        for mode, run in modes.items():
            if not (stock if mode == "stock" else patched):
                report["broken_runs"].append(f"{peer}:{rel} ({mode}): no test results; see {run['log']}")
        counts = {mode: Counter(o for o, _ in res.values()) for mode, res in (("stock", stock), ("patched", patched))}
        report["files"].append({"peer": peer, "file": rel,
                                "stock": dict(counts["stock"]) if "stock" in modes else None,
                                "patched": dict(counts["patched"]) if "patched" in modes else None,
                                "seconds": {m: r["seconds"] for m, r in modes.items()}})
        for nodeid in sorted(set(stock) | set(patched)):
            s, p = stock.get(nodeid, ("absent", "")), patched.get(nodeid, ("absent", ""))
            full_id = f"{peer}:{nodeid}"
            if s[0] != p[0]:
                entry = {"test": full_id, "stock": s[0], "patched": p[0], "stock_reason": s[1], "patched_reason": p[1]}
                report["differences"].append(entry)
                if s[0] in ("passed", "xfailed") and p[0] in ("failed", "error", "xpassed"):
                    if full_id in NEGATIVE_CONTROLS:
                        report["allowed"].append({**entry, "why": NEGATIVE_CONTROLS[full_id]})
                    else:
                        report["regressions"].append(entry)
            elif s[0] in ("failed", "error"):
                report["same_failure"].append({"test": full_id, "reason": s[1],
                                               "cause": same_failure_cause(s[1], missing_ids)})
    return report


def _counts(c: dict | None) -> str:
    if c is None:
        return "-"
    extra = "".join(f" +{c[k]} {k}" for k in ("xfailed", "xpassed") if c.get(k))
    return f"{c.get('passed', 0)}/{c.get('failed', 0)}/{c.get('skipped', 0)}/{c.get('error', 0)}{extra}"


def render(report: dict, facts: dict) -> str:
    lines = ["# Peer suites: stock vs hf_gradfix.patch()", ""]
    for key, value in facts.items():
        lines.append(f"- {key}: {value}")
    lines += ["", "passed/failed/skipped/error per file:", "",
              "| file | stock | patched | needs the hub | minutes (stock, patched) |", "|---|---|---|---|---|"]
    hub = SAME_FAILURE_CAUSES[0][0]
    offline_by_file = Counter(o["test"].split("::")[0] for o in report["same_failure"] if o["cause"] == hub)
    for f in report["files"]:
        key = f"{f['peer']}:{f['file']}"
        secs = f["seconds"]
        lines.append(f"| {key} | {_counts(f['stock'])} | {_counts(f['patched'])} | {offline_by_file.get(key, 0)} | "
                     f"{secs.get('stock', 0) / 60:.1f}, {secs.get('patched', 0) / 60:.1f} |")
    total = {m: Counter() for m in ("stock", "patched")}
    for f in report["files"]:
        for m in total:
            total[m].update(f[m] or {})
    lines.append(f"| **total** | {_counts(total['stock'])} | {_counts(total['patched'])} | "
                 f"{sum(offline_by_file.values())} | |")
    lines += ["", f"## Tests whose outcome differs ({len(report['differences'])})", ""]
    for d in report["differences"] or [{"test": "(none)"}]:
        if "stock" not in d:
            lines.append("- none")
            break
        reason = d["patched_reason"] or d["stock_reason"]
        lines.append(f"- `{d['test']}`: stock {d['stock']}, patched {d['patched']}" + (f": {reason}" if reason else ""))
    lines += ["", f"## Pass stock, fail patched, outside the negative controls: {len(report['regressions'])}", ""]
    for d in report["regressions"]:
        lines.append(f"- `{d['test']}`: {d['patched_reason']}")
    if report["allowed"]:
        lines += ["", "## Upstream negative controls (fail patched by design)", ""]
        for d in report["allowed"]:
            lines.append(f"- `{d['test']}`: {d['why']}")
    lines += ["", f"## Same failure in both runs: {len(report['same_failure'])}", ""]
    for cause, _ in SAME_FAILURE_CAUSES:
        tests = [o for o in report["same_failure"] if o["cause"] == cause]
        if tests:
            lines.append(f"- {cause}: {len(tests)}")
            for reason, n in Counter(_reason_key(o["reason"]) for o in tests).most_common(8):
                lines.append(f"  - {n} x {reason}")
    if report["broken_runs"]:
        lines += ["", "## Runs without results", ""] + [f"- {b}" for b in report["broken_runs"]]
    return "\n".join(lines) + "\n"


def _reason_key(reason: str) -> str:
    """Group failures by the id or the error they name, not by their full text."""
    match = re.search(r"([\w-]+/[\w.-]+)", reason)
    head = reason.split(":")[0] if ":" in reason else reason
    return f"{head}: {match.group(1)}" if match else reason[:160]


def _checkout_state(path: Path) -> str:
    """``<commit>`` of the git checkout holding ``path``, ``+ local changes`` when its hf_gradfix/ is modified."""
    head = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%h"], capture_output=True, text=True)
    if head.returncode != 0:
        return "not a git checkout"
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--", "."], capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + (" + local changes" if dirty else "")


def describe_run(run: dict, root: Path) -> None:
    """Add to a run what its pytest reported about itself (versions, hf_gradfix) and what it ran."""
    meta = Path(run["meta"])
    m = json.loads(meta.read_text()) if meta.exists() else {}
    record = Path(run["record"])
    finished = record.stat().st_mtime if record.exists() else time.time()
    run["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(finished))
    run["versions"] = " ".join(f"{k} {m[k]['version']}" for k in
                               ("torch", "transformers", "trl", "accelerate", "datasets", "peft")
                               if isinstance(m.get(k), dict) and "version" in m[k])
    gradfix = m.get("hf_gradfix", {})
    run["hf_gradfix"] = (f"{gradfix['file']} at {_checkout_state(Path(gradfix['file']).parent)} "
                         f"(patched={gradfix['patched']})" if gradfix.get("file") else "not imported")
    run["stubbed"] = m.get("stubbed_names", [])
    run["tests_from"] = f"{root} ({source_of(root)})"
    run["sha256"] = hashlib.sha256((root / run["file"]).read_bytes()).hexdigest()[:12]


def summarize(runs: list[dict], manifest: dict, standins: Path) -> dict:
    """The facts of the report, gathered over its runs (several values when reruns used different ones)."""
    def values(key, mode=None):
        return ", ".join(sorted({str(r.get(key)) for r in runs if mode in (None, r["mode"])})) or "?"

    facts = {"runs finished": f"{min(r.get('finished', '?') for r in runs)} .. "
                              f"{max(r.get('finished', '?') for r in runs)}",
             "tests from": values("tests_from"), "versions": values("versions"),
             "hf_gradfix in stock runs": values("hf_gradfix", "stock"),
             "hf_gradfix in patched runs": values("hf_gradfix", "patched"),
             "names the installed peer lacks (stubbed)":
                 ", ".join(sorted({name for r in runs for name in r.get("stubbed", [])})) or "none"}
    for r in sorted(runs, key=lambda r: (r["peer"], r["file"])):
        facts[f"{r['peer']}:{r['file']}"] = f"sha256 {r.get('sha256', '?')}"
    facts["stand-ins"] = (f"{standins} ({len(manifest.get('models', {}))} models, "
                          f"{len(manifest.get('datasets', {}))} datasets)")
    facts["ids without a stand-in"] = ", ".join(sorted(manifest.get("missing", {}))) or "none"
    return facts


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl", type=Path, help="TRL source checkout (its tests/ and scripts/)")
    parser.add_argument("--transformers", type=Path, help="folder with transformers' tests/trainer files")
    parser.add_argument("--only", action="append", default=[],
                        help="glob on 'peer:path' or 'path' (repeatable), e.g. 'trl:*sft*' or '*moe_loss*'")
    parser.add_argument("-k", help="pytest -k expression, passed to every file")
    parser.add_argument("--out", type=Path, default=Path("/tmp/peer_suites"), help="outputs (default %(default)s)")
    parser.add_argument("--standins", type=Path, help="stand-in cache (default OUT/standins; built when missing)")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="per-test limit, seconds (default 600)")
    parser.add_argument("--file-timeout", type=float, default=4 * 3600, help="per-file-run limit, seconds")
    parser.add_argument("--gradfix-path", help="put this checkout's hf_gradfix first on the children's path")
    parser.add_argument("--python", default=sys.executable, help="interpreter with pytest and the peers installed")
    parser.add_argument("--mode", choices=("both", "stock", "patched"), default="both")
    parser.add_argument("--report", action="store_true", help="only re-print the comparison of an earlier --out")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    standins = (args.standins or args.out / "standins").resolve()
    state_file = args.out / "runs.json"

    peers = {name: path.resolve() for name, path in (("trl", args.trl), ("transformers", args.transformers)) if path}
    if args.report:
        runs = json.loads(state_file.read_text())["runs"]
        for run in runs:
            if "versions" not in run and run["peer"] in peers:  # a state file from before these fields
                describe_run(run, peers[run["peer"]])
    else:
        if not peers:
            parser.error("give --trl and/or --transformers")
        files = select_files(peers, args.only)
        if not files:
            parser.error("no test file selected")
        work = args.out / "src"
        for peer in {p for p, _ in files}:
            stage(peer, peers[peer], work)
        print(f"building stand-ins in {standins} ...", flush=True)
        manifest = peer_suites_standins.build(
            standins, hub_ids([peers[p] / rel for p, rel in files]), peers.get("trl"), log=lambda m: None)
        modes = ("stock", "patched") if args.mode == "both" else (args.mode,)
        tasks = [(peer, rel, mode) for peer, rel in files for mode in modes]
        threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
        # earlier runs of files not rerun now are kept, so an --only rerun updates the report instead of shrinking it;
        # the state is written after every run, so a run cut short still reports what finished
        earlier = json.loads(state_file.read_text())["runs"] if state_file.exists() else []
        rerun = {(p, r, m) for p, r, m in tasks}
        kept = [r for r in earlier if (r["peer"], r["file"], r["mode"]) not in rerun]
        runs = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_one, args, p, r, m, work, standins, threads): (p, r, m) for p, r, m in tasks}
            for future in concurrent.futures.as_completed(futures):
                run = future.result()
                describe_run(run, peers[run["peer"]])
                runs.append(run)
                state_file.write_text(json.dumps({"runs": runs + kept}, indent=1))
                print(f"  {run['mode']:8s} {run['peer']}:{run['file']}  {run['seconds'] / 60:.1f} min  "
                      f"(pytest exit {run['returncode']})", flush=True)
        runs += kept

    manifest_path = standins / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    report = compare(runs, manifest)
    text = render(report, summarize(runs, manifest, standins))
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(text)
    if report["regressions"]:
        return 1
    return 2 if report["broken_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
