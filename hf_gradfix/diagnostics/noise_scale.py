"""Gradient noise scale B_simple = tr(Sigma) / |G|^2, measured during training (torch only).

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A. ``G`` is the true gradient,
``Sigma`` the covariance of the per-unit gradient (one unit: one loss target, see below), ``G_B`` the mean
gradient over ``B`` independent units. Then ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, and from two batch sizes
``B_small < B_big`` measured at the same weights::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)        (unbiased)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)              (unbiased)
    B_simple  = EMA(tr(Sigma)) / EMA(|G|^2)             (each smoothed separately, bias-corrected EMAs)

The ratio of the two smoothed estimates, not a smoothed ratio: the per-step ratio is biased and heavy-tailed.

Where the two batches come from (no gradient copies): one optimizer step accumulates the gradients of ``K``
micro-batches (on each of ``W`` data-parallel ranks). The *small* batches are the micro-batches: a tensor hook on
every parameter (``p.register_hook``, called with the micro-batch's contribution before it is added to ``.grad``)
adds that tensor's norm to a scalar list; nothing of parameter size is kept. The *big* batch is the accumulated
(and, under DDP, all-reduced) gradient before clipping, whose norm training loops compute anyway.

Unit of batch size: one **loss target**, i.e. whatever the loss averages over: tokens for (causal or masked) LMs
(labels that are not -100, counted the way the loss counts them), examples for sequence classification. B_simple,
``B_small`` and ``B_big`` are all in that unit. Tokens of one sequence are correlated, so in tokens B_simple is an
*effective* scale: compare it with the global batch in tokens, not in sequences.

Scale of a micro-batch gradient. The hook sees ``h``, the gradient of the loss the micro-batch back-propagated,
while the estimator needs ``g``, the gradient of the micro-batch's own mean over its ``n`` targets. Two
conventions are supported (``weighting``):

``"tokens"``  each micro-batch back-propagates ``S_mb * W / N`` (``S_mb``: its summed loss, ``N``: targets in the
              whole window on all ranks): hf_gradfix, TokenWindow loops, transformers with ``num_items_in_batch``.
              ``g = h * N / (W n)``; the big batch is the window's target mean, ``B_big = N``.
``"mean"``    each micro-batch back-propagates its own mean divided by ``K`` (classic gradient accumulation, a mean
              of micro-batch means). ``g = h * K``; ``B_big = (W K)^2 / sum(1 / n)`` (= W K n for equal sizes).

With unequal micro-batches ``E mean_k |g_k|^2 = |G|^2 + tr(Sigma) mean_k(1/n_k)``, so ``B_small`` is the harmonic
mean of the micro-batch sizes, and the big batch's effective size is ``1 / sum_k(w_k^2 / n_k)`` with ``w_k`` the
weight of micro-batch k in the big gradient (both formulas above are that expression).

Under DDP the hook sees the local, un-reduced micro-batch gradient, the accumulated gradient is the all-reduced
one: the five per-step sums of :func:`window_stats_fields` are summed over ranks with one all-reduce (per flush,
not per micro-batch), so ``B_small`` is a local micro-batch and ``B_big`` the global window. FSDP / tensor
parallel shard the gradients (the hook would see shards): not supported here.

>>> est = NoiseScaleEstimator(beta=0.0)            # no smoothing: the last step's estimates
>>> e = est.update(small_sq=1 + 100 / 8, b_small=8, big_sq=1 + 100 / 128, b_big=128)   # exact expectations
>>> round(e.grad_sq, 6), round(e.trace_sigma, 6), round(e.b_simple, 6)
(1.0, 100.0, 100.0)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import InvalidArgumentError, UsageError

__all__ = [
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "NoiseScaleMonitor",
    "WEIGHTINGS",
    "plot_noise_scale",
    "resolve_window",
    "unbiased_estimates",
    "window_stats_fields",
]

WEIGHTINGS = ("tokens", "mean")


def unbiased_estimates(small_sq: float, b_small: float, big_sq: float, b_big: float) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(Sigma))`` from the squared norms of a small-batch and a big-batch mean gradient.

    >>> unbiased_estimates(small_sq=3.0, b_small=1, big_sq=1.5, b_big=4)   # |G|^2 = 1, tr(Sigma) = 2
    (1.0, 2.0)
    """
    if not (b_big > b_small > 0):
        raise InvalidArgumentError(f"need 0 < B_small < B_big, got B_small={b_small}, B_big={b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace_sigma = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace_sigma


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """One measured optimizer step.

    ``grad_sq`` / ``trace_sigma``: bias-corrected EMAs of the unbiased per-step estimates (``raw_*``);
    ``b_simple`` = ``trace_sigma / grad_sq`` (NaN while the smoothed ``|G|^2`` is not positive, e.g. very early,
    when the noise dominates); ``b_small`` / ``b_big``: the batch sizes of this step (in loss targets).
    """

    step: int
    b_simple: float
    grad_sq: float
    trace_sigma: float
    raw_grad_sq: float
    raw_trace_sigma: float
    b_small: float
    b_big: float

    def as_dict(self) -> dict:
        return asdict(self)


class NoiseScaleEstimator:
    """Per-step unbiased estimates of ``|G|^2`` and ``tr(Sigma)``, their bias-corrected EMAs and ``B_simple``.

    Feed :meth:`update` once per measured optimizer step with the mean squared norm of the small-batch (micro-batch)
    mean gradients and the squared norm of the big-batch mean gradient, each with its batch size in one unit
    (loss targets; see the module docstring). ``beta`` is the EMA decay per *measured* step (gpt-neox: 0.99).

    >>> est = NoiseScaleEstimator(beta=0.5)
    >>> _ = est.update(small_sq=11.0, b_small=4, big_sq=2.0, b_big=40)   # raw |G|^2 = 1, tr(Sigma) = 40
    >>> _ = est.update(small_sq=21.0, b_small=4, big_sq=3.0, b_big=40)   # raw |G|^2 = 1, tr(Sigma) = 80
    >>> round(est.trace_sigma, 4), round(est.grad_sq, 4), round(est.b_simple, 4)   # (0.25*40 + 0.5*80) / 0.75
    (66.6667, 1.0, 66.6667)
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not 0.0 <= beta < 1.0:
            raise InvalidArgumentError(f"beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self.history: list[NoiseScaleEstimate] = []
        self._ema_g = 0.0
        self._ema_s = 0.0
        self._t = 0
        self.skipped = 0  # steps dropped because a value was not finite (e.g. an fp16 overflow step)

    # -- feeding ------------------------------------------------------------------------------------------------
    def update(self, small_sq: float, b_small: float, big_sq: float, b_big: float, step: int | None = None) -> NoiseScaleEstimate | None:
        """Add one step; returns its :class:`NoiseScaleEstimate` (None if a value was not finite: step skipped)."""
        values = (small_sq, b_small, big_sq, b_big)
        if not all(math.isfinite(float(v)) for v in values):
            self.skipped += 1
            return None
        g, s = unbiased_estimates(float(small_sq), float(b_small), float(big_sq), float(b_big))
        self._t += 1
        self._ema_g = self.beta * self._ema_g + (1.0 - self.beta) * g
        self._ema_s = self.beta * self._ema_s + (1.0 - self.beta) * s
        correction = 1.0 - self.beta**self._t
        g_hat, s_hat = self._ema_g / correction, self._ema_s / correction
        estimate = NoiseScaleEstimate(
            step=len(self.history) if step is None else int(step),
            b_simple=s_hat / g_hat if g_hat > 0 else float("nan"),
            grad_sq=g_hat,
            trace_sigma=s_hat,
            raw_grad_sq=g,
            raw_trace_sigma=s,
            b_small=float(b_small),
            b_big=float(b_big),
        )
        self.history.append(estimate)
        return estimate

    # -- reading ------------------------------------------------------------------------------------------------
    @property
    def last(self) -> NoiseScaleEstimate | None:
        return self.history[-1] if self.history else None

    @property
    def b_simple(self) -> float:
        """The current ``B_simple`` (NaN before the first step or while the smoothed ``|G|^2`` <= 0)."""
        return self.last.b_simple if self.history else float("nan")

    @property
    def grad_sq(self) -> float:
        return self.last.grad_sq if self.history else float("nan")

    @property
    def trace_sigma(self) -> float:
        return self.last.trace_sigma if self.history else float("nan")

    # -- checkpointing ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"beta": self.beta, "ema_g": self._ema_g, "ema_s": self._ema_s, "t": self._t, "skipped": self.skipped,
                "history": [e.as_dict() for e in self.history]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.beta = float(state["beta"])
        self._ema_g, self._ema_s, self._t = float(state["ema_g"]), float(state["ema_s"]), int(state["t"])
        self.skipped = int(state.get("skipped", 0))
        self.history = [NoiseScaleEstimate(**e) for e in state.get("history", [])]


# ----------------------------------------------------------------------------------------------------------------
# One window's micro-batch statistics -> (small_sq, B_small, B_big)
# ----------------------------------------------------------------------------------------------------------------


def window_stats_fields() -> tuple[str, ...]:
    """Names of the per-step sums (over micro-batches with ``n > 0``, then over ranks) that :func:`resolve_window` takes.

    ``h2`` is the squared norm of what one micro-batch added to the gradient (the hook's view), ``n`` its size.
    """
    return ("sum_h2_over_n2", "sum_h2", "sum_inv_n", "count", "sum_n")


def resolve_window(
    stats: Sequence[float], big_sq: float, weighting: str, world_size: int, window_size: float | None = None
) -> tuple[float, float, float, float] | None:
    """``(mean |g_k|^2, B_small, |G_big|^2, B_big)`` of one window, every gradient a mean over its own targets.

    ``stats``: the sums named by :func:`window_stats_fields`, already summed over ranks; ``big_sq``: the squared norm
    of the accumulated gradient; ``world_size``: ``W``, the replicas whose gradients are averaged; ``window_size``:
    the ``N`` the loss was divided by (``"tokens"`` only; default: the summed sizes). When ``N`` differs from the
    summed sizes (a loss normalized by a count that is not its own, e.g. stock transformers 4.x counting the first
    label of every row), the accumulated gradient is rescaled to the window's true mean: ``|G_big|^2 (N / sum n)^2``,
    ``B_big = sum n``. None when fewer than 2 micro-batches were measured in the window (all ranks together): with
    one micro-batch the small and the big batch are the same batch.

    >>> resolve_window([1.0, 64.0, 0.5, 4, 32], 2.0, "tokens", world_size=1)   # 4 micro-batches of 8 targets, h2 = 16
    (256.0, 8.0, 2.0, 32.0)
    >>> resolve_window([1.0, 64.0, 0.5, 4, 32], 2.0, "mean", world_size=1)     # the same h2 under a mean of means
    (256.0, 8.0, 2.0, 32.0)
    """
    sum_h2_n2, sum_h2, sum_inv_n, count, sum_n = (float(v) for v in stats)
    if count < 2 or sum_inv_n <= 0:
        return None
    w = float(world_size)
    b_small = count / sum_inv_n  # harmonic mean of the micro-batch sizes
    if weighting == "tokens":
        n_window = float(window_size) if window_size is not None else sum_n
        small_sq = (n_window / w) ** 2 * sum_h2_n2 / count  # g_k = h_k N / (W n_k)
        return small_sq, b_small, float(big_sq) * (n_window / sum_n) ** 2, sum_n
    if weighting == "mean":
        k = count / w  # micro-batches per rank
        # g_k = K h_k; the big gradient weighs every micro-batch 1 / (W K): 1 / sum(w_k^2 / n_k) = (W K)^2 / sum(1 / n_k)
        return k**2 * sum_h2 / count, b_small, float(big_sq), count**2 / sum_inv_n
    raise InvalidArgumentError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


# ----------------------------------------------------------------------------------------------------------------
# Hooks on a model: the monitor for any training loop
# ----------------------------------------------------------------------------------------------------------------


def _default_world(process_group) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


def _default_reduce(process_group) -> Callable[[torch.Tensor], torch.Tensor] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1):
        return None

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
        return tensor

    return reduce


def _norm(grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        grad = grad.coalesce()._values()
    # fp16 / bf16 gradients are accumulated in fp32 (the square of a large fp16 norm would overflow); fp32 and fp64 as is
    if grad.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    return torch.linalg.vector_norm(grad)


class NoiseScaleMonitor:
    """Measure the gradient noise scale in a hand-written loop (TokenWindow loops, accelerate loops, ...).

    With :class:`hf_gradfix.TokenWindow` (each micro-batch back-propagates its share of the global token mean)::

        tw = TokenWindow(accelerator, dataloader, grad_accum_steps=8)
        monitor = NoiseScaleMonitor(model, world_size=tw.world_factor, process_group=tw.group)  # hooks on every param
        for window in tw:                                                # one optimizer step
            for batch, micro in window:
                accelerator.backward(micro.loss_from_mean(model(**batch).loss))
                monitor.micro_batch_done(micro.local_count)              # after each backward
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # returns the pre-clip norm
            monitor.step_done(window.num_items, grad_norm=norm)          # (or before clipping, without grad_norm)
            optimizer.step(); optimizer.zero_grad()
        monitor.b_simple, monitor.history[-1], monitor.plot("gns.png")

    Any other loop: back-propagate ``loss_sum * W / N`` per micro-batch (``weighting="tokens"``, the default) or
    ``mean_loss / K`` (``weighting="mean"``), call ``micro_batch_done(targets)`` after each backward and
    ``step_done(N)`` once per optimizer step.

    ``micro_batch_done(size)`` closes the gradient contributions the hooks saw since the previous call (one
    micro-batch: ``size`` loss targets on this rank; a size of 0 is skipped). ``step_done(window_size, grad_norm)``
    closes the window: ``window_size`` is ``N`` of the loss (``"tokens"``; default: the sizes summed over ranks),
    ``grad_norm`` the pre-clip norm if you have it (``clip_grad_norm_`` returns it), else it is computed from ``.grad``.
    Under ``torch.distributed`` every rank must call ``step_done`` / :meth:`flush` at the same steps (one all-reduce
    of 5 numbers per step, or per flush with ``sync=False``). ``every``: measure one step in ``every`` (the hooks
    return at once on the others). ``record=True`` keeps each step's micro-batch norms (tests, debugging).
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.nn.Parameter],
        *,
        beta: float = 0.99,
        weighting: str = "tokens",
        world_size: int | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        process_group=None,
        every: int = 1,
        record: bool = False,
    ) -> None:
        if weighting not in WEIGHTINGS:
            raise InvalidArgumentError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if int(every) < 1:
            raise InvalidArgumentError(f"every must be >= 1, got {every}")
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise InvalidArgumentError("NoiseScaleMonitor: no trainable parameters")
        self.estimator = NoiseScaleEstimator(beta)
        self.weighting = weighting
        self.world_size = int(world_size) if world_size is not None else _default_world(process_group)
        self._reduce = reduce if reduce is not None else _default_reduce(process_group)
        self.every = int(every)
        self.record = record
        self.records: list[dict] = []
        self.measuring = True  # whether the current window is measured
        self._step = 0
        self._norms: list[torch.Tensor] = []
        self._micro: list[tuple[torch.Tensor, float]] = []
        self._pending: list[tuple[int, list[tuple[torch.Tensor, float]], torch.Tensor, float | None, str]] = []
        self._handles: list = []
        self.attach()

    # -- hooks --------------------------------------------------------------------------------------------------
    def _hook(self, grad: torch.Tensor) -> None:
        # Called with one backward's gradient for this parameter, before it is added to .grad (under DDP: the local
        # gradient, before the all-reduce). Only its norm is kept: a 0-d tensor, no host sync.
        if self.measuring:
            self._norms.append(_norm(grad.detach() if grad.requires_grad else grad))

    def attach(self) -> None:
        """Register the hooks (done by the constructor; again after :meth:`remove`)."""
        if not self._handles:
            self._handles = [p.register_hook(self._hook) for p in self.params]

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Remove the hooks (the estimates stay readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._norms = []

    def __enter__(self) -> NoiseScaleMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- loop API -----------------------------------------------------------------------------------------------
    def micro_batch_done(self, size: float) -> None:
        """Close one micro-batch of ``size`` loss targets (on this rank) after its backward."""
        norms, self._norms = self._norms, []
        if not self.measuring or float(size) <= 0:
            return
        if norms:
            h2 = torch.stack(norms).double().square().sum()
        else:  # the backward reached no trainable parameter
            h2 = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        self._micro.append((h2, float(size)))

    def discard_window(self) -> None:
        """Forget the micro-batches of an unfinished window (a loop that broke off mid-window)."""
        self._norms, self._micro = [], []

    def big_batch_sq_norm(self) -> torch.Tensor:
        """``|accumulated .grad|^2`` of the monitored parameters (float64 0-d tensor; no host sync)."""
        norms = [_norm(p.grad.detach()) for p in self.params if p.grad is not None]
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        return torch.stack(norms).double().square().sum()

    def step_done(
        self,
        window_size: float | None = None,
        grad_norm: float | torch.Tensor | None = None,
        *,
        weighting: str | None = None,
        sync: bool = True,
        step: int | None = None,
    ) -> NoiseScaleEstimate | None:
        """Close the window (call before clipping). Returns this step's estimate with ``sync=True`` (None if the
        step was not measured or could not be: fewer than 2 micro-batches). ``sync=False`` queues it for
        :meth:`flush` (no host sync, no collective now). ``step``: the label of this step in :attr:`history`
        (default: the monitor's own count of ``step_done`` calls, from 0)."""
        if self._norms:
            raise UsageError(
                "NoiseScaleMonitor: gradients of a backward were not closed; call micro_batch_done(size) after every "
                "backward of the window, before step_done()"
            )
        label, measured = (self._step if step is None else int(step)), self.measuring
        self._step += 1
        self.measuring = self._step % self.every == 0
        micro, self._micro = self._micro, []
        if not measured:
            return None
        if grad_norm is None:
            big_sq = self.big_batch_sq_norm()
        else:
            norm = grad_norm.detach() if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm))
            big_sq = norm.to(torch.float64).square()
        mode = weighting or self.weighting
        if mode not in WEIGHTINGS:
            raise InvalidArgumentError(f"weighting must be one of {WEIGHTINGS}, got {mode!r}")
        self._pending.append((label, micro, big_sq, None if window_size is None else float(window_size), mode))
        if sync:
            done = self.flush()
            return done[-1] if done and done[-1].step == label else None
        return None

    def flush(self) -> list[NoiseScaleEstimate]:
        """Process the queued steps: one all-reduce (when distributed) and one host sync for all of them."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        device = self.params[0].device
        rows = []
        for _, micro, _, _, _ in pending:
            if micro:
                h2 = torch.stack([m[0].to(device) for m in micro])
                n = torch.tensor([m[1] for m in micro], dtype=torch.float64, device=device)
                rows.append(torch.stack([(h2 / n.square()).sum(), h2.sum(), (1.0 / n).sum(),
                                         torch.tensor(float(len(micro)), dtype=torch.float64, device=device), n.sum()]))  # fmt: skip
            else:
                rows.append(torch.zeros(5, dtype=torch.float64, device=device))
        stats = torch.stack(rows)
        if self._reduce is not None:
            stats = self._reduce(stats)
        big = torch.stack([p[2].to(device) for p in pending])
        flat = torch.cat([stats.flatten(), big]).tolist()  # the one host sync
        stats_rows = [flat[5 * i : 5 * i + 5] for i in range(len(pending))]
        bigs = flat[5 * len(pending) :]
        out = []
        for (step, micro, _, window_size, mode), row, big_sq in zip(pending, stats_rows, bigs):
            resolved = resolve_window(row, big_sq, mode, self.world_size, window_size)
            if self.record:
                n_window = window_size if window_size is not None else row[4]
                self.records.append({
                    "step": step, "weighting": mode, "window_size": n_window, "big_sq": big_sq, "stats": row,
                    "micro_h2": [float(m[0]) for m in micro], "micro_sizes": [m[1] for m in micro],
                    "micro_sq": [_micro_sq(float(m[0]), m[1], mode, self.world_size, n_window, row[3]) for m in micro],
                })  # fmt: skip
            if resolved is None:
                continue
            small_sq, b_small, big_mean_sq, b_big = resolved
            estimate = self.estimator.update(small_sq, b_small, big_mean_sq, b_big, step=step)
            if estimate is not None:
                out.append(estimate)
        return out

    # -- reading ------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Steps queued by ``step_done(sync=False)`` and not flushed yet."""
        return len(self._pending)

    @property
    def history(self) -> list[NoiseScaleEstimate]:
        return self.estimator.history

    @property
    def b_simple(self) -> float:
        return self.estimator.b_simple

    def plot(self, path: str | os.PathLike, unit: str = "tokens") -> str:
        """Write a PNG of B_simple over the measured steps (needs matplotlib)."""
        return plot_noise_scale(self.history, path, unit=unit)


