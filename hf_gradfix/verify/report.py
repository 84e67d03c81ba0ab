"""What ``hf-gradfix verify`` says: the hypotheses it can name, the verdict rule, a step's and a run's report
(:class:`StepResult`, :class:`VerifyReport`), the tolerance factor under mixed precision, the progress lines and the
plot of a report.

Apart from the computation (:mod:`hf_gradfix.verify.reference`) and from the code that drives a trainer
(:mod:`hf_gradfix.verify.trainer`), so that the policy-gradient reference (:mod:`hf_gradfix.verify.rl`) builds its
report with the same classes and rule without importing the trainer-driving code that calls it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Callable


def _progress(message: str, since: float | None = None, phase: bool = False) -> None:
    """A progress line on the plugin's log (stderr; rank 0 only unless HF_GRADFIX_ALL_RANKS=1), stamped with the
    seconds since verify started; ``phase``: the heartbeat repeats it while it runs (hf_gradfix.progress)."""
    from ..progress import report

    took = f" (took {time.perf_counter() - since:.1f} s)" if since is not None else ""
    report("verify", f"{message}{took}", phase=phase)


def _progress_session(fn: Callable) -> Callable:
    """Runs ``fn`` inside verify's progress session (the CLI's when it opened one): phase lines with the seconds since
    start, and a heartbeat line after 15 s of silence (hf_gradfix.progress)."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from ..progress import Progress

        with Progress("verify"):
            return fn(*args, **kwargs)

    return run


HYPOTHESES = {
    "exact": "exact: the global token mean over every micro-batch and rank",
    "mean_of_means": "token count: each micro-batch normalized by its own target count, the means averaged "
    "(not one count for the whole window)",
    "mean_of_means_summed": "token count and scaling by GA: per-micro-batch means summed over the window (a "
    "compute_loss override or compute_loss_func returning a micro-batch mean)",
    "ga_scaled": "scaling by GA: the loss is not divided by the gradient-accumulation steps",
    "world_scaled": "scaling by world size: the gradient is the data-parallel ranks' sum, not their mean",
    "ga_world_scaled": "scaling by GA and world size: the loss is multiplied by both",
    "rank_weighted": "token count: each rank normalized by its own target count (ranks weighted equally, e.g. "
    "average_tokens_across_devices=False)",
    "count_unshifted": "shift: the target count includes each row's first label (off by one per row)",
    "count_shifted": "shift: the target count drops each row's first label, but the loss counts it",
    "per_row": "sequence count: each micro-batch's summed loss divided by its number of rows, summed over the "
    "window (a loss divided by the number of sequences, not tokens)",
    "per_row_averaged": "sequence count: each micro-batch's summed loss divided by its number of rows, averaged "
    "over the window",
    "per_row_window": "sequence count: the window's summed loss divided by its number of rows",
    "sequence_mean": "sequence weighting: every sequence's own token mean, averaged over the sequences",
    "labels_offset": "label alignment: the labels are shifted against input_ids before the loss shifts them "
    "again (a collator or dataset that shifts labels itself)",
    "padding_targets": "padding: labels at padding positions are not -100, so the loss trains on padding tokens",
    "cross_attention": "cross-sequence attention: each packed row run as one sequence (attention and positions "
    "cross the boundaries)",
    "cross_attention_restart": "cross-sequence attention: packed sequences attend to each other (positions restart)",
    "documents_merged": "documents merged: samples that declare several documents (TRL's seq_lengths, restarted "
    "position_ids) were trained as one sequence each; the ground truth keeps the documents apart",
    "scaled": "scale: the exact gradient times a constant no known bug explains",
    "reported_loss": "reported loss: the gradient is exact but the loss the Trainer reports is not the window's "
    "token mean",
    # policy-gradient runs (hf_gradfix.verify.rl): the loss type's objective over the window is the ground truth
    "expected_window_count": "token count: expected window count: each micro-batch divided by the generation batch's "
    "completion tokens x GA / steps_per_generation (TRL's dapo / cispo / vespo divisor), not the window's own token "
    "count (exact only when steps_per_generation == GA)",
    "mean_of_micro_means": "token count: mean of micro-batch means: each micro-batch normalized by its own completion "
    "tokens (or completions), the means averaged over the window (TRL's bnpo), not one count for the whole window",
    "entropy_mean_of_micro_means": "entropy bonus: mean of micro-batch means: each micro-batch's entropy averaged over "
    "its own tokens (TRL's), not the window's token mean",
    "unexplained": "unexplained: no reference reproduces the run within the tolerance",
}


#: References with a constant fitted to the run (named only when no fixed-formula reference fits).
FITTED = frozenset({"scaled"})


