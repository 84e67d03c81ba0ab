"""``hf-gradfix plan``: the closed form against the fake-tensor trace of a whole training step, per component.

    python benchmarks/plan_accuracy.py            # ~2 min on 2 CPU cores; writes benchmarks/results/plan.md

For each (model, mesh) the closed form (``estimate``) and ``--simulate`` (``simulate``: forward, backward and
``optimizer.step()`` of rank 0 under ``FakeTensorMode`` and a fake process group, classified by torch's
``MemTracker`` / ``FSDPMemTracker``) are run with the same settings: fp32 (and amp-bf16: autocast, or FSDP2's
MixedPrecisionPolicy when sharded), sequence 128 (64 for the extra
architectures), micro-batch 2, AdamW, no recomputation and full recomputation.  Error = (closed - traced) / traced,
each component against its own maximum over the step (the optimizer state: after the step; activations: saved
tensors plus the backward's transient gradients, which the tracker files as temporaries).  ``-`` where the trace
has no such component (one process, or TP alone: no FSDP buffers; DDP buckets are not traced).

The Playbook (Llama 3.1 8B / 70B) and GaLore-paper (LLaMA 7B) comparisons are in ``tests/plan/test_plan.py``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from _common import ROOT, on_path, results_path, versions  # noqa: E402

on_path(ROOT)

CASES = [
    ("tiny-llama", dict(world_size=1)),
    ("tiny-llama", dict(world_size=2, dp_shard=2)),
    ("tiny-mistral", dict(world_size=4, dp_shard=4)),
    ("tiny-qwen2", dict(world_size=4, dp_replicate=2, dp_shard=2)),
    ("tiny-qwen2", dict(world_size=2, dp_shard=1, tp=2)),
    ("tiny-mistral", dict(world_size=4, dp_replicate=2, dp_shard=1, tp=2)),
    ("tiny-qwen2", dict(world_size=4, dp_shard=2, tp=2)),
    ("tiny-llama", dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2)),
]
AMP_CASES = [("tiny-llama", dict(world_size=1)), ("tiny-mistral", dict(world_size=2, dp_shard=2)),
             ("tiny-qwen2", dict(world_size=2, dp_shard=1, tp=2))]
COMPONENTS = [("parameters", "max"), ("gradients", "max"), ("optimizer_state", "after_step"),
              ("activations", "max:activations_and_temporaries"), ("comm_buffers", "max")]


def _mesh_name(kw: dict) -> str:
    parts = [f"{k}={v}" for k, v in kw.items() if k != "world_size" and v > 1]
    return " x ".join(parts) or "1 process"


def _row(name, cfg, kw, seq, recompute, dtype="fp32"):
    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate
    from hf_gradfix.plan.simulate import simulate

    mesh = ParallelDims(**kw)
    s = Settings(seq_len=seq, micro_batch=2, dtype=dtype, recompute=recompute)
    p = estimate(cfg, mesh, s)
    t0 = time.perf_counter()
    r = simulate(cfg, mesh, s)
    cells = []
    for comp, where in COMPONENTS:
        kind, _, key = where.partition(":")
        traced = r[kind].get(key or comp)
        if not traced:
            cells.append("-")
            continue
        cells.append(f"{100 * (p.components[comp] - traced) / traced:+.1f} %")
    return (f"| {name} | {_mesh_name(kw)} | {dtype} | {recompute} | " + " | ".join(cells)
            + f" | {p.peak / r['peak']:.2f} | {time.perf_counter() - t0:.1f} s |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=results_path("plan.md"))
    ns = ap.parse_args(argv)
    from transformers import CONFIG_MAPPING

    from hf_gradfix.plan import load_model_config

    on_path(ROOT / "tests" / "support")
    __import__("suite_paths").add()  # the rooms' test modules (tests/support/suite_paths.py)
    from test_plan import MORE_ARCHS

    head = ("| model | mesh | dtype | recompute | parameters | gradients | optimizer state | activations | comm buffers "
            "| total: closed / traced peak | trace time |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, kw in CASES:
        for rc in ("none", "full"):
            rows.append(_row(name, load_model_config(name), kw, 128, rc))
            print(rows[-1], flush=True)
    for name, kw in AMP_CASES:
        rows.append(_row(name, load_model_config(name), kw, 128, "none", "amp-bf16"))
        print(rows[-1], flush=True)
    for arch, ckw in sorted(MORE_ARCHS.items()):
        kw = dict(world_size=2, dp_shard=2) if arch in ("gpt2", "mixtral") else dict(world_size=1)
        for rc in ("none", "full"):
            rows.append(_row(arch, CONFIG_MAPPING[arch](**ckw), kw, 64, rc))
            print(rows[-1], flush=True)
    text = (f"# hf-gradfix plan: closed form vs fake-tensor trace\n\n`python benchmarks/plan_accuracy.py` "
            f"({versions('torch', 'transformers')}, {platform.machine()}). "
            "Error = (closed form - traced) / traced per component; the total column is the closed-form peak "
            "(a sum of per-component maxima plus a 10 % margin) over the traced peak.\n\n" + head + "\n"
            + "\n".join(rows) + "\n")
    Path(ns.out).write_text(text, encoding="utf-8")
    print(f"written to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