def _micro_sq(h2: float, n: float, mode: str, world: int, n_window: float, count: float) -> float:
    """Squared norm of one micro-batch's mean gradient from its hook-measured contribution."""
    if mode == "tokens":
        return h2 * (n_window / (world * n)) ** 2
    return h2 * (count / world) ** 2


# ----------------------------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------------------------


def plot_noise_scale(history: Sequence[NoiseScaleEstimate], path: str | os.PathLike, unit: str = "tokens") -> str:
    """Write a PNG of B_simple (smoothed) over training, with the global batch size for reference.

    Uses matplotlib's object API (no pyplot, no global backend change). Raises ImportError with an install hint
    when matplotlib is missing, ValueError when there is nothing to plot.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # optional dependency
        raise ImportError(
            "plotting the gradient noise scale needs matplotlib: `pip install matplotlib` "
            "(or `pip install 'hf-gradfix[demo]'`)"
        ) from err
    points = [e for e in history if math.isfinite(e.b_simple) and e.b_simple > 0]
    if not points:
        raise InvalidArgumentError("no B_simple estimate to plot yet (no measured step, or the smoothed |G|^2 is not positive)")
    steps = [e.step for e in points]
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, [e.b_simple for e in points], color="tab:blue", lw=1.8, label="B_simple (EMA tr(Sigma) / EMA |G|^2)")
    ax.plot(steps, [e.b_big for e in points], color="tab:gray", lw=1.0, ls="--", label=f"global batch ({unit})")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{unit}")
    last = points[-1]
    ax.set_title(f"Gradient noise scale: B_simple = {last.b_simple:,.0f} {unit} at step {last.step} "
                 f"(batch {last.b_big:,.0f})", fontsize=10)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, format="png")
    return path
