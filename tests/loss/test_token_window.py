"""hf_gradfix.TokenWindow: hand-written loops whose accumulated gradient is the global token mean.

Ground truth (``harness``): plain PyTorch, one process, every sample of the optimizer window (all ranks) run
unpadded, token-level CE summed by the task's rule and divided by the total count, one backward.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import harness as H
from multiproc import run_launch, torchrun, worker_env
from hf_gradfix import TokenWindow
from hf_gradfix.errors import UsageError

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
    proc = run_launch(torchrun(H.TESTS_DIR / "token_window_worker.py", "--out", out), cwd=str(H.REPO_ROOT),
                      env=worker_env(), step="token_window_worker.py launch")
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


# ---------------------------------------------------------------------------------------------------------------------
# The lifecycle of a hand-written accelerate loop (issue 25): several passes, a short last window, an exception in
# the middle of a window, a second TokenWindow on the same model; the weights move (SGD), every window is checked
# against the ground truth at the weights it was computed at.
# ---------------------------------------------------------------------------------------------------------------------


class _Boom(RuntimeError):
    pass


def test_lifecycle_of_an_accelerate_loop():
    """10 micro-batches, GA 4: windows of 4, 4, 2 in every pass (the last one shorter than GA, one optimizer step).
    Pass 0 and 1 whole; pass 2 raises after 2 micro-batches of its window 1; the loop recovers with zero_grad() and
    a new pass (3), which must be exact from its first window (nothing of the broken window in it), accelerate's
    ``sync_gradients`` back on (else ``optimizer.step()`` is skipped); then a second TokenWindow (GA 3, other data:
    windows of 3, 3, 1) on the same model and optimizer, then the first one again."""
    from accelerate import Accelerator

    model = H.build_model("llama")
    gt_model = H.build_model("llama")
    accelerator = Accelerator(cpu=True)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    collate = H.RecordingCollator("causal", H.pad_id_of(model)).collate
    loader = lambda samples: accelerator.prepare(torch.utils.data.DataLoader(  # noqa: E731
        samples, batch_size=1, shuffle=False, collate_fn=lambda b: dict(collate(b), idx=[s["idx"] for s in b])))
    first = H.make_samples("causal", n=10, seed=11, prompt_mask_frac=0.3)
    second = [dict(s, idx=100 + s["idx"]) for s in H.make_samples("causal", n=7, seed=12)]
    by_idx = {s["idx"]: s for s in first + second}
    tw1 = TokenWindow(accelerator, loader(first), 4, model=model, count_rule="shifted")
    tw2 = TokenWindow(accelerator, loader(second), 3, model=model, count_rule="shifted")
    checked = []

    def run_pass(tw, raise_at=None):
        """One pass; per window: (idx, gradient, loss, weights it was computed at). ``raise_at``: (window, micro)."""
        for window in tw:
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            idx = []
            for batch, micro in window:
                if (window.index, micro.index) == raise_at:
                    raise _Boom("a micro-batch failed")
                idx += batch["idx"]
                inputs = {k: v for k, v in batch.items() if k != "idx"}
                out = model(**inputs, num_items_in_batch=micro.num_items_in_batch)
                accelerator.backward(micro.model_loss(out.loss))
            checked.append(dict(idx=idx, grads=H._grads(model), loss=window.loss, num_items=window.num_items,
                                weights=weights))
            optimizer.step()
            optimizer.zero_grad()
            assert any(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # the step ran

    run_pass(tw1)
    run_pass(tw1)
    assert [len(c["idx"]) for c in checked] == [4, 4, 2] * 2
    with pytest.raises(_Boom):
        run_pass(tw1, raise_at=(1, 2))
    assert len(checked) == 7  # window 0 of pass 2 stepped, window 1 broke off after 2 micro-batches
    assert accelerator.sync_gradients  # the window's no_sync / sync_gradients state did not outlive it
    optimizer.zero_grad()  # the broken window's partial gradient is the loop's to drop (like any PyTorch loop)
    run_pass(tw1)
    run_pass(tw2)
    run_pass(tw1)
    sizes = [len(c["idx"]) for c in checked]
    assert sizes == [4, 4, 2] * 2 + [4] + [4, 4, 2] + [3, 3, 1] + [4, 4, 2], sizes
    errs = []
    for k, c in enumerate(checked):
        gt_model.load_state_dict(c["weights"])
        d = H.ground_truth_details(gt_model, [by_idx[i] for i in c["idx"]], "causal")
        assert c["num_items"] == d["n_targets"], k
        errs.append(H.rel_err(c["grads"], d["grads"]))
        assert errs[-1] <= GRAD_TOL, (k, errs[-1])
        assert abs(c["loss"] - d["loss"]) / d["loss"] <= LOSS_TOL, (k, c["loss"], d["loss"])
    print(f"\nTokenWindow lifecycle: {len(checked)} windows, max gradient error {max(errs):.1e}")


def test_a_window_broken_off_inside_the_loop_is_refused_and_the_next_pass_is_exact():
    """``try/except`` around one window and ``continue``: the half window cannot be skipped silently (every rank must
    run every micro-batch); the error says so, and a new pass afterwards is exact."""
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=6, seed=13)
    batches = micro_batches(model, samples, 1)
    tw = TokenWindow(None, batches, 4, model=model)
    with pytest.raises(UsageError, match="window 0 was not iterated to its end"):
        for window in tw:
            try:
                for batch, micro in window:
                    if micro.index == 1:
                        raise _Boom("skip this window")
                    micro.model_loss(model(**inputs_of(batch), num_items_in_batch=micro.num_items_in_batch).loss).backward()
            except _Boom:
                H._zero_grads(model)
                continue
    check_exact(model, samples, "causal", run_windows(model, batches, 4, "model"))


@pytest.mark.parametrize("args, kwargs, needle", [
    ((None, [], True), {}, "TokenWindow: grad_accum_steps=True: must be a positive integer"),
    ((None, [], 0), {}, "TokenWindow: grad_accum_steps=0: must be a positive integer"),
    ((None, [], 2), {"count_rule": "shift"}, "TokenWindow: count_rule='shift': invalid value; allowed values: 'shifted', 'unshifted', 'elements'"),
    ((None, [], 2), {"ignore_index": "-100"}, "TokenWindow: ignore_index='-100': must be an int"),
])
def test_constructor_arguments_are_one_line(args, kwargs, needle):
    """Issue 38: grad_accum_steps=True was taken as 1, a bad count_rule raised the enum's own ValueError."""
    from hf_gradfix.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as err:
        TokenWindow(*args, **kwargs)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("args, given", [((None, None, 2), "None"), ((None, 5, 2), "a int"),
                                         ((None, object(), 2), "a object")])
