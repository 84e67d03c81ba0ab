"""Before/after table on the ecosystem's own paths: each case of ``tests/trainer/test_ecosystem.py`` (a real tokenizer,
transformers' and TRL's collators and trainers, ``datasets`` objects), stock transformers beside hf_gradfix.

    python benchmarks/ecosystem_report.py            # ~3 min on 2 cores; writes benchmarks/results/ecosystem-transformers-<v>.md

Each number is the worst relative gradient error ``||g - g*|| / ||g*||`` over the run's optimizer steps against the
ground truth computed on the batches the Trainer actually drew (``tests/support/ecosystem.py``), and the relative error of
the eval loss against the exact token mean over the eval set (cases with an eval set).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from _common import RESULTS, ROOT, on_path  # noqa: E402

on_path(ROOT / "tests" / "support")
__import__("suite_paths").add()  # the rooms' test modules (tests/support/suite_paths.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import transformers  # noqa: E402

import ecosystem as E  # noqa: E402
import test_ecosystem as T  # noqa: E402

transformers.logging.set_verbosity_error()


def _fmt(x):
    return "—" if x is None else f"{x:.1e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file (default: benchmarks/results/ecosystem-transformers-<version>.md)")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    major = int(transformers.__version__.split(".")[0])
    rows = []
    for name in sorted(T.CASES):
        if args.k not in name or (name.startswith("trl") and major < 5):
            continue
        started = time.time()
        make, task = T.CASES[name]()
        evaluate = name in T.WITH_EVAL
        stock = E.run_case(make, task, mode="stock", evaluate=evaluate)
        ours = E.run_case(make, task, mode="patch", evaluate=evaluate)
        rows.append((name, ", ".join(sorted(ours.batch_types)), stock.worst, ours.worst, stock.eval_error, ours.eval_error))
        print(f"{name:32s} batches {rows[-1][1]:14s} grad stock {stock.worst:.1e} ours {ours.worst:.1e}  "
              f"eval stock {_fmt(stock.eval_error)} ours {_fmt(ours.eval_error)}  ({time.time() - started:.0f} s)", flush=True)
    lines = [
        f"# Ecosystem paths: stock transformers {transformers.__version__} vs hf_gradfix",
        "",
        "Command: `python benchmarks/ecosystem_report.py`. Worst relative gradient error over the optimizer steps "
        "(batch 2 x GA 2, fp32, CPU) against the ground truth on the batches the Trainer drew; eval: relative error of "
        "`eval_loss` against the exact token mean of the eval set. Tests: gradient <= 1e-5, eval <= 1e-6.",
        "",
        "| case | batch type | gradient, stock | gradient, hf_gradfix | eval_loss, stock | eval_loss, hf_gradfix |",
        "|---|---|---|---|---|---|",
    ]
    for name, types, s, o, se, oe in rows:
        lines.append(f"| {name} | {types} | {_fmt(s)} | {_fmt(o)} | {_fmt(se)} | {_fmt(oe)} |")
    out = Path(args.out) if args.out else RESULTS / f"ecosystem-transformers-{transformers.__version__}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
