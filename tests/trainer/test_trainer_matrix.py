"""The trainer matrix (issue 34): every trainer class the installed TRL ships, discovered by walking the package (not
from a list), and transformers' ``Trainer`` / ``Seq2SeqTrainer`` with the ``training_step`` / ``compute_loss`` /
``get_batch_samples`` overrides real projects write, each trained stock and under ``hf_gradfix.patch()`` on tiny
models built offline (helpers and recipes: ``tests/support/trainer_matrix.py``).

Both runs start from the same weights and draw the same data (SGD at lr 0, no clipping, GA 2, 2 optimizer steps, CPU,
fp32). The verdict of a case comes from what hf_gradfix reports about the trainer (``hf_gradfix.state_of``), not from
its class name, and must be one of:

* **exact**: at every optimizer step hf_gradfix had probed the loss and counted the window's targets (``state.probed``,
  ``state.window`` with a count, no ``state.disabled_reason``, read at ``on_pre_optimizer_step``): every step's
  accumulated gradient is within 1e-5 (relative) of the ground truth on the micro-batches the trainer trained on;
* **equal to stock**: hf_gradfix left the loss to the trainer (no ``labels`` to count, or the fix disabled with a
  reason): every step's gradient is within 1e-6 of the stock run's, with exactly one ``hf_gradfix`` warning naming
  what it could not read.

In both, the patched run must finish ``train()`` whenever the stock run does (never refused, never crashed). A
discovered class that no recipe fits, or that needs a vLLM / teacher server, is skipped with the reason; a recipe that
does not train stock is skipped with the stock error (nothing to hold hf_gradfix to).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import trainer_matrix as M

MAJOR = int(transformers.__version__.split(".")[0])

try:  # TRL 1.x needs transformers 5: the transformers 4.57 CI phase has no TRL, its cases are skipped there
    import trl  # noqa: F401

    TRL_TRAINERS, TRL_IMPORT_ERRORS = M.discover_trl_trainers()
    TRL_CASES = {**TRL_TRAINERS, **M.sft_variants()}
except ImportError as err:
    TRL_TRAINERS, TRL_IMPORT_ERRORS, TRL_CASES = {}, {}, {}
    TRL_MISSING = f"TRL is not installed ({err})"
else:
    TRL_MISSING = None

#: the stable trainers every TRL 1.x release exports: discovery must find at least these (a walk that finds nothing
#: would otherwise pass by skipping everything)
STABLE = ("trl.SFTTrainer", "trl.DPOTrainer", "trl.GRPOTrainer", "trl.RewardTrainer", "trl.RLOOTrainer")


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__module__}.{type(err).__qualname__}: {text[:400]}"


def check_case(name: str, recipe: M.Recipe) -> str:
    """Train ``recipe`` stock and patched; assert the verdict; return it (for the summary line)."""

    stock = M.run(recipe.make, "stock")
    if stock.error is not None or not stock.grads:
        why = _describe(stock.error) if stock.error is not None else "no optimizer step"
        pytest.skip(f"{name}: recipe '{recipe.name}' does not train stock ({why}); nothing to hold hf_gradfix to")
    patched = M.run(recipe.make, "patch")
    assert patched.error is None, (
        f"{name}: stock trains, but the run built under hf_gradfix.patch() raised {_describe(patched.error)} "
        f"(hf_gradfix warnings: {patched.warnings})"
    )
    assert len(patched.grads) == len(stock.grads), (
        f"{name}: {len(patched.grads)} optimizer steps, stock {len(stock.grads)}"
    )
    assert M.grad_norm(stock.grads[0]) > 0, f"{name}: recipe '{recipe.name}' trains nothing (zero gradient)"
    reports = patched.reports
    assert reports and all(r["installed"] for r in reports), f"{name}: patch() did not install on the trainer"
    counted = [r["counted"] for r in reports]
    # A window hf_gradfix counted must be exact; one it left to the trainer must equal stock's. A run may go from the
    # first to the second (never back): a trainer seen training on other targets than the drawn micro-batches (TRL's
    # GKD on an on-policy step) leaves the fix from that window on.
    assert counted == sorted(counted, reverse=True), f"{name}: hf_gradfix fixed a window after leaving one: {reports}"
    fixes = reports[-1]["fixes"]
    reason = next((r["reason"] for r in reports if r["reason"]), None)
    timing = f"stock {stock.seconds:.1f}s, patched {patched.seconds:.1f}s"
    errors = M.truth_errors(patched, stock, recipe.truth) if any(counted) else []
    differences = M.stock_differences(patched, stock)
    verdicts = []
    for k, is_counted in enumerate(counted):
        if is_counted:
            assert errors[k] <= M.GRAD_TOL, (
                f"{name} step {k}: hf_gradfix reports this window fixed ({'; '.join(fixes)}) but the gradient "
                f"is {errors[k]:.3e} (relative) from the {recipe.truth} ground truth on the micro-batches it trained on"
            )
            verdicts.append(f"exact {errors[k]:.1e}")
        else:
            assert differences[k] <= M.STOCK_TOL, (
                f"{name} step {k}: hf_gradfix left the loss to the trainer ({reason or 'no labels'}) but the gradient "
                f"differs from stock's by {differences[k]:.3e} (relative)"
            )
            verdicts.append(f"stock {differences[k]:.1e}")
    if all(counted):
        summary = (f"{name}: EXACT vs {recipe.truth} ground truth, gradient rel err {', '.join(verdicts)} "
                   f"({timing}); fixes: {'; '.join(fixes)}")
        print(summary)
        return summary
    what = reason or "batches without 'labels'"
    summary = (f"{name}: {'EQUAL TO STOCK' if not any(counted) else 'EXACT, THEN STOCK'} ({what[:120]}), per step "
               f"{', '.join(verdicts)} ({timing}); warning: {patched.warnings}")
    print(summary)
    assert len(patched.warnings) == 1, (
        f"{name}: hf_gradfix left the loss as stock computes it; expected exactly one hf_gradfix warning saying so, "
        f"got {len(patched.warnings)}: {patched.warnings}"
    )
    named = "labels" if reason is None else reason.strip()[:60]
    assert named in patched.warnings[0], (
        f"{name}: the warning does not name what was not read ({named!r}): {patched.warnings}"
    )
    return summary


#: hf_gradfix's known gaps, by case id (TRL or transformers), as strict xfails: (applies, reason); each case turns into
#: a failure when its fix lands (XPASS), and its entry is removed then
KNOWN_GAPS: dict[str, tuple[bool, str]] = {
    # name -> (strict xfail, reason): a case hf_gradfix does not yet meet. Empty: every case meets its verdict.
    # Fixed since the matrix landed: (c) LLaMA-Factory's training_step dividing again (the division is measured at
    # backward and undone); GKD / GOLD training on on-policy generations instead of the drawn micro-batches (the
    # rewrite is measured per step: that window runs as stock, then the trainer leaves the fix, with one warning);
    # OnlineDPO, whose steps never call compute_loss (one warning, stock); IW-OPD's negative loss sum (it now probes as
    # honouring the count; its on-policy steps rewrite the batch, so it trains as stock with one warning).
}


def _param(name):
    gap = KNOWN_GAPS.get(name)
    marks = [pytest.mark.xfail(strict=True, reason=gap[1])] if gap and gap[0] else []
    return pytest.param(name, marks=marks)


# ----------------------------------------------------------------------------------------------------------------------
# TRL: every trainer class the installed package ships
# ----------------------------------------------------------------------------------------------------------------------


def test_trl_discovery_finds_the_trainers():
    """The walk finds every trainer the package exports at its top level, and at least the stable ones."""
    if TRL_MISSING:
        pytest.skip(TRL_MISSING)
    import inspect
    import warnings

    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = {f"trl.{n}" for n in dir(trl) if not n.startswith("_")
                    and inspect.isclass(getattr(trl, n, None)) and issubclass(getattr(trl, n), transformers.Trainer)}
    assert exported <= set(TRL_TRAINERS), f"exported but not discovered: {sorted(exported - set(TRL_TRAINERS))}"
    missing = sorted(set(STABLE) - set(TRL_TRAINERS))
    assert not missing, f"stable trainers not discovered: {missing}"
    print(f"discovered {len(TRL_TRAINERS)} trainer classes in trl {trl.__version__}: {sorted(TRL_TRAINERS)}")
    if TRL_IMPORT_ERRORS:  # a trainer in one of these modules could not be looked at: said, not dropped
        print("modules not imported (their trainers, if any, are not in the matrix): "
              + "; ".join(f"{m} ({e})" for m, e in sorted(TRL_IMPORT_ERRORS.items())))


def _trl_ids():
    return sorted(TRL_CASES) if TRL_CASES else ["trl-not-installed"]


@pytest.mark.parametrize("name", [_param(n) for n in _trl_ids()])
def test_trl_trainer(name):
    if TRL_MISSING:
        pytest.skip(TRL_MISSING)
    entry = TRL_CASES[name]
    recipe = entry if isinstance(entry, M.Recipe) else M.plan_for(entry)
    if isinstance(recipe, M.Skip):
        pytest.skip(f"{name}: {recipe.reason}")
    check_case(name, recipe)


# ----------------------------------------------------------------------------------------------------------------------
# transformers' Trainer / Seq2SeqTrainer and the subclasses projects write
# ----------------------------------------------------------------------------------------------------------------------

TF_CASES = M.transformers_cases()


@pytest.mark.parametrize("name", [_param(n) for n in sorted(TF_CASES)])
def test_transformers_trainer(name):
    check_case(name, TF_CASES[name])
