"""Self-check of the ground-truth harness with the STOCK Trainer (no plugin).

Proves the harness is honest in both directions: it reports exactness where transformers is known to be exact, and it
detects the known bugs with their exact, model-independent signatures (research digest, sections 1.3 and 1.5).

* transformers 5.x: Llama GA4 is exact (rel_err <= 1e-5, logged loss <= 1e-6), DDP Llama is exact.
* transformers 4.57: the Trainer counts unshifted causal labels (fixed later by PR #46204), so the stock gradient is the
  GT scaled by N / (N + n_seq) exactly; the self-check asserts that exact scale instead.
* SeqCls head: pure xGA (norm_ratio 4.000, cosine 1) on both versions; x(GA*W) in DDP.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import transformers

import harness as h

GRAD_TOL = 1e-5
LOSS_TOL = 1e-6


@pytest.fixture
def stock_trainer():
    """Make sure trainers built in the test are stock, even if another test left ``hf_gradfix.patch()`` active."""
    gf = sys.modules.get("hf_gradfix")
    if gf is None or not gf.is_patched():
        yield
        return
    from hf_gradfix.integration import patching

    cfg = getattr(patching, "_config", None)
    gf.unpatch()
    try:
        yield
    finally:
        gf.patch(cfg)


def _assert_stock(trainer):
    assert not any("gradfix" in c.__name__.lower() for c in type(trainer).__mro__), type(trainer).__mro__
    assert not any("gradfix" in type(cb).__name__.lower() for cb in trainer.callback_handler.callbacks)


def _stock_causal_scale(window: list[dict]) -> float:
    """Scale of the stock gradient vs GT for a causal LM, measured: N (the targets the ground truth counts) over the
    count stock's Trainer passes as ``num_items_in_batch`` for the same micro-batches. 1 on 5.x; N/(N + n_seq) on
    4.57, which counted unshifted labels; whatever a future release does, the test follows the measurement."""
    trainer = h.make_trainer(h.build_model("llama"), window, "causal")
    collate = h.RecordingCollator("causal", h.PAD_ID).collate
    batches = [collate([s]) for s in window]
    _, counted = trainer.get_batch_samples(iter(batches), len(batches), torch.device("cpu"))
    n = sum(h.sample_loss_count(s, "causal") for s in window)
    return n / float(counted)


def _window(samples, step):
    by_idx = {s["idx"]: s for s in samples}
    return [by_idx[i] for b in step["idx_batches"] for i in b]


# ----------------------------------------------------------------------------------------------------------------------
# building blocks: every arch builds, is deterministic, and the GT rule equals the model's own loss on one sample
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(h.TASKS))
def test_gt_rule_matches_model_loss_and_padding_is_neutral(arch):
    try:
        model = h.build_model(arch)
    except RuntimeError as e:  # arch not buildable tiny on this transformers version
        pytest.skip(str(e))
    task = h.task_of(arch)
    assert h.check_deterministic(model, task) == 0.0
    samples = h.make_samples(task, n=3, seed=1)
    with torch.no_grad():
        # GT rule on one unpadded sample == the model's own loss (mean over its targets)
        for s in samples:
            ce, count = h.sample_loss_sum(model, s, task)
            ids = torch.tensor([s["input_ids"]])
            labels = torch.tensor([s["labels"]])
            own = model(input_ids=ids, labels=labels).loss
            assert abs(float(ce) / count - float(own)) <= 1e-5 * abs(float(own)), arch
        # right padding + attention mask leaves every real position's logits unchanged
        batch = h.RecordingCollator(task, h.pad_id_of(model)).collate(samples)
        kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        if task == "seq2seq":
            kw["decoder_input_ids"] = h._decoder_input_ids(model, batch["labels"])
        padded = model(**kw).logits
        for i, s in enumerate(samples):
            single = h._logits(model, s, task)[0]
            got = padded[i] if task == "seqcls" else padded[i, : single.shape[0]]
            assert (got - single).abs().max() <= 1e-5, arch


def test_samples_and_collator():
    for task in ("causal", "seqcls", "tokcls", "mlm", "seq2seq"):
        s = h.make_samples(task, prompt_mask_frac=0.6 if task == "causal" else 0.0)
        lens = sorted(len(x["input_ids"]) for x in s)
        assert [x["idx"] for x in s] == list(range(12)) and lens[0] == 3 and lens[-1] == 41
        assert all(h.sample_loss_count(x, task) >= 1 for x in s)
        assert all(min(x["input_ids"]) >= h.MASK_ID for x in s)
        col = h.RecordingCollator(task, pad_id=0)
        b = col(s[:3])
        assert col.batches == [[0, 1, 2]] and "idx" not in b
        assert b["input_ids"].shape == b["attention_mask"].shape
        assert int(b["attention_mask"].sum()) == sum(len(x["input_ids"]) for x in s[:3])
        if task == "seqcls":
            assert b["labels"].shape == (3,)
        elif task != "seq2seq":
            assert b["labels"].shape == b["input_ids"].shape
    ranked = h.arrange_for_ranks(h.make_samples("causal"), world_size=2)
    short = [len(x["input_ids"]) for x in ranked[0::2]]
    long = [len(x["input_ids"]) for x in ranked[1::2]]
    assert max(short) < min(long)


# ----------------------------------------------------------------------------------------------------------------------
# (a) Llama bs1 GA4, stock Trainer: exact on 5.x
# ----------------------------------------------------------------------------------------------------------------------


def test_a_llama_ga4_stock_exact(tmp_path, stock_trainer):
    t0 = time.time()
    model = h.build_model("llama")
    samples = h.make_samples("causal")
    rec = h.run_trainer(model, samples, "causal", gradient_accumulation_steps=4, output_dir=tmp_path)
    _assert_stock(rec.trainer)
    assert [st["idx_batches"] for st in rec.steps] == [[[0], [1], [2], [3]], [[4], [5], [6], [7]],
                                                       [[8], [9], [10], [11]]]
    assert len(rec.logged_losses) == 3
    rows = h.compare_steps(model, samples, "causal", rec.steps, rec.logged_losses, initial_state=rec.initial_state,
                           logged_loss_decimals=rec.logged_loss_decimals)
    scaled = []
    for row, step in zip(rows, rec.steps):
        scale = _stock_causal_scale(_window(samples, step))
        if abs(scale - 1.0) <= 1e-12:
            assert row["rel_err"] <= GRAD_TOL, row
            assert row["loss_rel_err"] <= LOSS_TOL, row
        else:  # 4.x: exact up to the documented count scale
            _, gt = h.ground_truth(model, _window(samples, step), "causal")
            scaled.append(h.rel_err(step["grads"], {k: v * scale for k, v in gt.items()}))
            assert scaled[-1] <= GRAD_TOL, row
            assert abs(row["trainer_loss"] - scale * row["gt_loss"]) <= LOSS_TOL * row["gt_loss"], row
    # the API wrapper gives the same numbers
    pairs = h.check_against_gt(model, samples, "causal", rec)
    assert [p[0] for p in pairs] == pytest.approx([r["rel_err"] for r in rows], rel=1e-6)
    print(f"\n(a) llama GA4 {transformers.__version__}: " + ", ".join(
        f"rel {r['rel_err']:.2e} norm {r['norm_ratio']:.6f} loss {r['loss_rel_err']:.1e}" for r in rows)
        + (f"; vs GT x N/(N+n_seq): rel {', '.join(f'{x:.2e}' for x in scaled)}" if scaled else "")
        + f" [{time.time() - t0:.1f}s]")


# ----------------------------------------------------------------------------------------------------------------------
# (b) detection: SeqCls head is xGA (norm 4.000); a no-kwargs wrapper gets the classic bug
# ----------------------------------------------------------------------------------------------------------------------


def test_b_llama_seqcls_ga4_stock_detected(tmp_path, stock_trainer):
    model = h.build_model("llama_seqcls")
    samples = h.make_samples("seqcls")
    rec = h.run_trainer(model, samples, "seqcls", gradient_accumulation_steps=4, output_dir=tmp_path)
    _assert_stock(rec.trainer)
    rows = h.compare_steps(model, samples, "seqcls", rec.steps, rec.logged_losses, initial_state=rec.initial_state,
                           logged_loss_decimals=rec.logged_loss_decimals)
    assert len(rows) == 3
    if h.loss_honours_num_items(model, samples[:2], "seqcls"):  # a release that fixed the head: stock exact
        assert all(r["rel_err"] <= GRAD_TOL for r in rows), rows
        return
    for r in rows:  # the head's loss ignores the count: each micro-batch mean summed, x GA
        assert r["norm_ratio"] == pytest.approx(4.0, abs=1e-4), r
        assert r["cosine"] == pytest.approx(1.0, abs=1e-6), r
        assert r["rel_err"] == pytest.approx(3.0, abs=1e-4), r
        assert r["trainer_loss"] == pytest.approx(4.0 * r["gt_loss"], rel=1e-5), r
    print("\n(b) llama_seqcls GA4: norm " + ", ".join(f"{r['norm_ratio']:.6f}" for r in rows))


def test_b2_nokwargs_classic_bug_detected(tmp_path, stock_trainer):
    model = h.build_model("nokwargs")
    samples = h.make_samples("causal")
    rec = h.run_trainer(model, samples, "causal", gradient_accumulation_steps=4, output_dir=tmp_path)
    rows = h.compare_steps(model, samples, "causal", rec.steps, initial_state=rec.initial_state)
    assert all(r["rel_err"] > 0.1 for r in rows), rows
    print("\n(b2) nokwargs GA4: rel " + ", ".join(f"{r['rel_err']:.3f}" for r in rows))


# ----------------------------------------------------------------------------------------------------------------------
# (c) DDP, 2 processes, gloo: stock Llama exact (5.x), ranks with very different token counts
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_c_ddp_llama_stock_exact(stock_trainer):
    t0 = time.time()
    res = h.run_ddp("llama", nproc=2, patch=False)
    wall = time.time() - t0
    assert res["meta"]["args"]["patch"] is False
    samples = res["samples"]
    assert len(res["steps"]) == 3 and len(res["logged_losses"]) == 3
    by_idx = {s["idx"]: s for s in samples}
    seen = []
    for st in res["steps"]:
        assert st["rank_grad_max_diff"] == 0.0  # all-reduced gradients identical on both ranks
        counts = [sum(h.sample_loss_count(by_idx[i], "causal") for b in pr for i in b) for pr in st["idx_batches_per_rank"]]
        assert counts[1] >= 2 * counts[0], counts  # very different token counts per rank
        seen += [i for b in st["idx_batches"] for i in b]
    assert sorted(seen) == list(range(12))
    rows = h.check_ddp_against_gt(res)
    for r, st in zip(rows, res["steps"]):
        scale = _stock_causal_scale(_window(samples, st))
        assert r["norm_ratio"] == pytest.approx(scale, rel=GRAD_TOL), r
        if abs(scale - 1.0) <= 1e-12:
            assert r["rel_err"] <= GRAD_TOL, r
            assert r["loss_rel_err"] <= LOSS_TOL, r
        else:
            assert r["cosine"] == pytest.approx(1.0, abs=1e-9), r
    print(f"\n(c) DDP llama {transformers.__version__}: " + ", ".join(
        f"rel {r['rel_err']:.2e} norm {r['norm_ratio']:.6f} loss {r['loss_rel_err']:.1e}" for r in rows)
        + f" [{wall:.1f}s]")


_SIGNAL_PROBE = """
import os, pathlib, sys
tries = pathlib.Path(sys.argv[1]) / ("tries_" + sys.argv[2])
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
if sys.argv[2] == "abort" and n == 1:
    os.abort()  # what gloo's "terminate called without an active exception" does to a rank
if sys.argv[2] == "raise":
    raise ValueError("a wrong number")
"""


@pytest.mark.distributed
def test_a_launch_is_relaunched_once_for_a_rank_killed_by_a_signal_never_for_an_exception(tmp_path):
    """multiproc.run_launch, which every multi-process test launches through: a rank dying by SIGABRT is relaunched
    once, on a fresh port, with a warning; a Python exception in a rank is a verdict and fails at once (control)."""
    from multiproc import run_launch, torchrun, worker_env

    script = tmp_path / "probe.py"
    script.write_text(_SIGNAL_PROBE)

    def launch(mode):
        return run_launch(torchrun(script, tmp_path, mode, nproc=1), env=worker_env(), step="signal probe launch, 1 rank")

    with pytest.warns(UserWarning, match=r"probe.py: rank 0 died by signal 6; relaunched once"):
        assert launch("abort").returncode == 0
    assert (tmp_path / "tries_abort").read_text() == "2"
    assert launch("raise").returncode != 0
    assert (tmp_path / "tries_raise").read_text() == "1"
