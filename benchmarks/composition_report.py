"""The composition matrix's verdict table (issue 50): every cell of ``tests/trainer/test_composition_matrix.py``, its verdict
and why, and the pairs no cell holds, with their reasons.

    python benchmarks/composition_report.py                      # prints the table (~30 s on 2 cores)
    python benchmarks/composition_report.py --out benchmarks/results/composition-matrix.md

Each cell is one training run (GA 2, 2 optimizer steps, AdamW moving the weights) held to the independent float64
ground truth of ``tests/support/composition.py``; the verdicts: exact (relative gradient error <= 1e-5 at every step), stock
(equal to the stock run, one warning), refused (one line before any step), FAIL (anything else).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from pathlib import Path

from _common import ROOT, on_path  # noqa: E402

on_path(ROOT / "tests" / "support")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import composition as C  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    rows, impossible = C.covering_rows()
    cells = [("covering", r) for r in rows] + [("solo", r) for r in C.solo_rows()]
    started = time.perf_counter()
    verdicts = [(kind, C.judge(row)) for kind, row in cells]
    seconds = time.perf_counter() - started
    counts = {k: sum(v.kind == k for _, v in verdicts) for k in ("exact", "stock", "refused", "FAIL")}
    lines = [
        "# The composition matrix: verdicts",
        "",
        f"<!-- written by benchmarks/composition_report.py; torch {torch.__version__}, transformers "
        f"{transformers.__version__} -->",
        "",
        f"**{len(verdicts)} cells** ({len(rows)} covering rows, {len(cells) - len(rows)} solo cells) in {seconds:.0f} s: "
        + ", ".join(f"{n} {k}" for k, n in counts.items()) + ". Factors: "
        + "; ".join(f"`{f}` {', '.join(map(str, levels))}" for f, levels in C.FACTORS.items()) + ".",
        "",
        "| cell | kind | verdict | why | hf_gradfix warnings |",
        "|---|---|---|---|---|",
    ]
    for kind, v in verdicts:
        detail = v.detail.replace("|", "\\|")[:220]
        lines.append(f"| `{C.cell_id(v.row)}` | {kind} | {v.kind} | {detail} | {len(v.warnings)} |")
    lines += ["", "Pairs no cell can hold:", ""]
    unbuildable = sorted({C.unbuildable(*p) for p in C.all_pairs() if C.unbuildable(*p)})
    lines += [f"- cannot be built: {reason}" for reason in unbuildable]
    lines += [f"- `{a[0]}={a[1]}` with `{b[0]}={b[1]}`: {why}" for (a, b), why in sorted(impossible.items(), key=str)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
