"""Never worse than stock, on every way of calling a step (issue 34).

- A ``training_step`` called by the user (a fresh trainer, a hand-written loop, after ``train()``) with an explicit
  ``num_items_in_batch``: exact for that count (stock is exact only where the model honours the count), never the
  stale count of the last window ``train()`` drew, never a per-micro-batch mean.
- A trainer subclass whose ``training_step`` divides the loss by the accumulation steps again after
  ``compute_loss`` (LLaMA-Factory's ``HyperParallelTrainer`` pattern): detected by what reaches ``backward``, undone,
  exact; stock is wrong there too.
- A ``compute_loss`` that reads what the training loop or the trainer's own ``training_step`` sets before the step
  (TRL's SFTTrainer reads ``current_gradient_accumulation_steps`` for its MoE aux term): the plugin probes inside
  the step, so nothing it does first depends on those.

Every verdict is measured against an independent ground truth (plain PyTorch, one process, the whole window at once,
``tests/support/harness.py``) with a control that must fail.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import nullcontext

import pytest
import torch
import transformers
from transformers import Trainer

import harness as H
import hf_gradfix

GRAD_TOL = 1e-5
MAJOR = int(transformers.__version__.split(".")[0])


@contextlib.contextmanager
def captured(name="hf_gradfix"):
    """The records of one logger (hf_gradfix's handler does not propagate to the root logger)."""
    records = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Keep(level=logging.DEBUG)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _warnings(records):
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------------------------------------------------
# 3. training_step called by the user, with the window's count
# ----------------------------------------------------------------------------------------------------------------------


class OwnMeanTrainer(Trainer):
    """A compute_loss override computing its own micro-batch mean cross-entropy (ignores num_items_in_batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


def _fresh_trainer(arch, samples, task, ga=2, trainer_cls=None):
    model = H.build_model(arch, seed=0)
    return H.make_trainer(model, samples, task, trainer_cls=trainer_cls, extra_args=dict(
        optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=ga, per_device_train_batch_size=2,
        num_train_epochs=1, logging_steps=1, seed=0, report_to=[], save_strategy="no"))


def _hand_written_loop(trainer, windows, task):
    """What a user's own loop does: each window's target count (the rule of the task), then one training_step per
    micro-batch with that count, then the accumulated gradient."""
    collator = H.RecordingCollator(task, H.pad_id_of(trainer.model))
    grads = []
    for window in windows:
        batches = [collator.collate(mb) for mb in window]
        n = sum(H.sample_loss_count(s, task) for mb in window for s in mb)
        trainer.model.zero_grad(set_to_none=True)
        for batch in batches:
            trainer.training_step(trainer.model, batch, num_items_in_batch=torch.tensor(n))
        grads.append({k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                      for k, p in trainer.model.named_parameters() if p.requires_grad})
    trainer.model.zero_grad(set_to_none=True)
    return grads


def _windows(samples, mbs=2, ga=2):
    """[[micro-batch samples] x ga] per window."""
    rows = [samples[i:i + mbs] for i in range(0, len(samples), mbs)]
    return [rows[i:i + ga] for i in range(0, len(rows), ga)]


def _sum_of_means(model, window, task):
    """The wrong objective (control): each micro-batch's own target mean, summed over the window (what a head that
    ignores the count gives when the step trusts the count: stock on seqcls)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for mb in window:
        total = sum(H.sample_loss_sum(model, s, task)[0] for s in mb)
        losses.append(total / sum(H.sample_loss_count(s, task) for s in mb))
    torch.stack(losses).sum().backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("arch,task,trainer_cls", [("llama", "causal", None), ("llama_seqcls", "seqcls", None),
                                                   ("llama", "causal", OwnMeanTrainer)])
@pytest.mark.parametrize("after_train", [False, True])
def test_training_step_called_by_the_user_is_exact_for_its_count(arch, task, trainer_cls, after_train):
    """A fresh trainer (or one that already ran train()): training_step with the caller's num_items_in_batch is exact
    for that count. Stock is exact only where the loss honours the count (llama), not for a head or a compute_loss
    that ignores it (each micro-batch's mean); after train(), the last window's count must not be used."""
    samples = H.make_samples(task, n=8, seed=3)
    # after train() (windows of 2 x 2 samples), the user's windows hold 2 x 1: the last window's count would be wrong
    windows = _windows(samples, mbs=1 if after_train else 2)
    hf_gradfix.patch({"log_fixes": False})
    try:
        trainer = _fresh_trainer(arch, samples, task, trainer_cls=trainer_cls)
    finally:
        hf_gradfix.unpatch()
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if after_train:
        trainer.train()  # lr 0: the weights do not move; the last window's count must not leak into the next call
        trainer.model.load_state_dict(initial)
    got = _hand_written_loop(trainer, windows, task)
    model = H.build_model(arch, seed=0)
    model.load_state_dict(initial)
    for k, window in enumerate(windows):
        _, truth = H.ground_truth(model, [s for mb in window for s in mb], task)
        assert H.rel_err(got[k], truth) <= GRAD_TOL, (k, H.rel_err(got[k], truth))
        # control: the sum of micro-batch means is far from it, so the comparison above can fail
        assert H.rel_err(_sum_of_means(model, window, task), truth) > 1e-2