#: Bugs ``verify(inject=...)`` can plant in the built-in run, to show they are caught.
BUGS = ("mean_of_means", "ga_scaled", "world_scaled", "count_unshifted", "cross_attention")


def verdict_of(candidates: Mapping[str, float], loss_rel_err: float | None, tolerance: float,
               loss_tolerance: float | None = None) -> str:
    """One step's verdict from the numbers: ``exact`` only when the gradient (``candidates['exact']``) is within
    ``tolerance`` and the reported loss within ``loss_tolerance`` (default: ``tolerance``); else the reference
    that reproduces the gradient within ``tolerance`` (the closest one), else ``unexplained``."""
    grad_ok = candidates["exact"] <= tolerance
    loss_ok = loss_rel_err is None or loss_rel_err <= (tolerance if loss_tolerance is None else loss_tolerance)
    if grad_ok and loss_ok:
        return "exact"
    if grad_ok:
        return "reported_loss"
    for pool in ([k for k in candidates if k not in FITTED], [k for k in candidates if k in FITTED]):
        named = {k: candidates[k] for k in pool if k != "exact" and candidates[k] <= tolerance}
        if named:  # a fixed-formula reference first; a fitted one (one free constant) only when none fits
            return min(named, key=named.get)
    return "unexplained"


@dataclass
class StepResult:
    step: int
    loss_exact: float
    loss_logged: float | None
    loss_rel_err: float | None
    grad_rel_err: float
    groups: dict[str, float]
    verdict: str
    candidates: dict[str, float]
    targets: int = 0
    micro_batches: int = 0
    sequences: int = 0
    detail: str = ""
    #: the tolerance this step was judged with: ``--tolerance``, or under mixed precision FLOOR_FACTOR x the floor
    tolerance: float | None = None
    #: mixed precision: the ground truth against itself summed as a trainer sums it (relative), at the run's precision
    rounding_floor: float | None = None
    #: mixed precision: the ground-truth loss in the run's own layout against the ground truth (None: not comparable),
    #: and the tolerance the reported loss was judged with (FLOOR_FACTOR x that floor; else the gradient's)
    loss_floor: float | None = None
    loss_tolerance: float | None = None
    #: mixed precision: the run's errors against the fp32 ground truth beside it
    fp32_grad_rel_err: float | None = None
    fp32_loss_rel_err: float | None = None
    #: the gradient norm the Trainer measured (for max_grad_norm, on every rank) against the norm of the gradient it held
    grad_norm_rel_err: float | None = None


