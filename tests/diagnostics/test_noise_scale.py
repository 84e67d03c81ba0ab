"""Gradient noise scale: the estimator against an analytic B_simple, the hooks against explicit micro-batch
gradients in a Trainer run, the logs, the plot.

Synthetic problem (linear regression, squared loss 0.5 (x.w - y)^2, y = x.w* + eps, x ~ N(0, I_d), eps ~ N(0, s^2)),
at fixed weights w with u = w - w*: the per-example gradient is g = x (x.u - eps), so

    E[g] = E[x x^T] u = u                                   -> |G|^2 = |u|^2
    E|g|^2 = E[|x|^2 (x.u)^2] + s^2 E|x|^2 = (d + 2)|u|^2 + d s^2
             (rotate u onto e1: E[x1^4] + (d - 1) E[x1^2] E[xj^2] = 3 + d - 1; the cross term has E[eps] = 0)
    tr(Sigma) = E|g|^2 - |E g|^2 = (d + 1)|u|^2 + d s^2
    B_simple = tr(Sigma) / |G|^2 = d + 1 + d s^2 / |u|^2

(checked by Monte Carlo below). The unit of batch size is one example (one loss target).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import types

import pytest
import torch

import harness as H
from multiproc import run_launch, torchrun, worker_env
import hf_gradfix
from hf_gradfix.diagnostics import NoiseScaleEstimator, NoiseScaleMonitor, resolve_window

D, S = 50, 1.0


def _problem(seed: int, u_norm: float):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g, dtype=torch.float64)
    u *= u_norm / u.norm()
    analytic = D + 1 + D * S**2 / float(u.dot(u))
    return g, u, analytic


def _draw(g, u, n):
    """n examples: (x, residual x.u - eps), float64."""
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    return x, x @ u - S * torch.randn(n, generator=g, dtype=torch.float64)


def test_analytic_trace_sigma_by_monte_carlo():
    g, u, analytic = _problem(1, 0.5)
    x, r = _draw(g, u, 400_000)
    per_example = x * r[:, None]
    mean = per_example.mean(0)
    trace = float(per_example.square().sum(1).mean() - mean.square().sum())
    expected = (D + 1) * float(u.dot(u)) + D * S**2
    assert abs(trace / expected - 1) < 0.01, (trace, expected)
    assert float((mean - u).norm() / u.norm()) < 0.05
    assert abs(analytic - expected / float(u.dot(u))) < 1e-9


def test_estimator_matches_analytic_b_simple_with_genuine_gradients():
    """Pure estimator, fed per step with the mean |g_mb|^2 of K micro-batch mean gradients (B_small = n) and
    |mean of them|^2 (B_big = K n), at fixed w. B_big = 512 ~ 2 B_simple; over 10 seeds the EMA's error had sd 1.4 %
    (max 2.7 %), so the 10 % bound is ~7 sd away."""
    g, u, analytic = _problem(0, 0.5)  # B_simple = 251
    k, n, steps = 64, 8, 1500
    est = NoiseScaleEstimator(beta=0.99)
    for _ in range(steps):
        x = torch.randn(k, n, D, generator=g, dtype=torch.float64)
        r = x @ u - S * torch.randn(k, n, generator=g, dtype=torch.float64)
        grads = torch.einsum("knd,kn->kd", x, r) / n  # micro-batch mean gradients
        est.update(float(grads.square().sum(1).mean()), n, float(grads.mean(0).square().sum()), n * k)
    rel = est.b_simple / analytic - 1
    pooled = statistics.fmean(e.raw_trace_sigma for e in est.history) / statistics.fmean(e.raw_grad_sq for e in est.history)
    print(f"\nB_simple analytic {analytic:.1f}, EMA estimate {est.b_simple:.1f} ({rel:+.2%}), "
          f"ratio of mean raw estimates {pooled:.1f} ({pooled / analytic - 1:+.2%})")  # fmt: skip
    assert abs(rel) <= 0.10
    assert abs(pooled / analytic - 1) <= 0.03  # both raw estimates are unbiased: their means converge
    assert est.history[-1].b_small == n and est.history[-1].b_big == n * k


class _Linear(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x):
        return x @ self.w


@pytest.mark.parametrize("weighting", ["tokens", "mean"])
def test_monitor_in_a_hand_written_loop_matches_analytic(weighting):
    """NoiseScaleMonitor's hooks in a real backward loop, micro-batches of unequal sizes (B_small: their harmonic
    mean; B_big: the window), both loss conventions: the window mean (TokenWindow / hf_gradfix) and the mean of
    micro-batch means. 16 micro-batches of 8..38 examples (N = 368), B_simple = 153: over 12 seeds the error had
    sd 1.4 % (max 3.4 %)."""
    g, u, analytic = _problem(2, 0.7)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    model = _Linear(w_star + u)
    sizes = list(range(8, 40, 2))
    monitor = NoiseScaleMonitor(model, beta=0.99, weighting=weighting)
    steps = 800
    for _ in range(steps):
        total = sum(sizes)
        for n in sizes:
            x, r = _draw(g, u, n)
            y = x @ w_star + (x @ u - r)  # labels: x.w* + eps
            per_example = 0.5 * (model(x) - y).square()
            loss = per_example.sum() / total if weighting == "tokens" else per_example.mean() / len(sizes)
            loss.backward()
            monitor.micro_batch_done(n)
        monitor.step_done(total if weighting == "tokens" else None, sync=len(monitor.history) % 7 != 0)
        model.w.grad = None
    monitor.flush()
    monitor.remove()
    assert len(monitor.history) == steps
    last = monitor.history[-1]
    harmonic = len(sizes) / sum(1 / n for n in sizes)
    assert last.b_small == pytest.approx(harmonic)
    expected_big = sum(sizes) if weighting == "tokens" else len(sizes) ** 2 / sum(1 / n for n in sizes)
    assert last.b_big == pytest.approx(expected_big)
    rel = monitor.b_simple / analytic - 1
    print(f"\n{weighting}: B_simple analytic {analytic:.1f}, monitor {monitor.b_simple:.1f} ({rel:+.2%})")
    assert abs(rel) <= 0.10


def test_monitor_records_rescaled_micro_batch_norms_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    xs = [torch.randn(n, 7) for n in (2, 5, 3)]
    ys = [torch.randn(n, 3) for n in (2, 5, 3)]
    sizes = [x.numel() // 7 * 3 for x in xs]  # targets: 3 per example
    total = sum(sizes)
    explicit = []
    for x, y in zip(xs, ys):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # the micro-batch's own mean
        explicit.append(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    with NoiseScaleMonitor(model, record=True) as monitor:
        for x, y, n in zip(xs, ys, sizes):
            torch.nn.functional.mse_loss(model(x), y, reduction="sum").div(total).backward()
            monitor.micro_batch_done(n)
        est = monitor.step_done(total)
    big = sum(float(p.grad.double().square().sum()) for p in model.parameters())
    rec = monitor.records[0]
    assert rec["micro_sq"] == pytest.approx(explicit, rel=1e-6)
    assert rec["big_sq"] == pytest.approx(big, rel=1e-6)
    small = statistics.fmean(explicit)
    b_small = len(sizes) / sum(1 / n for n in sizes)
    g2 = (total * big - b_small * small) / (total - b_small)
    assert est.raw_grad_sq == pytest.approx(g2, rel=1e-6)
    # the hooks are gone after the with-block: a later backward is not seen
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    assert monitor._norms == []


def test_resolve_window_needs_two_micro_batches():
    assert resolve_window([1.0, 1.0, 0.125, 1, 8], 1.0, "tokens", world_size=1) is None
    with pytest.raises(ValueError):
        resolve_window([1.0, 1.0, 0.25, 2, 8], 1.0, "sum", world_size=1)
    # a loss divided by N = 20 while its own targets number 16: the big gradient is rescaled to the true mean
    small_sq, b_small, big_sq, b_big = resolve_window([0.5, 32.0, 0.25, 2, 16], 1.0, "tokens", world_size=1, window_size=20)
    assert (big_sq, b_big) == (pytest.approx((20 / 16) ** 2), 16) and small_sq == pytest.approx(20**2 * 0.5 / 2)


def test_estimator_skips_non_finite_steps_and_round_trips_state():
    est = NoiseScaleEstimator(beta=0.9)
    est.update(13.5, 8, 1.78125, 128)
    assert est.update(float("inf"), 8, 1.0, 128) is None and est.skipped == 1
    clone = NoiseScaleEstimator()
    clone.load_state_dict(est.state_dict())
    assert clone.update(13.5, 8, 1.78125, 128) == est.update(13.5, 8, 1.78125, 128)


# ----------------------------------------------------------------------------------------------------------------
# Trainer integration
# ----------------------------------------------------------------------------------------------------------------

GA, BS = 4, 2


def _explicit_micro_sq(model, samples, record, step_index):
    """|gradient of each micro-batch's own token mean|^2 at the recorded step, in plain PyTorch (the padded
    micro-batch exactly as the Trainer saw it, the model's own mean loss)."""
    by_idx = {s["idx"]: s for s in samples}
    model.load_state_dict(record.initial_state)
    out = []
    for idx in record.steps[step_index]["idx_batches"]:
        batch = record.collator.collate([by_idx[i] for i in idx])
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        out.append(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    model.zero_grad(set_to_none=True)
    return out


def _skewed(samples):
    """Tokens from 4 ids only: a learnable signal, so |G|^2 is well above 0 at random init (on uniform random tokens
    the true gradient is ~0, the smoothed |G|^2 can be negative and B_simple is then not logged)."""
    return [{**s, "input_ids": [4 + t % 4 for t in s["input_ids"]], "labels": [4 + t % 4 for t in s["input_ids"]]}
            for s in samples]  # fmt: skip


@pytest.fixture(scope="module")
def patched_run(tmp_path_factory):
    from hf_gradfix import GradientNoiseScaleCallback

    has_mpl = importlib.util.find_spec("matplotlib") is not None
    plot = tmp_path_factory.mktemp("gns") / "plots" / "b_simple.png" if has_mpl else None
    model = H.build_model("llama")
    samples = _skewed(H.make_samples("causal", n=24, seed=0))
    cb = GradientNoiseScaleCallback(beta=0.9, record=True, plot_path=plot)
    hf_gradfix.patch({"log_fixes": False})
    try:
        record = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA, callbacks=[cb])
    finally:
        hf_gradfix.unpatch()
    return model, samples, record, cb, plot