def test_training_step_without_a_count_outside_train_is_stock():
    """No count given: there is nothing to be exact for; the step is stock's (the micro-batch's own mean, divided by
    the accumulation steps of the last window, as stock divides), with one note."""
    samples = H.make_samples("causal", n=4, seed=3)
    batch = H.RecordingCollator("causal", H.PAD_ID).collate(samples[:2])

    def grads(patched):
        if patched:
            hf_gradfix.patch({"log_fixes": False})
        try:
            trainer = _fresh_trainer("llama", samples, "causal", ga=2)
        finally:
            hf_gradfix.unpatch()
        trainer.train()  # lr 0; stock's step without a count reads the loop's current_gradient_accumulation_steps
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.training_step(trainer.model, dict(batch))
        return float(loss), {k: p.grad.clone() for k, p in trainer.model.named_parameters()}

    stock_loss, stock = grads(False)
    with captured() as records:
        our_loss, ours = grads(True)
    assert our_loss == pytest.approx(stock_loss, rel=1e-6)
    assert H.rel_err(ours, stock) <= 1e-6
    assert any("without num_items_in_batch" in r.getMessage() for r in records)


# ----------------------------------------------------------------------------------------------------------------------
# 4. a subclass that divides by the accumulation steps again
# ----------------------------------------------------------------------------------------------------------------------


class DividingTrainer(Trainer):
    """LLaMA-Factory's HyperParallelTrainer.training_step, reduced to its loss handling: compute_loss, then a division
    by the accumulation steps when the model does not accept loss kwargs, then accelerator.backward."""

    divisions = 0  # how many steps divided (transformers 4.57 under hf_gradfix: none, the flag is set for the count)

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not getattr(self, "model_accepts_loss_kwargs", False) and getattr(self, "compute_loss_func", None) is None:
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            self.divisions += 1
        self.accelerator.backward(loss)
        return loss.detach()


class AlwaysDividingTrainer(Trainer):
    """A training_step written for stock's per-micro-batch means: always divides by args.gradient_accumulation_steps."""

    divisions = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        loss = loss / self.args.gradient_accumulation_steps
        self.divisions += 1
        self.accelerator.backward(loss)
        return loss.detach()


@pytest.mark.parametrize("trainer_cls,arch", [(DividingTrainer, "nokwargs"), (AlwaysDividingTrainer, "llama")])
def test_subclass_that_divides_by_the_accumulation_steps_again_is_exact(trainer_cls, arch):
    """13 samples, GA 4, batch 1: windows of 4, 4, 4 and a short last one of 1; every window exact, the logged loss
    too, one warning naming the subclass. Stock is wrong for the same subclass (the control)."""
    samples = H.make_samples("causal", n=13, seed=5)
    stock = H.run_trainer(H.build_model(arch, seed=0), samples, "causal", trainer_cls=trainer_cls)
    stock_errors = H.check_against_gt(H.build_model(arch, seed=0), samples, "causal", stock)
    hf_gradfix.patch({"log_fixes": False})
    try:
        with captured() as records:
            ours = H.run_trainer(H.build_model(arch, seed=0), samples, "causal", trainer_cls=trainer_cls)
    finally:
        hf_gradfix.unpatch()
    errors = H.check_against_gt(H.build_model(arch, seed=0), samples, "causal", ours)
    assert len(errors) == 4
    loss_tol = 1e-6 if MAJOR >= 5 else 1e-4
    for k, (grad_err, loss_err) in enumerate(errors):
        assert grad_err <= GRAD_TOL, (k, errors)
        assert loss_err is not None and loss_err <= loss_tol, (k, errors)
    assert max(e for e, _ in stock_errors) > 0.1, stock_errors  # control: stock is wrong on this subclass
    divided = [w for w in _warnings(records) if "accumulation steps after compute_loss" in w]
    if ours.trainer.divisions:  # the subclass divided (on transformers 4.57 the plugin's count flag avoids it)
        assert len(divided) == 1 and trainer_cls.__name__ in divided[0], _warnings(records)
    else:
        assert not divided, divided


