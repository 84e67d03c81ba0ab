"""The loss fix on vision-language models: patched vs stock gradient error per family, Trainer and TRL, on CPU.

    python benchmarks/bench_vlm_loss.py         # one 2-process gloo launch; writes results/vlm-loss.md

What ``tests/loss/test_vlm_families.py`` asserts, as a table: every case of ``tests/support/vlm_loss.py`` (family x
path x tower x patched / stock), bs 2, GA 2, 2 ranks, 2 windows of 8 samples with 0, 1 and several images of
different sizes, against the float64 ground truth (each sample alone, loss sums over the window / the window's total
target count). Errors are the worst of the 2 windows: relative L2 error of the whole gradient, of the vision tower's
and projector's gradient alone, and of the logged loss.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from _common import ROOT, command_line, md_row, on_path, results_path, versions  # noqa: E402

on_path(ROOT, ROOT / "tests" / "support")

import vlm  # noqa: E402
import vlm_loss as VL  # noqa: E402

PATH_NAMES = {"trainer": "`transformers.Trainer`",
              "trl": "TRL `SFTTrainer`, messages, `assistant_only_loss`",
              "trlpc": "TRL `SFTTrainer`, prompt-completion, `completion_only_loss`"}


def _worst(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return max(vals) if vals else None


def _fmt(x):
    return "-" if x is None else f"{x:.1e}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=results_path("vlm-loss.md"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    runs = VL.launch()
    processors = {fam: vlm.build_processor(fam) for fam in vlm.FAMILIES}
    cache: dict = {}
    rows = {case: VL.compare(case, runs[case], processors[VL.parse(case)[1]], cache) for case in runs}
    honours = {fam: VL.loss_honours_count(fam) for fam in vlm.FAMILIES}
    lines = [
        "# The loss fix on vision-language models (issue 52, item 1)",
        "",
        f"`{command_line()}`; {versions('torch', 'transformers', 'trl')}; CPU, 2 gloo processes, "
        f"{time.perf_counter() - t0:.0f} s.",
        "",
        "bs 2, GA 2, 2 ranks: windows of 8 samples with 0, 1 and several images of different sizes (one micro-batch "
        "without images). Ground truth: float64, each sample alone, loss sums / the window's total target count "
        "(both ranks, both micro-batches). Errors: worst of 2 windows, relative L2 of the gradient (all trainable "
        "parameters), of the vision tower + projector alone, and of the logged loss. `accepts_loss_kwargs`: what "
        "the Trainer read (it passes the count only when True); `honours count`: measured on the model's loss.",
        "",
        md_row(["family", "path", "tower", "accepts_loss_kwargs", "honours count", "patched grad", "patched vision",
                "patched loss", "stock grad", "stock vision", "stock loss"]),
        md_row(["---"] * 11),
    ]
    for case in runs:
        path, fam, mode, tower = VL.parse(case)
        if mode != "patched":
            continue
        pr = rows[case]
        sr = rows.get(f"{path}:{fam}:stock:{tower}")
        lines.append(md_row([
            fam, PATH_NAMES[path], tower, pr[0]["accepts_loss_kwargs"], honours[fam],
            _fmt(_worst(pr, "rel_err")), _fmt(_worst(pr, "vision_rel_err")), _fmt(_worst(pr, "loss_rel_err")),
            *((_fmt(_worst(sr, "rel_err")), _fmt(_worst(sr, "vision_rel_err")), _fmt(_worst(sr, "loss_rel_err")))
              if sr else ("not run", "", "")),
        ]))
    lines += [
        "",
        "Stock is exact exactly where the Trainer passes the count (`accepts_loss_kwargs` True) and the loss "
        "honours it; Qwen2.5-VL declares `accepts_loss_kwargs=False`, so stock averages each micro-batch and divides "
        "by GA (the classic mean-of-means), in the Trainer and in TRL's SFTTrainer alike. SmolVLM is not built: its "
        "processor needs `num2words` and torchvision (absent offline); Idefics3 is its model ancestor. No real video "
        "through the video processor: the video processors need torchvision; the Qwen2.5-VL Trainer cases carry 2 "
        "hand-built videos (`vlm.add_video`, the processor's layout) in their first window. TRL runs use `SFTConfig`'s "
        "defaults (gradient checkpointing on) except `bf16=False` (TRL defaults to bf16 autocast, which a fp32 "
        "tolerance cannot judge). Stock TRL padding-free (`padding_free=True`) on vision data: refused by TRL "
        "before training (`test_trl_padding_free_on_vision_data_does_not_run_stock` measures the refusal), so no "
        "stock padding-free error exists to report.",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
