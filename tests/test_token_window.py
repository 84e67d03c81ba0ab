"""hf_gradfix.TokenWindow: hand-written loops whose accumulated gradient is the global token mean.

Ground truth (``harness``): plain PyTorch, one process, every sample of the optimizer window (all ranks) run
unpadded, token-level CE summed by the task's rule and divided by the total count, one backward.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import harness as H
from hf_gradfix import TokenWindow

GRAD_TOL = 1e-5
LOSS_TOL = 1e-6


def micro_batches(model, samples, bs):
    """Collated micro-batches of ``bs`` samples (padded inside), each with the idx list of its samples."""
    collate = H.RecordingCollator(H.task_of(model), H.pad_id_of(model)).collate
    return [dict(collate(samples[i:i + bs]), idx=[s["idx"] for s in samples[i:i + bs]])
            for i in range(0, len(samples), bs)]


def inputs_of(batch):
    return {k: v for k, v in batch.items() if k != "idx"}


def ce_sum(logits, labels, shifted):
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=H.IGNORE_INDEX, reduction="sum")


def run_windows(model, batches, ga, mode, count_rule="shifted", aux_coef=None):
    """Accumulate with TokenWindow (plain PyTorch backward); per window: idx, grads, loss, mean_terms."""
    out = []
    for window in TokenWindow(None, batches, ga, model=model, count_rule=count_rule):
        idx = []
        for batch, micro in window:
            idx += batch["idx"]
            if mode == "model":  # the model honours num_items_in_batch
                res = model(**inputs_of(batch), num_items_in_batch=micro.num_items_in_batch)
                loss = micro.model_loss(res.loss)
            elif mode == "mean":  # the model's own per-micro-batch mean
                res = model(**inputs_of(batch))
                loss = micro.loss_from_mean(res.loss)
            else:  # "sum": our own CE sum from the logits
                res = model(**{k: v for k, v in inputs_of(batch).items() if k != "labels"})
                loss = micro.scale(ce_sum(res.logits, batch["labels"], shifted=count_rule == "shifted"))
            if aux_coef is not None:
                loss = loss + micro.mean_term(aux_coef * res.logits.float().pow(2).mean())
            loss.backward()
        out.append(dict(idx=idx, grads=H._grads(model), loss=window.loss, mean_terms=window.mean_terms,
                        num_items=window.num_items, num_micro=window.num_micro_batches))
        H._zero_grads(model)
    return out


def naive_windows(model, batches, ga):
    """The usual recipe: ``loss = model(**batch).loss / GA`` per micro-batch (what ``accumulate()`` computes)."""
    out = []
    for start in range(0, len(batches), ga):
        window = batches[start:start + ga]
        for batch in window:
            (model(**inputs_of(batch)).loss / len(window)).backward()
        out.append(dict(idx=[i for b in window for i in b["idx"]], grads=H._grads(model)))
        H._zero_grads(model)
    return out


def check_exact(model, samples, task, windows):
    by_idx = {s["idx"]: s for s in samples}
    errs = []
    for w in windows:
        d = H.ground_truth_details(model, [by_idx[i] for i in w["idx"]], task)
        assert w["num_items"] == d["n_targets"]
        err = H.rel_err(w["grads"], d["grads"])
        assert err <= GRAD_TOL, err
        assert abs(w["loss"] - d["loss"]) / d["loss"] <= LOSS_TOL, (w["loss"], d["loss"])
        errs.append(err)
    return errs


@pytest.mark.parametrize("arch,rule,mode,bs", [
    ("llama", "shifted", "model", 1),
    ("llama", "shifted", "mean", 2),
    ("llama", "shifted", "sum", 1),
    ("bert_mlm", "unshifted", "mean", 1),
    ("llama_tokcls", "unshifted", "sum", 2),
])
def test_ga4_gradient_is_the_full_batch_token_mean(arch, rule, mode, bs):
    model = H.build_model(arch)
    task = H.task_of(arch)
    samples = H.make_samples(task, n=12 * bs, seed=1)  # 3-41 tokens: very unequal micro-batches
    windows = run_windows(model, micro_batches(model, samples, bs), 4, mode, count_rule=rule)
    assert [w["num_micro"] for w in windows] == [4, 4, 4]
    check_exact(model, samples, task, windows)


def test_user_count_function():
    # sequence classification: the loss is a mean over rows, so the user counts rows
    model = H.build_model("llama_seqcls")
    samples = H.make_samples("seqcls", n=12, seed=2)
    windows = run_windows(model, micro_batches(model, samples, 1), 4, "mean",
                          count_rule=lambda batch: batch["labels"].numel())
    check_exact(model, samples, "seqcls", windows)


def test_naive_recipe_fails_the_same_check():
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=12, seed=1)
    by_idx = {s["idx"]: s for s in samples}
    errs = []
    for w in naive_windows(model, micro_batches(model, samples, 1), 4):
        gt = H.ground_truth(model, [by_idx[i] for i in w["idx"]], "causal")[1]
        errs.append(H.rel_err(w["grads"], gt))
    assert min(errs) > 0.1, errs


def test_last_partial_window_has_no_extra_step():
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=10, seed=3)
    windows = run_windows(model, micro_batches(model, samples, 1), 4, "model")
    assert [w["num_micro"] for w in windows] == [4, 4, 2]  # 3 optimizer steps, the last over 2 micro-batches
    check_exact(model, samples, "causal", windows)


def test_mean_term_passes_through_unscaled():
    """coef * aux (a per-micro-batch mean) -> coef * (mean over micro-batches of aux), not weighted by tokens."""
    coef = 0.5
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=6, seed=4)
    batches = micro_batches(model, samples, 1)
    (w,) = run_windows(model, batches, 6, "model", aux_coef=coef)
    total, count = 0.0, 0
    for s in samples:
        ce, c = H.sample_loss_sum(model, s, "causal")
        total, count = total + ce, count + c
    aux = torch.stack([model(**inputs_of(b)).logits.float().pow(2).mean() for b in batches]).mean()
    (total / count + coef * aux).backward()
    gt = H._grads(model)
    H._zero_grads(model)
    assert H.rel_err(w["grads"], gt) <= GRAD_TOL
    assert math.isclose(w["mean_terms"], coef * float(aux.detach()), rel_tol=1e-6)


def test_window_module_imports_neither_transformers_nor_accelerate():
    code = "import sys, hf_gradfix.loss.window; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_window_must_be_iterated_to_the_end():
    batches = [{"labels": torch.tensor([[5, 6, 7]])}] * 3
    with pytest.raises(RuntimeError, match="not iterated to its end"):
        for window in TokenWindow(None, batches, 2):
            pass


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes (gloo): uneven tokens, an empty window, a rank that runs out of data, Accelerator GA compensation
# ---------------------------------------------------------------------------------------------------------------------


def _launch_ddp(out: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(H._free_port()),
           str(H.TESTS_DIR / "token_window_worker.py"), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(H.REPO_ROOT), str(H.TESTS_DIR), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=str(H.REPO_ROOT), env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-12000:], file=sys.stderr)
    assert proc.returncode == 0, "token_window_worker failed (output printed)"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_ddp_uneven_ranks_empty_window_and_aux():
    import token_window_worker as W

    with tempfile.TemporaryDirectory(prefix="hgf_tw_") as tmp:
        ranks = _launch_ddp(Path(tmp))
    samples = ranks[0]["samples"]
    by_idx = {s["idx"]: s for s in samples}
    model = H.build_model("llama")
    model.load_state_dict(ranks[0]["initial_state"])
    # the scenario really is uneven: rank 0's first window has no target, rank 1 holds the long samples
    rank0, rank1 = ranks[0]["rank_idx"]
    assert sum(H.sample_loss_count(by_idx[i], "causal") for i in rank0[:3]) == 0
    assert sum(len(by_idx[i]["input_ids"]) for i in rank1) > 5 * sum(len(by_idx[i]["input_ids"]) for i in rank0)
    for rank in ranks:  # 3 windows per pass on both ranks (rank 0 pads), one optimizer step each, no extra step
        assert rank["steps_run"] == 6
    for mode in ("model", "mean_aux"):
        w0s, w1s = ranks[0]["passes"][mode], ranks[1]["passes"][mode]
        assert [len(w["idx_batches"]) for w in w0s] == [3, 1, 0]
        assert [len(w["idx_batches"]) for w in w1s] == [3, 3, 2]
        for w0, w1 in zip(w0s, w1s):
            assert all(torch.equal(w0["grads"][n], w1["grads"][n]) for n in w0["grads"])
            mbs = w0["idx_batches"] + w1["idx_batches"]
            H._zero_grads(model)
            total, count = 0.0, 0
            for b in mbs:
                for i in b:
                    ce, c = H.sample_loss_sum(model, by_idx[i], "causal")
                    total, count = total + ce, count + c
            loss = total / count
            ce_mean = float(loss.detach())
            if mode == "mean_aux":  # mean over the real micro-batches of both ranks
                aux = torch.stack([W.aux_of(H._logits(model, by_idx[b[0]], "causal")) for b in mbs]).mean()
                loss = loss + W.AUX_COEF * aux
                assert math.isclose(w0["mean_terms"], W.AUX_COEF * float(aux.detach()), rel_tol=1e-6)
            loss.backward()
            gt = H._grads(model)
            assert w0["num_items"] == count
            assert H.rel_err(w0["grads"], gt) <= GRAD_TOL, (mode, H.rel_err(w0["grads"], gt))
            assert abs(w0["loss"] - ce_mean) / ce_mean <= LOSS_TOL
