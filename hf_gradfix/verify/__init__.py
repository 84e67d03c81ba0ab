"""``hf-gradfix verify``: prove that a run is exact, on the user's own trainer, model, data and loss code.

:func:`verify_trainer` takes any ``transformers.Trainer`` (stock, a subclass, TRL's ``SFTTrainer``; with or
without hf_gradfix) and runs a few optimizer steps with everything it was built with.  It records every
micro-batch ``training_step`` consumed, the loss it returned and, just before the optimizer, the accumulated
(and all-reduced) gradient.  The ground truth is then computed at the same parameters in one process, in plain
PyTorch: every sequence on its own (no padding, packed rows split), the per-target losses summed over the whole
optimizer window on every rank, divided by the number of targets counted with the loss's own rule (causal
shift, unshifted, one per sequence-level label).

The verdict follows the numbers: EXACT exactly when every step's gradient and loss are within ``tolerance``
(relative).  Otherwise NOT EXACT, and a step's diagnosis names a reference below only when that reference
reproduces the run's gradient within ``tolerance``; else it is ``unexplained``.  References that cannot run on
a model (e.g. a packed row longer than its position table) are skipped with a note.

=============================  ==================================================================================
``mean_of_means``              each micro-batch normalized by its own target count, the means averaged
``mean_of_means_summed``       the same means summed over the window (a micro-batch mean not divided by GA)
``ga_scaled`` / ...            the exact gradient times GA, the ranks, or both
``rank_weighted``              each rank normalized by its own count (ranks weighted equally)
``count_unshifted``            normalized by a count that includes each row's first label (or ``count_shifted``)
``per_row`` / ``per_row_...``  a micro-batch's summed loss divided by its number of rows (sequences)
``sequence_mean``              every sequence's own token mean, averaged over the sequences
``labels_offset``              labels misaligned with ``input_ids`` (a collator or dataset that shifts them itself)
``padding_targets``            labels that are not -100 at padding positions (the loss trains on padding)
``cross_attention``            packed sequences attending to each other (a row run as one sequence)
``documents_merged``           documents the data declares apart (TRL's ``seq_lengths``) trained as one sequence
``router_micro`` / ...         a MoE run: another router-loss convention than the run declares (``verify.moe``)
``scaled``                     the exact gradient times an unexplained constant (the factor is reported)
=============================  ==================================================================================

Dropout is switched off and gradient clipping disabled for the checked steps (both change gradients by
design); the model, optimizer, trainer state and random-number generators are put back afterwards.

Mixed precision (:func:`run_precision`): when the Trainer runs the forward under autocast (``bf16`` / ``fp16``,
accelerate's ``mixed_precision``) or the parameters are bf16 / fp16, every reference is computed the same way
(the same autocast device type and dtype, the same weights) and the fp32 ground truth beside it.  Rounding then
moves even a correct gradient by ~1e-3, so a step is judged against its rounding floor: the ground truth against
itself summed micro-batch by micro-batch as a trainer sums it (:func:`summed_like_a_trainer`); the step's
tolerance is ``max(tolerance, FLOOR_FACTOR * floor)``, for the verdict and the naming alike.  fp16's loss scale
(a ``GradScaler``) is divided out of the recorded gradient.

>>> from hf_gradfix.verify import verdict_of
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-8}, loss_rel_err=None, tolerance=1e-5)
'ga_scaled'
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-8, "scaled": 2e-8}, loss_rel_err=None, tolerance=1e-5)
'ga_scaled'
>>> verdict_of({"exact": 2e-5, "ga_scaled": 3e-3}, loss_rel_err=None, tolerance=1e-5)
'unexplained'

Where it lives (one module per part; none imports this package's top, which only re-exports):

- :mod:`~hf_gradfix.verify.report`: the hypotheses, the verdict rule, :class:`VerifyReport`, :data:`FLOOR_FACTOR`;
- :mod:`~hf_gradfix.verify.reference`: the ground truth and the references, in plain PyTorch;
- :mod:`~hf_gradfix.verify.trainer`: :func:`verify_trainer`, which drives the user's trainer and judges it;
- :mod:`~hf_gradfix.verify.builtin`: :func:`verify`, the built-in run (no script);
- :mod:`~hf_gradfix.verify.rl`, :mod:`~hf_gradfix.verify.moe`, :mod:`~hf_gradfix.verify.sharded`,
  :mod:`~hf_gradfix.verify.documents`: the policy-gradient, MoE router, sharded-model and per-document parts;
- :mod:`~hf_gradfix.verify.command`: the ``hf-gradfix verify`` command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Loaded when asked for (as hf_gradfix's own top): the command line (.command) and the light parts stay free of
# torch until a run needs it (`hf-gradfix verify --help` answers at once); the names are static here for the docs.
if TYPE_CHECKING:
    from .builtin import (_ListDataset, _PadCollator, load_model, load_samples, plot_loss_curves, synthetic_samples,
                          tiny_model, verify)
    from .reference import Precision, run_precision
    from .report import BUGS, FLOOR_FACTOR, HYPOTHESES, StepResult, VerifyReport, plot_report, verdict_of
    from .trainer import verify_trainer


def __getattr__(name: str):
    if name in ("_ListDataset", "_PadCollator", "load_model", "load_samples", "plot_loss_curves", "synthetic_samples",
                "tiny_model", "verify"):
        from . import builtin as module
    elif name in ("Precision", "run_precision"):
        from . import reference as module
    elif name in ("BUGS", "FLOOR_FACTOR", "HYPOTHESES", "StepResult", "VerifyReport", "plot_report", "verdict_of"):
        from . import report as module
    elif name == "verify_trainer":
        from . import trainer as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


__all__ = ["verify", "verify_trainer", "verdict_of", "VerifyReport", "StepResult", "HYPOTHESES", "tiny_model",
           "synthetic_samples", "BUGS", "plot_report", "Precision", "run_precision", "FLOOR_FACTOR"]
