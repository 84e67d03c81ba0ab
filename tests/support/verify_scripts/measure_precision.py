"""The measurements behind verify's mixed-precision rule (docs/verify.md, "What EXACT means under bf16").

Runs correct and buggy training runs under the Trainer's bf16 autocast on this machine (and fp32 beside), each
through ``hf-gradfix verify``'s own code path (``run_script`` for the scripts in this folder, ``verify`` for the
built-in run), and prints per run: the gradient error against the ground truth computed under the same autocast,
the rounding floor, their ratio, the error against the fp32 ground truth, the tolerance, the verdict and the
nearest bug reference.  ``python tests/support/verify_scripts/measure_precision.py [--quick]`` (from the repository root).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def row(name, rep, seconds):
    for s in rep.steps:
        floor = s.rounding_floor
        near = sorted((v, k) for k, v in s.candidates.items() if k != "exact")[:1]
        ratio = f"{s.grad_rel_err / floor:5.2f}" if floor else "  -  "
        fp32 = f"{s.fp32_grad_rel_err:.1e}" if s.fp32_grad_rel_err is not None else "   -   "
        lf = s.loss_floor
        lratio = f"{s.loss_rel_err / lf:7.2f}" if lf else "   -   "
        print(f"{name:44s} step {s.step}  err {s.grad_rel_err:.1e}  floor "
              f"{floor if floor is not None else float('nan'):.1e}  err/floor {ratio}  fp32 {fp32}  tol "
              f"{s.tolerance:.1e} | loss {s.loss_rel_err:.1e}  floor {lf if lf is not None else float('nan'):.1e}  "
              f"err/floor {lratio}  tol {s.loss_tolerance:.1e}  -> {s.verdict:22s} nearest "
              f"{near[0][1] if near else '-'} {near[0][0] if near else 0:.1e}  [{seconds:.0f} s]", flush=True)
    for note in rep.notes:
        if "cannot be told" in note:
            print(f"{'':44s} note: {note}")


def main() -> None:
    sys.path.insert(0, str(HERE))  # the scripts import train_user
    import torch

    from hf_gradfix.verify import synthetic_samples, tiny_model, verify
    from hf_gradfix.verify.command import run_script

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    out = tempfile.mkdtemp(prefix="measure_precision_")
    user, sft = str(HERE / "train_user.py"), str(HERE / "train_sft.py")
    scripts = [
        ("SFT defaults (bf16), stock TRL", [sft]),
        ("SFT defaults (bf16), patched", [sft, "--patch"]),
        ("SFT bf16, compute_loss mean (bug)", [sft, "--bug", "mean"]),
        ("SFT fp32 (bf16=False), stock TRL", [sft, "--bf16", "0"]),
        ("Trainer bf16, stock llama", [user, "--bf16"]),
        ("Trainer bf16, patched llama", [user, "--bf16", "--patch"]),
        ("Trainer bf16, patched, packing", [user, "--bf16", "--patch", "--packing"]),
        ("Trainer bf16, patched gpt2", [user, "--bf16", "--patch", "--arch", "gpt2"]),
        ("Trainer bf16, bs 1 GA 8, patched", [user, "--bf16", "--patch", "--bs", "1", "--ga", "8"]),
        ("Trainer bf16, mlm GA 1", [user, "--bf16", "--head", "mlm", "--ga", "1", "--bs", "4"]),
        ("Trainer bf16, mlm patched", [user, "--bf16", "--head", "mlm", "--patch"]),
        ("Trainer bf16, tokcls patched", [user, "--bf16", "--head", "tokcls", "--patch"]),
        ("Trainer bf16, seq2seq patched", [user, "--bf16", "--head", "seq2seq", "--patch"]),
        ("Trainer bf16, seqcls patched", [user, "--bf16", "--head", "seqcls", "--patch"]),
        ("Trainer bf16, loss_func_mean (bug)", [user, "--bf16", "--bug", "loss_func_mean"]),
        ("Trainer bf16, seq_divide (bug)", [user, "--bf16", "--bug", "seq_divide"]),
        ("Trainer bf16, collator_shift (bug)", [user, "--bf16", "--bug", "collator_shift"]),
        ("Trainer bf16, pad_labels (bug)", [user, "--bf16", "--bug", "pad_labels"]),
        ("Trainer bf16, stock gpt2 (count_unshifted bug)", [user, "--bf16", "--arch", "gpt2"]),
        ("Trainer bf16, mlm GA 4 stock (bug)", [user, "--bf16", "--head", "mlm"]),
    ]
    if a.quick:
        scripts = scripts[:3]
    for name, cmd in scripts:
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rep = run_script([sys.executable, *cmd, "--output_dir", os.path.join(out, "run")], steps=2)
        row(name, rep, time.perf_counter() - t)
    if a.quick:
        return
    for bug in (None, "mean_of_means", "ga_scaled", "count_unshifted", "cross_attention"):
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rep = verify(steps=2, bf16=True, inject=bug)
        row(f"built-in bf16, inject {bug}", rep, time.perf_counter() - t)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rep = verify(steps=2, bf16=True, packing=True)
    row("built-in bf16, packing", rep, time.perf_counter() - t)

    def wider():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                            pad_token_id=0))

    long = synthetic_samples(32, 512, lo=100, hi=250)
    for bug in (None, "mean_of_means", "count_unshifted"):
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rep = verify(wider, long, steps=2, bf16=True, inject=bug)
        row(f"built-in bf16, hidden 128 x4, 100-250 tok, {bug}", rep, time.perf_counter() - t)
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rep = verify(lambda: tiny_model().to(torch.bfloat16), steps=2)
    row("built-in bf16 parameters (no autocast)", rep, time.perf_counter() - t)


if __name__ == "__main__":
    main()