def test_a_dataloader_that_is_not_iterable_is_one_line(args, given):
    """Issue 50: TokenWindow(None, None, ...) built, then its loop ended in TypeError: 'NoneType' object is not
    iterable (from iter() inside the plugin). Now one line at construction naming the argument, its value, the fix;
    still a TypeError. Control: any iterable (a list, a generator) is taken."""
    from hf_gradfix.errors import InvalidTypeError

    with pytest.raises(InvalidTypeError) as err:
        TokenWindow(*args)
    message = str(err.value)
    assert isinstance(err.value, TypeError) and "\n" not in message
    assert message.startswith(f"TokenWindow: dataloader={given}: not an iterable of batches; pass the training "
                              "DataLoader"), message
    batch = {"labels": torch.tensor([[1, 2, 3]])}
    for iterable in ([batch], (b for b in [batch])):
        assert [len(list(w)) for w in TokenWindow(None, iterable, 2)] == [1]


def test_batches_that_are_not_dicts_and_a_dataloader_without_length_are_named():
    from hf_gradfix.errors import InvalidArgumentError

    from hf_gradfix.errors import UsageError

    with pytest.raises(UsageError, match="TokenWindow: the dataloader yielded no batch on any rank.*nothing to train on"):
        list(TokenWindow(None, [], 2))  # no batches: a mistake upstream, as packing an empty dataset is for a Trainer
    assert [len(list(w)) for w in TokenWindow(None, [{"labels": torch.tensor([[1, 2]])}], 2)] == [1]  # control: one window
    with pytest.raises(InvalidArgumentError, match="a batch of the dataloader is a int, not a dict"):
        list(TokenWindow(None, [1, 2], 2))
    with pytest.raises(TypeError, match="TokenWindow: len\\(\\) needs a dataloader with a length"):
        len(TokenWindow(None, iter([]), 2))


def test_float_labels_are_refused_for_token_targets_and_kept_for_elements():
    from hf_gradfix.errors import InvalidArgumentError

    batch = {"labels": torch.tensor([[1.5, 2.0, 0.25]])}
    with pytest.raises(InvalidArgumentError, match=r"labels are torch.float32 under count_rule='shifted'.*labels.long\(\)"):
        [list(w) for w in TokenWindow(None, [batch], 1)]
    windows = [list(w) for w in TokenWindow(None, [batch], 1, count_rule="elements")]  # regression: 3 float targets
    assert len(windows) == 1 and windows[0][0][1].window.num_items == 3