def test_trainer_hooks_equal_explicit_micro_batch_gradients(patched_run):
    model, samples, record, cb, _ = patched_run
    assert len(record.steps) == 3 and len(cb.monitor.records) == 3
    state = hf_gradfix.state_of(record.trainer)
    assert state is not None and state.fixes  # the plugin was in force
    for k, rec in enumerate(cb.monitor.records):
        explicit = _explicit_micro_sq(model, samples, record, k)
        assert len(rec["micro_sq"]) == GA
        for got, want in zip(rec["micro_sq"], explicit):
            assert abs(got / want - 1) <= 1e-6, (k, got, want)
        big = sum(float(gr.double().square().sum()) for gr in record.steps[k]["grads"].values())
        assert abs(rec["big_sq"] / big - 1) <= 1e-6
        by_idx = {s["idx"]: s for s in samples}
        sizes = [sum(H.sample_loss_count(by_idx[i], "causal") for i in b) for b in record.steps[k]["idx_batches"]]
        assert rec["micro_sizes"] == sizes and rec["window_size"] == sum(sizes)  # N = the plugin's window count
        est = cb.history[k]
        assert est.b_big == sum(sizes)
        assert est.b_small == pytest.approx(GA / sum(1 / n for n in sizes))


def test_trainer_logs_gns_keys(patched_run):
    _, _, record, cb, _ = patched_run
    logs = [h for h in record.trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h, est in zip(logs, cb.history):
        assert h["step"] == est.step
        assert h["gns/grad_sq"] == est.grad_sq and h["gns/trace_sigma"] == est.trace_sigma
        assert h["gns/batch_size"] == est.b_big
        if est.grad_sq > 0:
            assert h["gns/b_simple"] == est.b_simple
    assert all("gns/b_simple" in h for h in logs)
    # nothing left on the trainer after training: wrappers and hooks removed
    assert not {"get_batch_samples", "log", "_get_grad_norm"} & set(record.trainer.__dict__)
    assert not cb.monitor.attached


def test_png_is_written(patched_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, _, cb, plot = patched_run
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 2000
    again = cb.plot(tmp_path / "again.png")
    assert open(again, "rb").read(4) == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_install(patched_run, tmp_path, monkeypatch):
    _, _, _, cb, _ = patched_run
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        cb.plot(tmp_path / "x.png")
    from hf_gradfix import GradientNoiseScaleCallback

    with pytest.raises(ImportError, match="pip install matplotlib"):  # asked for a plot: refused before training
        GradientNoiseScaleCallback(plot_path=tmp_path / "y.png")


@pytest.mark.parametrize("arch, weighting", [("llama", "tokens"), ("nokwargs", "mean")])
def test_stock_trainer_scaling(arch, weighting):
    """Without the plugin the callback mirrors transformers: a window mean over num_items_in_batch for a causal LM
    that takes it, a mean of micro-batch means (loss / GA) for a model whose forward takes no loss kwargs."""
    from hf_gradfix import GradientNoiseScaleCallback

    model = H.build_model(arch)
    samples = H.make_samples("causal", n=16, seed=1)
    cb = GradientNoiseScaleCallback(record=True, every=2)
    record = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA, callbacks=[cb])
    assert hf_gradfix.state_of(record.trainer) is None
    assert [r["step"] for r in cb.monitor.records] == [1]  # every=2: step 1 of 1..2 (the Trainer's step numbers)
    rec = cb.monitor.records[0]
    assert rec["weighting"] == weighting
    explicit = _explicit_micro_sq(model, samples, record, 0)
    assert rec["micro_sq"] == pytest.approx(explicit, rel=1e-6)
    logs = [h for h in record.trainer.state.log_history if "loss" in h]
    assert "gns/grad_sq" in logs[0] and "gns/grad_sq" in logs[1]  # step 1 is not measured: the last estimate again


def test_refuses_sharded_backends():
    from hf_gradfix.integration.diagnostics.gns import GradientNoiseScaleError, _check_setup

    class _Acc:
        distributed_type = "FSDP"
        num_processes = 2

    class _Tr:
        accelerator = _Acc()

    with pytest.raises(GradientNoiseScaleError, match="DDP only"):
        _check_setup(_Tr())


def test_clipping_reads_the_pre_clip_norm():
    """With clipping on, the big batch is the gradient before clipping (the norm the Trainer logs as grad_norm)."""
    from hf_gradfix import GradientNoiseScaleCallback

    model = H.build_model("llama")
    samples = _skewed(H.make_samples("causal", n=16, seed=3))
    cb = GradientNoiseScaleCallback(record=True)
    hf_gradfix.patch({"log_fixes": False})
    try:
        record = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                               callbacks=[cb], extra_args={"max_grad_norm": 1e-3})  # fmt: skip
    finally:
        hf_gradfix.unpatch()
    logged = [h["grad_norm"] for h in record.trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == len(cb.monitor.records) == 2
    for rec, norm, step in zip(cb.monitor.records, logged, record.steps):
        clipped = sum(float(g.double().square().sum()) for g in step["grads"].values()) ** 0.5
        assert clipped == pytest.approx(1e-3, rel=1e-3) and norm > 0.1  # clipping really happened
        assert rec["big_sq"] == pytest.approx(float(norm) ** 2, rel=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# DDP (2 processes, gloo): this module is also the worker
# ----------------------------------------------------------------------------------------------------------------

DDP_GA, DDP_BS = 2, 2


@pytest.mark.distributed
def test_ddp_small_batches_are_local_and_big_batch_global(tmp_path):
    """Under DDP the hooks see each rank's own micro-batch gradient (not the all-reduced one), the big batch is the
    global window, and every rank ends with the same estimates: equal to a single-process estimator fed with
    explicitly computed micro-batch and window gradients."""
    proc = run_launch(torchrun(__file__, "--gns-ddp-worker", tmp_path), cwd=str(H.REPO_ROOT), env=worker_env(),
                      step="gns DDP worker launch")
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["history"] == ranks[1]["history"] and len(ranks[0]["history"]) >= 2
    model = H.build_model("llama")
    model.load_state_dict(ranks[0]["initial_state"])
    samples = ranks[0]["samples"]
    by_idx = {s["idx"]: s for s in samples}
    collator = H.RecordingCollator("causal", H.pad_id_of(model))
    est = NoiseScaleEstimator(beta=ranks[0]["beta"])

    def sq_grad(batch_samples, reduce_sum=False):
        model.zero_grad(set_to_none=True)
        if reduce_sum:  # the window's token mean, every sequence on its own
            total = sum(H.sample_loss_sum(model, s, "causal")[1] for s in batch_samples)
            sum(H.sample_loss_sum(model, s, "causal")[0] for s in batch_samples).div(total).backward()
        else:
            model(**collator.collate(batch_samples)).loss.backward()
        return sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)

    for k, history in enumerate(ranks[0]["history"]):
        micro, sizes, window = [], [], []
        for r in ranks:
            rec = r["records"][k]
            idx_batches = r["idx_batches"][k]
            explicit = [sq_grad([by_idx[i] for i in b]) for b in idx_batches]
            assert rec["micro_sq"] == pytest.approx(explicit, rel=1e-5), (k, r["rank"])  # local, un-reduced gradients
            micro += explicit
            sizes += rec["micro_sizes"]
            window += [by_idx[i] for b in idx_batches for i in b]
        assert len(set(sizes)) > 1  # unequal micro-batches
        big = sq_grad(window, reduce_sum=True)
        for r in ranks:
            assert r["records"][k]["big_sq"] == pytest.approx(big, rel=1e-5)  # the all-reduced window gradient
        b_small = len(sizes) / sum(1 / n for n in sizes)
        want = est.update(statistics.fmean(micro), b_small, big, sum(sizes), step=k)
        assert history["b_big"] == sum(sizes) and history["b_small"] == pytest.approx(b_small)
        for key in ("raw_grad_sq", "raw_trace_sigma", "grad_sq", "trace_sigma", "b_simple"):
            assert history[key] == pytest.approx(getattr(want, key), rel=1e-4), key


def _ddp_worker(out_dir: str) -> None:
    import os

    import transformers

    from hf_gradfix import GradientNoiseScaleCallback

    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    model = H.build_model("llama")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    samples = H.arrange_for_ranks(_skewed(H.make_samples("causal", n=16, seed=4)), world_size=2, batch_size=DDP_BS)
    cb = GradientNoiseScaleCallback(beta=0.9, record=True)
    hf_gradfix.patch({"log_fixes": False})
    record = H.run_trainer(model, samples, per_device_train_batch_size=DDP_BS, gradient_accumulation_steps=DDP_GA,
                           callbacks=[cb])  # fmt: skip
    torch.save({"rank": rank, "beta": cb.beta, "history": [e.as_dict() for e in cb.history], "records": cb.monitor.records,
                "idx_batches": [s["idx_batches"] for s in record.steps], "samples": samples, "initial_state": initial},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    from multiproc import finish_distributed

    finish_distributed()


if __name__ == "__main__" and "--gns-ddp-worker" in sys.argv:
    _ddp_worker(sys.argv[sys.argv.index("--gns-ddp-worker") + 1])


def test_monitor_with_token_window_loop():
    """A hand-written TokenWindow loop: the monitor's rescaled micro-batch norms are the micro-batches' own mean
    gradients, the big batch is the window (N = window.num_items)."""
    window_mod = pytest.importorskip("hf_gradfix.loss.window")
    model = H.build_model("llama")
    samples = _skewed(H.make_samples("causal", n=16, seed=5))
    collator = H.RecordingCollator("causal")
    batches = [collator.collate(samples[i : i + 2]) for i in range(0, 16, 2)]
    tw = window_mod.TokenWindow(None, batches, grad_accum_steps=4)
    monitor = NoiseScaleMonitor(model, beta=0.9, world_size=tw.world_factor, record=True)
    for window in tw:
        for batch, micro in window:
            micro.loss_from_mean(model(**batch).loss).backward()
            monitor.micro_batch_done(micro.local_count)
        est = monitor.step_done(window.num_items)
        assert est is not None and est.b_big == window.num_items
        model.zero_grad(set_to_none=True)
    assert len(monitor.history) == 2 and all(e.b_simple > 0 for e in monitor.history)
    explicit = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        explicit.append(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    got = [x for rec in monitor.records for x in rec["micro_sq"]]
    assert got == pytest.approx(explicit, rel=1e-6)


def test_second_train_call_with_a_foreign_wrapper_counts_once():
    """train() twice on one trainer, with another tool wrapping get_batch_samples in between: the callback
    re-attaches, and every micro-batch is counted exactly once."""
    from hf_gradfix import GradientNoiseScaleCallback

    model = H.build_model("llama")
    samples = _skewed(H.make_samples("causal", n=16, seed=6))
    cb = GradientNoiseScaleCallback(record=True)
    record = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA, callbacks=[cb])
    trainer = record.trainer
    first = [(r["micro_sizes"], r["micro_sq"]) for r in cb.monitor.records]
    inner = trainer.get_batch_samples
    calls = []

    def foreign(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    trainer.get_batch_samples = foreign
    trainer.train()
    second = [(r["micro_sizes"], r["micro_sq"]) for r in cb.monitor.records[len(first):]]
    assert len(calls) == len(first) == len(second) == 2
    for (s1, q1), (s2, q2) in zip(first, second):
        assert s1 == s2 and q2 == pytest.approx(q1, rel=1e-6)  # lr = 0: same weights, same micro-batches
    assert len(cb.history) == 4 and not cb.monitor.attached
    assert trainer.get_batch_samples is foreign


# ----------------------------------------------------------------------------------------------------------------
# Lifecycle (issue 25): a second train(), a second Trainer on the same model, an exception in the middle of a run
# ----------------------------------------------------------------------------------------------------------------


def _hooks_on(model) -> int:
    """Tensor hooks registered on the model's parameters (``p.register_hook``)."""
    return sum(len(p._backward_hooks or {}) for p in model.parameters())


class _HookCounter:
    """A duck-typed TrainerCallback: the hooks on the model at every optimizer step."""

    def __init__(self, model):
        self.model, self.counts = model, []

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, *args, **kwargs):
        self.counts.append(_hooks_on(self.model))


def _check_own_micro_batches(model, samples, record, records, first_step=0):
    """Each recorded step's micro-batch norms are those of the micro-batches this run drew (plain PyTorch);
    ``first_step``: the run's first step in ``record.steps`` (a second train() appends to it)."""
    assert len(records) == len(record.steps) - first_step >= 2
    for k, rec in enumerate(records):
        want = _explicit_micro_sq(model, samples, record, first_step + k)
        assert rec["micro_sizes"] == [sum(H.sample_loss_count(s, "causal") for s in samples if s["idx"] in b)
                                      for b in record.steps[first_step + k]["idx_batches"]]
        assert rec["micro_sq"] == pytest.approx(want, rel=1e-6), k


def test_second_train_and_second_trainer_leave_no_hooks():
    """The same callback for two train() calls, then a second Trainer with its own callback on the same model, then
    the first callback in a third Trainer: one set of hooks while a run trains, none after it; each run's records are
    its own micro-batches (nothing counted twice, nothing carried over)."""
    from hf_gradfix import GradientNoiseScaleCallback

    model = H.build_model("llama")
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    samples = _skewed(H.make_samples("causal", n=16, seed=7))
    other = _skewed(H.make_samples("causal", n=16, seed=8))
    cb = GradientNoiseScaleCallback(record=True)
    counter = _HookCounter(model)
    record = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                           callbacks=[cb, counter])  # fmt: skip
    assert _hooks_on(model) == 0 and counter.counts == [n_params] * 2
    _check_own_micro_batches(model, samples, record, cb.monitor.records)
    record.trainer.train()
    assert _hooks_on(model) == 0 and counter.counts == [n_params] * 4
    _check_own_micro_batches(model, samples, record, cb.monitor.records[2:], first_step=2)
    cb2 = GradientNoiseScaleCallback(record=True)
    record2 = H.run_trainer(model, other, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                            callbacks=[cb2, counter])  # fmt: skip
    assert _hooks_on(model) == 0 and counter.counts == [n_params] * 6
    _check_own_micro_batches(model, other, record2, cb2.monitor.records)
    assert len(cb.monitor.records) == 4 and not cb.monitor._norms  # the first callback saw nothing of it
    record3 = H.run_trainer(model, other, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                            callbacks=[cb, counter])  # fmt: skip
    assert _hooks_on(model) == 0 and counter.counts == [n_params] * 8
    _check_own_micro_batches(model, other, record3, cb.monitor.records)  # a new trainer: a new monitor


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "callback", "optimizer"])
def test_exception_mid_run_removes_the_hooks(where):
    """An exception in the middle of window 1 (inside the model's forward, or in another callback after a
    micro-batch): the hooks are off the model at once, the trainer's methods are its own again, and train() again
    (and a second Trainer) measure only their own micro-batches. An exception the callback cannot see (in the
    optimizer's step: the Trainer has no event for it) leaves the hooks until the next run on the model starts, which
    takes them off (one set of hooks while it trains)."""
    from transformers import TrainerCallback

    from hf_gradfix import GradientNoiseScaleCallback

    model = H.build_model("llama")
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    samples = _skewed(H.make_samples("causal", n=16, seed=9))
    calls = {"forward": 0, "substep": 0, "step": 0}

    def fail_in_forward(module, args):
        calls["forward"] += 1
        if where == "forward" and calls["forward"] == 6:
            raise _Boom("forward failed")

    class FailInCallback(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            calls["substep"] += 1
            if where == "callback" and calls["substep"] == 5:
                raise _Boom("a callback failed")

    def fail_in_optimizer(trainer):
        trainers.append(trainer)
        create = trainer.create_optimizer

        def create_optimizer(*args, **kwargs):
            optimizer = create(*args, **kwargs)
            step = optimizer.step

            def failing_step(self, *args, **kwargs):
                calls["step"] += 1
                if where == "optimizer" and calls["step"] == 2:
                    raise _Boom("the optimizer failed")
                return step(*args, **kwargs)

            optimizer.step = types.MethodType(failing_step, optimizer)  # the lr scheduler wants a bound method
            return optimizer

        trainer.create_optimizer = create_optimizer

    handle = model.register_forward_pre_hook(fail_in_forward)
    cb = GradientNoiseScaleCallback(record=True)
    counter = _HookCounter(model)
    trainers = []
    with pytest.raises(_Boom):
        H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                      callbacks=[cb, FailInCallback(), counter], before_train=fail_in_optimizer)  # fmt: skip
    handle.remove()
    trainer = trainers[0]
    calls["forward"] = calls["substep"] = calls["step"] = 10**6  # no more failures
    model.zero_grad(set_to_none=True)  # the broken window's partial gradient is the user's to drop
    if where == "optimizer":
        assert _hooks_on(model) == n_params and len(cb.history) == 1
        cb2 = GradientNoiseScaleCallback(record=True)
        record2 = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                                callbacks=[cb2, counter])  # fmt: skip
        assert _hooks_on(model) == 0 and counter.counts == [n_params] * 3 and not cb.monitor.attached
        _check_own_micro_batches(model, samples, record2, cb2.monitor.records)
        return
    assert _hooks_on(model) == 0
    assert not {"get_batch_samples", "log", "_get_grad_norm", "training_step"} & set(trainer.__dict__)
    assert len(cb.history) == 1 and counter.counts == [n_params]  # window 0 was measured, window 1 broke off
    recorder = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "_consumed_at_last_step"))
    recorder.steps.clear()  # the harness's bookkeeping starts again (the broken window left it misaligned)
    recorder._consumed_at_last_step = trainer._hgf_consumed = 0
    trainer.data_collator.batches.clear()
    trainer.train()
    assert _hooks_on(model) == 0 and counter.counts == [n_params] * 3
    record = H.RunRecord(steps=recorder.steps, logged_losses=[], trainer=trainer, task="causal",
                         initial_state={k: v.clone() for k, v in model.state_dict().items()},  # lr 0
                         collator=trainer.data_collator)  # fmt: skip
    _check_own_micro_batches(model, samples, record, cb.monitor.records[1:])
    cb2 = GradientNoiseScaleCallback(record=True)
    record2 = H.run_trainer(model, samples, per_device_train_batch_size=BS, gradient_accumulation_steps=GA,
                            callbacks=[cb2])  # fmt: skip
    assert _hooks_on(model) == 0
    _check_own_micro_batches(model, samples, record2, cb2.monitor.records)
