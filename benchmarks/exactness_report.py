"""Before/after table: each exactness case of the test suite, on stock transformers and with hf_gradfix.

    python benchmarks/exactness_report.py            # single-process cases (~3 min on 2 cores)
    python benchmarks/exactness_report.py --ddp      # plus the 2-process DDP cases (~3 more min)

Each number is the worst over the run's optimizer steps of the relative gradient error
||g - g*|| / ||g*|| against the independent ground truth of ``tests/support/harness.py`` (plain PyTorch,
whole optimizer window at once), and of the logged training loss's relative error. Tolerances of the
tests: gradient 1e-5, loss 1e-6.
"""

from __future__ import annotations

import argparse
import os
import time

from _common import ROOT, on_path, versions  # noqa: E402

on_path(ROOT / "tests" / "support")
__import__("suite_paths").add()  # the rooms' test modules (tests/support/suite_paths.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import harness as H  # noqa: E402
import hf_gradfix  # noqa: E402
import test_exactness as T  # noqa: E402

transformers.logging.set_verbosity_error()


def single(arch, *, n=12, model_kw=None, build=None, gt=None, use_aux=False, **run_kw):
    def run():
        model = build() if build else H.build_model(arch, **(model_kw or {}))
        task = H.task_of(arch)
        samples = H.make_samples(task, n=n, seed=0)
        record = H.run_trainer(model, samples, task, gradient_accumulation_steps=4, **run_kw)
        if gt is not None:
            return T.custom_gt_rows(model, samples, record, gt)
        return H.check_against_gt(model, samples, task, record, use_aux=use_aux)

    return run


def _lora():
    import peft

    return peft.get_peft_model(H.build_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False))


def _prompt():
    import peft

    return peft.get_peft_model(H.build_model("llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


CASES = {
    "decoder causal LM (Llama)": single("llama"),
    "decoder causal LM (Qwen2)": single("qwen2"),
    "decoder causal LM (Mistral)": single("mistral"),
    "causal LM without registered loss type (GPT-2)": single("gpt2"),
    "sequence classification (Llama head)": single("llama_seqcls"),
    "sequence classification (BERT)": single("bert_seqcls"),
    "token classification (Llama head)": single("llama_tokcls"),
    "token classification (BERT)": single("bert_tokcls"),
    "masked LM (BERT)": single("bert_mlm"),
    "masked LM (RoBERTa)": single("roberta_mlm"),
    "encoder-decoder (T5)": single("t5"),
    "encoder-decoder (BART)": single("bart"),
    "forward without **kwargs (wrapper)": single("nokwargs"),
    "VLM accepts_loss_kwargs=False (Qwen2.5-VL, text)": single("qwen2_5_vl"),
    "compute_loss override returning outputs.loss": single("llama", trainer_cls=T.TutorialTrainer),
    "compute_loss override, own F.cross_entropy mean": single("llama", trainer_cls=T.OwnCrossEntropyTrainer),
    "compute_loss_func returning a mean": single("llama", compute_loss_func=T.loss_func_mean),
    "compute_loss_func sum/num_items + wrapper model": single("nokwargs", compute_loss_func=T.loss_func_sum),
    "MoE router aux loss (Mixtral, coef 0.5)": single("mixtral", model_kw={"moe_aux": True}, use_aux=True),
    "label smoothing 0.1 (Llama)": single("llama", extra_args={"label_smoothing_factor": 0.1}, gt=lambda m, w: T._label_smoothing_gt(m, w, 0.1)),
    "label smoothing 0.1 on a wrapped causal LM": single("nokwargs", extra_args={"label_smoothing_factor": 0.1}, gt=lambda m, w: T._label_smoothing_gt(m, w, 0.1)),
    "PEFT LoRA": single("llama", build=_lora),
    "PEFT prompt tuning (4 virtual tokens)": single("llama", build=_prompt, gt=lambda m, w: T._prompt_tuning_gt(m, w, 4)),
    "partial last window (10 samples, GA 4)": single("llama", n=10),
    "partial last window, seqcls head": single("bert_seqcls", n=10),
}

DDP_CASES = {
    "DDP x2: causal LM, unequal tokens": ("llama", []),
    "DDP x2: sequence classification head": ("llama_seqcls", []),
    "DDP x2: compute_loss override": ("llama_tutorial", []),
    "DDP x2: average_tokens_across_devices=False": ("llama", ["--avg-false"]),
    "DDP x2: a rank without targets in a window": ("llama_empty_rank", []),
}


def worst(rows):
    g = max(r[0] for r in rows)
    losses = [r[1] for r in rows if r[1] is not None]
    return g, (max(losses) if losses else float("nan"))


def eval_case():
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=11, seed=1)
    model.eval()
    with torch.no_grad():
        sums = [H.sample_loss_sum(model, s, "causal") for s in samples]
    gt = sum(float(a) for a, _ in sums) / sum(b for _, b in sums)
    out = {}
    for patched in (False, True):
        if patched:
            hf_gradfix.patch()
        errs = []
        for bs in (1, 4, 5):
            tr = H.make_trainer(model, samples, "causal", extra_args={"per_device_eval_batch_size": bs})
            errs.append(abs(tr.evaluate(eval_dataset=H.ListDataset(samples))["eval_loss"] - gt) / gt)
        if patched:
            hf_gradfix.unpatch()
        out[patched] = max(errs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="also run the 2-process DDP cases")
    parser.add_argument("-k", default="", help="only cases whose name contains this text")
    args = parser.parse_args()
    print(f"{versions('transformers', 'torch', 'hf_gradfix')}\n")
    print("| case | stock grad err | stock loss err | hf_gradfix grad err | hf_gradfix loss err |")
    print("|---|---|---|---|---|")
    t0 = time.time()
    for name, run in CASES.items():
        if args.k not in name:
            continue
        before = worst(run())
        hf_gradfix.patch()
        try:
            after = worst(run())
        finally:
            hf_gradfix.unpatch()
        print(f"| {name} | {before[0]:.2e} | {before[1]:.2e} | {after[0]:.2e} | {after[1]:.2e} |", flush=True)
    if not args.k or args.k in "eval loss, batch sizes 1/4/5":
        e = eval_case()
        print(f"| eval loss, eval batch sizes 1/4/5 (Llama) | - | {e[False]:.2e} | - | {e[True]:.2e} |", flush=True)
    if args.ddp:
        for name, (scenario, extra) in DDP_CASES.items():
            if args.k not in name:
                continue
            res = []
            for patch in (False, True):
                r = H.run_ddp(scenario, patch=patch, extra=extra)
                rows = H.check_ddp_against_gt(r)
                res.append((max(x["rel_err"] for x in rows), max(x["loss_rel_err"] for x in rows)))
            (bg, bl), (ag, al) = res
            print(f"| {name} | {bg:.2e} | {bl:.2e} | {ag:.2e} | {al:.2e} |", flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