def test_a_step_that_does_not_divide_is_left_alone():
    """The plain Trainer: nothing measured, nothing undone, no warning (the detection needs the division to happen)."""
    samples = H.make_samples("causal", n=8, seed=5)
    hf_gradfix.patch({"log_fixes": False})
    try:
        with captured() as records:
            ours = H.run_trainer(H.build_model("llama", seed=0), samples, "causal")
    finally:
        hf_gradfix.unpatch()
    for grad_err, _ in H.check_against_gt(H.build_model("llama", seed=0), samples, "causal", ours):
        assert grad_err <= GRAD_TOL
    assert not _warnings(records)


# ----------------------------------------------------------------------------------------------------------------------
# 2. a compute_loss that reads what the step sets
# ----------------------------------------------------------------------------------------------------------------------


class StepStateTrainer(Trainer):
    """Its compute_loss reads an attribute the training loop sets per window (current_gradient_accumulation_steps, as
    TRL's SFTTrainer does for MoE models) and one its own training_step sets before the step."""

    def training_step(self, model, inputs, *args, **kwargs):
        self._step_context = "set by training_step"
        with nullcontext():
            return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            assert self._step_context == "set by training_step"
            assert self.current_gradient_accumulation_steps >= 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


@pytest.mark.parametrize("ga", [1, 4])
def test_compute_loss_reading_what_the_step_sets_trains_exact(ga):
    samples = H.make_samples("causal", n=8, seed=7)
    hf_gradfix.patch({"log_fixes": False})
    try:
        ours = H.run_trainer(H.build_model("llama", seed=0), samples, "causal", trainer_cls=StepStateTrainer,
                             gradient_accumulation_steps=ga)
    finally:
        hf_gradfix.unpatch()
    for grad_err, _ in H.check_against_gt(H.build_model("llama", seed=0), samples, "causal", ours):
        assert grad_err <= GRAD_TOL


# ----------------------------------------------------------------------------------------------------------------------
# A method of the user's class replaced by a wrapper of the trainer's bound method (TRL's own tests do this)
# ----------------------------------------------------------------------------------------------------------------------


class PlainSubclass(Trainer):
    """A subclass with its own training_step and compute_loss (both only chain to the Trainer's)."""

    def training_step(self, model, inputs, *args, **kwargs):
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, **kwargs):
        return super().compute_loss(model, inputs, **kwargs)


class BareSubclass(Trainer):
    """A subclass that overrides nothing: a delegate set on it has no method of its own to continue with."""


@pytest.mark.parametrize("method,trainer_cls,arch,task", [
    ("training_step", PlainSubclass, "llama", "causal"), ("compute_loss", PlainSubclass, "llama", "causal"),
    ("compute_loss", BareSubclass, "llama_seqcls", "seqcls")])
def test_class_method_wrapping_the_bound_method_trains_as_stock_calls(method, trainer_cls, arch, task):
    """``patch.object(MyTrainer, name, wraps=trainer.<name>)`` after construction (TRL's
    ``test_prepare_input_called_with_correct_data``): the wrapper is called once per call, with the same arguments, as
    stock; the run is exact. On the generated class the bound method is the plugin's, whose chain reaches the wrapper:
    without the re-entry rule this recursed until RecursionError."""
    from unittest import mock

    samples = H.make_samples(task, n=8, seed=11)
    calls = {}

    def run(patched):
        stack = contextlib.ExitStack()

        def wrap(trainer):
            # the class the trainer was built as (the harness subclasses PlainSubclass on the fly to record steps)
            built_as = getattr(type(trainer), "_gradfix_original_class", type(trainer))
            calls[patched] = stack.enter_context(mock.patch.object(built_as, method, wraps=getattr(trainer, method)))

        if patched:
            hf_gradfix.patch({"log_fixes": False})
        try:
            with stack:
                return H.run_trainer(H.build_model(arch, seed=0), samples, task, trainer_cls=trainer_cls,
                                     gradient_accumulation_steps=2, before_train=wrap)
        finally:
            hf_gradfix.unpatch()

    run(False)
    ours = run(True)
    stock_calls = [c.args[1]["input_ids"].tolist() for c in calls[False].call_args_list]
    our_calls = [c.args[1]["input_ids"].tolist() for c in calls[True].call_args_list]
    if method == "training_step":
        assert our_calls == stock_calls and stock_calls
    else:  # the first window's probe also evaluates the class's compute_loss (that is how its behaviour is measured)
        assert len(our_calls) > len(stock_calls) > 0
        assert all(batch in our_calls for batch in stock_calls)
    errors = H.check_against_gt(H.build_model(arch, seed=0), samples, task, ours)
    assert errors and all(grad_err <= GRAD_TOL for grad_err, _ in errors), errors