@dataclass
class VerifyReport:
    exact: bool
    tolerance: float
    world_size: int
    grad_accum: int
    packing: bool
    steps: list[StepResult] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    trainer: str = ""
    head: str = ""
    count_rule: str = ""
    notes: list[str] = field(default_factory=list)
    #: how the run computed ("fp32", "bf16 autocast (cpu)", "bf16 parameters") and what the reference computed in
    precision: str = "fp32"
    reference: str = "fp32"
    #: the ground truth in words where it is not the token mean of a labels loss (a policy-gradient loss type's objective)
    objective: str = ""
    #: ranks that trained on batches of their own (tp / cp ranks and a pipeline's stages share theirs); 0: every rank
    data_ranks: int = 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "nothing_checked": self.nothing_checked()}, indent=2)

    def describe(self, name: str, step: StepResult | None = None) -> str:
        if name == "exact" and self.objective:
            return f"exact: {self.objective}"
        text = "; and ".join(HYPOTHESES.get(part, part) for part in name.split("+"))
        if step is not None and step.detail and name == step.verdict:
            text += f" ({step.detail})"
        return text

    def nothing_checked(self) -> str | None:
        """Why this report checked nothing (no step compared, or no target in any compared step: every label
        ``-100``), else None. Such a report is never EXACT: the CLI exits 2.

        >>> VerifyReport(exact=True, tolerance=1e-5, world_size=1, grad_accum=1, packing=False).nothing_checked()
        'no training step was compared'
        """
        if not self.steps:
            return "no training step was compared"
        if not any(s.targets > 0 for s in self.steps):
            return (f"{len(self.steps)} step(s) compared but they hold 0 targets (every label is -100, or no token is "
                    "a target under the count rule): a gradient of zero equals a ground truth of zero")
        return None

    def lines(self) -> list[str]:
        out = [
            f"hf-gradfix verify: {self.trainer + ', ' if self.trainer else ''}{len(self.steps)} step(s), "
            f"GA {self.grad_accum}, {self.world_size} rank(s)"
            f"{f' ({self.data_ranks} with data of their own)' if 0 < self.data_ranks < self.world_size else ''}, "
            f"packing {'on' if self.packing else 'off'}, "
            f"tolerance {self.tolerance:g}",
        ]
        if self.head:
            out.append(f"  loss: {self.head}; count rule {self.count_rule}")
        if self.reference != "fp32":
            out.append(f"  precision: the run computed in {self.precision}; reference: {self.reference}")
        for s in self.steps:
            loss = f", loss rel err {s.loss_rel_err:.1e}" if s.loss_rel_err is not None else ""
            out.append(f"  step {s.step}: gradient rel err {s.grad_rel_err:.1e}{loss} ({s.targets} targets, "
                       f"{s.sequences} sequences, {s.micro_batches} micro-batches) -> {self.describe(s.verdict, s)}")
            if s.rounding_floor is not None:
                beside = (f"; fp32 beside it: gradient rel err {s.fp32_grad_rel_err:.1e}, loss rel err "
                          f"{s.fp32_loss_rel_err:.1e}" if s.fp32_grad_rel_err is not None else "")
                loss_floor = (f", loss floor {s.loss_floor:.1e} -> {s.loss_tolerance:.1e}" if s.loss_floor is not None
                              else "")
                out.append(f"    rounding floor {s.rounding_floor:.1e} -> tolerance {s.tolerance:.1e} (max of "
                           f"{self.tolerance:g} and {FLOOR_FACTOR:g} x floor){loss_floor}{beside}")
            out.append("    per group: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(s.groups.items())))
            if s.grad_norm_rel_err is not None and self.world_size > 1:  # a norm reduced over ranks (and meshes)
                out.append(f"    gradient norm the Trainer measured (what max_grad_norm clips with), on every rank: "
                           f"rel err {s.grad_norm_rel_err:.1e} against the norm of the gradient it held")
            if s.verdict != "exact":
                near = sorted((v, k) for k, v in s.candidates.items() if k != "exact")[:3]
                out.append("    nearest references: " + ", ".join(f"{k} {v:.1e}" for v, k in near))
        for note in self.notes:
            out.append(f"  note: {note}")
        nothing = self.nothing_checked()
        if nothing is not None:
            out.append(f"NOTHING CHECKED: {nothing}")
        elif self.exact and any(s.rounding_floor is not None for s in self.steps):
            worst = max((s.grad_rel_err for s in self.steps), default=0.0)
            if self.reference.startswith("float64"):  # a policy-gradient run: the truth in float64, the floor measured
                out.append(f"EXACT (the run at {self.precision}: gradient within {worst:.1e} of the float64 ground "
                           "truth, within its rounding)")
            else:
                out.append(f"EXACT (at {self.precision}, as the run: gradient within {worst:.1e} of the ground truth "
                           "computed the same way, within its rounding)")
        elif self.exact:
            out.append("EXACT")
        else:
            by_name = {s.verdict: s for s in self.steps if s.verdict != "exact"}
            out.append("NOT EXACT: " + "; ".join(self.describe(b, by_name.get(b)) for b in self.broken))
        return out


#: Under mixed precision a step counts as exact when its gradient is within FLOOR_FACTOR times its rounding floor (the
#: ground truth against itself summed micro-batch by micro-batch at the run's precision, summed_like_a_trainer) and
#: its reported loss within FLOOR_FACTOR times the loss floor (loss_in_the_run_layout), never below ``tolerance``.
#: Measured (docs/verify.md, "What EXACT means under bf16"; bf16 autocast on a CPU): correct runs of every head came
#: to at most 2.07 x their floor (T5, first step; most 0.8-1.0), the smallest bug the gradient resolves (the count
#: off by one per row, 4-48-token rows) to 7.4 x; 4 leaves about a factor 2 on either side.
FLOOR_FACTOR = 4.0


def plot_report(report: VerifyReport, path: str) -> str:
    """Per step: the run's gradient error against the exact gradient and every reference (log scale), with the
    tolerance; the verdict in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k for s in report.steps for k in s.candidates}, key=lambda k: (k != "exact", k))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(names) + 4), 4.2))
    width = 0.8 / max(len(report.steps), 1)
    for i, s in enumerate(report.steps):
        ys = [max(s.candidates.get(k, math.nan), 1e-12) for k in names]
        ax.bar([j + i * width for j in range(len(names))], ys, width=width, label=f"step {s.step} ({s.verdict})")
    tol = max([s.tolerance for s in report.steps if s.tolerance is not None] or [report.tolerance])
    floor = f" (max over steps of {FLOOR_FACTOR:g} x the rounding floor)" if tol > report.tolerance else ""
    ax.axhline(tol, color="red", linestyle="--", label=f"tolerance {tol:.2g}{floor}")
    ax.set_yscale("log")
    ax.set_xticks([j + width * (len(report.steps) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("run's relative gradient error")
    verdict = "EXACT" if report.exact else "NOT EXACT: " + ", ".join(report.broken)
    ax.set_title(f"hf-gradfix verify ({report.trainer or 'Trainer'}): {verdict}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
