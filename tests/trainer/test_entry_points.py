"""The three ways in (patch, callback, configuration), their discipline, and the exact eval loss."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch
import transformers
from transformers import Trainer, TrainerCallback

import harness as H
import hf_gradfix
from hf_gradfix.integration import versions
from hf_gradfix.integration.callback import GradFixCallbackError
from test_exactness import TutorialTrainer, assert_exact


def _samples(task="causal", n=12):
    return H.make_samples(task, n=n, seed=0)


# -- patch() / unpatch() -------------------------------------------------------------------------------------------


def test_patch_is_idempotent_and_unpatch_restores_the_original():
    original = Trainer.__dict__["__init__"]
    hf_gradfix.patch()
    patched_init = Trainer.__dict__["__init__"]
    assert patched_init is not original
    hf_gradfix.patch({"loss": {"count_rule": "auto"}})  # second call: same function, config updated
    assert Trainer.__dict__["__init__"] is patched_init
    hf_gradfix.unpatch()
    assert Trainer.__dict__["__init__"] is original
    hf_gradfix.unpatch()  # safe twice
    assert Trainer.__dict__["__init__"] is original
    assert not hf_gradfix.is_patched()


def test_unpatched_trainers_are_stock():
    model = H.build_model("bert_seqcls")
    record = H.run_trainer(model, _samples("seqcls"), "seqcls")
    assert type(record.trainer).__mro__[1].__name__ != "_GradFixTop"
    assert "_gradfix" not in record.trainer.__dict__


def test_patch_refuses_an_unsupported_transformers(monkeypatch):
    real = versions._installed

    def fake(name):
        return versions.Version("4.40.0") if name == "transformers" else real(name)

    monkeypatch.setattr(versions, "_installed", fake)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(versions.UnsupportedVersionError, match=r"transformers 4\.40\.0 \(supported: >=4\.57,<4\.58 or >=5\.0,<6\.0\)"):
        hf_gradfix.patch()
    assert not hf_gradfix.is_patched()


def test_patch_rejects_a_bad_config_before_touching_anything():
    with pytest.raises(hf_gradfix.ConfigError, match="count_rul.*did you mean 'count_rule'"):
        hf_gradfix.patch({"loss": {"count_rul": "shifted"}})
    assert not hf_gradfix.is_patched()


def test_patch_reads_the_config_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: 'NO'\nnum_processes: 1\nhf_gradfix:\n  loss:\n    eval_token_mean: false\n")
    monkeypatch.setenv("HF_GRADFIX_CONFIG", str(path))
    cfg = hf_gradfix.patch()
    try:
        assert cfg.loss.eval_token_mean is False
    finally:
        hf_gradfix.unpatch()


def test_patch_covers_subclasses_and_logs_one_line_per_trainer(caplog):
    hf_gradfix.patch()
    try:
        logger = logging.getLogger("hf_gradfix")
        logger.addHandler(caplog.handler)
        try:
            model = H.build_model("bert_seqcls")
            samples = _samples("seqcls")
            record = H.run_trainer(model, samples, "seqcls", trainer_cls=TutorialTrainer)
        finally:
            logger.removeHandler(caplog.handler)
        lines = [r.getMessage() for r in caplog.records if r.name == "hf_gradfix" and "hf_gradfix (patch(); settings from: defaults)" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "head ignores num_items_in_batch" in lines[0]
        assert "TutorialTrainer.compute_loss ignores num_items_in_batch" in lines[0]
        assert isinstance(record.trainer, TutorialTrainer)
        assert_exact(H.check_against_gt(model, samples, "seqcls", record), "patched subclass")
    finally:
        hf_gradfix.unpatch()


def _offline_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(H.VOCAB)}, unk_token="3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")


def test_trl_sft_trainer_is_fixed():
    trl = pytest.importorskip("trl")
    hf_gradfix.patch()
    try:
        model = H.build_model("llama")
        samples = _samples()
        datasets = pytest.importorskip("datasets")
        record = H.run_trainer(
            model,
            samples,
            "causal",
            trainer_cls=trl.SFTTrainer,
            extra_args={"bf16": False, "fp16": False, "max_length": None, "packing": False},
            args_cls=trl.SFTConfig,
            dataset=datasets.Dataset.from_list(samples),
            trainer_kwargs={"processing_class": _offline_tokenizer()},
        )
        assert "_gradfix" in record.trainer.__dict__
        assert_exact(H.check_against_gt(model, samples, "causal", record), "SFTTrainer")
    finally:
        hf_gradfix.unpatch()


# -- GradFixCallback -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["constructor", "add_callback"])
def test_callback_fixes_one_trainer_without_a_global_patch(how):
    assert not hf_gradfix.is_patched()
    model = H.build_model("bert_seqcls")
    samples = _samples("seqcls")
    if how == "constructor":
        record = H.run_trainer(model, samples, "seqcls", callbacks=[hf_gradfix.GradFixCallback()])
    else:
        record = H.run_trainer(model, samples, "seqcls", before_train=lambda t: t.add_callback(hf_gradfix.GradFixCallback()))
    assert_exact(H.check_against_gt(model, samples, "seqcls", record), f"callback via {how}")
    assert Trainer.__dict__["__init__"].__name__ == "__init__" and not hf_gradfix.is_patched()


class _AddLate(TrainerCallback):
    def __init__(self):
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.trainer.add_callback(hf_gradfix.GradFixCallback())


def test_callback_added_after_training_started_is_an_error():
    late = _AddLate()
    model = H.build_model("llama")

    def attach(trainer):
        late.trainer = trainer

    with pytest.raises(GradFixCallbackError, match="added after training started"):
        H.run_trainer(model, _samples(), "causal", callbacks=[late], before_train=attach)


# -- eval loss -----------------------------------------------------------------------------------------------------


def _eval_gt(model, samples, task):
    with torch.no_grad():
        total, count = 0.0, 0
        for s in samples:
            loss_sum, n = H.sample_loss_sum(model, s, task)
            total += float(loss_sum)
            count += n
    return total / count


@pytest.mark.parametrize("arch", ["llama", "bert_seqcls", "t5"])
def test_eval_loss_is_the_token_mean_for_every_batch_size(arch):
    model = H.build_model(arch)
    task = H.task_of(arch)
    samples = H.make_samples(task, n=11, seed=1)
    model.eval()
    gt = _eval_gt(model, samples, task)
    hf_gradfix.patch()
    try:
        for bs in (1, 4, 5):
            trainer = H.make_trainer(model, samples, task, extra_args={"per_device_eval_batch_size": bs})
            metrics = trainer.evaluate(eval_dataset=H.ListDataset(samples))
            assert abs(metrics["eval_loss"] - gt) / gt <= 1e-6, (arch, bs, metrics["eval_loss"], gt)
    finally:
        hf_gradfix.unpatch()


def _seq2seq_generate_eval(model, samples, bs, **trainer_kw):
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hgf_s2s_"), report_to="none", use_cpu=True, remove_unused_columns=False,
        disable_tqdm=True, per_device_eval_batch_size=bs, predict_with_generate=True, generation_max_length=6)
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=args, data_collator=H.RecordingCollator("seq2seq", H.pad_id_of(model)),
        compute_metrics=lambda p: {"generated": float(len(p.predictions))}, **trainer_kw)  # metrics: the generate path
    return trainer.evaluate(eval_dataset=H.ListDataset(samples))


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_seq2seq_predict_with_generate_eval_loss_is_the_token_mean(arch, caplog):
    """Issue 25, finding 5: Seq2SeqTrainer with predict_with_generate computes its eval loss in prediction_step, not
    compute_loss; it is counted there too.  Measured before: t5 1.0e-2 / 9.4e-3 / 8.8e-3 off the exact target mean
    (batch 1 / 4 / 5: stock's mean of batch means), eval_loss_targets absent; after: <= 5e-8.  A loss this path cannot
    count (a compute_loss_func, which it bypasses) stays stock's with a warning naming the path."""
    model = H.build_model(arch)
    samples = H.make_samples("seq2seq", n=11, seed=1)
    model.eval()
    gt = _eval_gt(model, samples, "seq2seq")
    targets = sum(H.sample_loss_count(s, "seq2seq") for s in samples)
    hf_gradfix.patch()
    try:
        for bs in (1, 4):
            metrics = _seq2seq_generate_eval(model, samples, bs)
            assert metrics["eval_generated"] == 11  # the generate path ran
            assert abs(metrics["eval_loss"] - gt) / gt <= 1e-6, (arch, bs, metrics["eval_loss"], gt)
            assert metrics["eval_loss_targets"] == targets
        logger = logging.getLogger("hf_gradfix")
        logger.addHandler(caplog.handler)
        try:
            def func(outputs, labels, num_items_in_batch=None):
                return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten())

            metrics = _seq2seq_generate_eval(model, samples, 4, compute_loss_func=func)
        finally:
            logger.removeHandler(caplog.handler)
    finally:
        hf_gradfix.unpatch()
    assert "eval_loss_targets" not in metrics and abs(metrics["eval_loss"] - gt) / gt > 1e-6  # stock's value
    assert any("predict_with_generate=True" in r.getMessage() and "compute_loss_func" in r.getMessage()
               for r in caplog.records)


# -- what hf_gradfix cannot decide is loud, and leaves transformers' behaviour intact ---------------------------------


class _RenameLabels:
    """Collator whose batches carry the targets under 'targets' instead of 'labels'."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, features):
        batch = self.inner(features)
        batch["targets"] = batch.pop("labels")
        return batch


class _TargetsTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        targets = inputs.pop("targets")
        outputs = model(**inputs, labels=targets)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class _SqrtLossModel(torch.nn.Module):
    """A loss that changes with num_items_in_batch, but not as sum / num_items: undeterminable."""

    def __init__(self):
        super().__init__()
        self.inner = H.build_model("llama")
        self.config = self.inner.config

    def forward(self, input_ids, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        if num_items_in_batch is not None:
            out.loss = out.loss / torch.as_tensor(num_items_in_batch, dtype=torch.float32).sqrt()
        return out


def _train_grads(model, samples, task, trainer_cls=Trainer, collator=None):
    capture = H.GradCapture()
    trainer = H.make_trainer(
        model, samples, task, trainer_cls=trainer_cls, callbacks=[capture],
        extra_args=dict(optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=4,
                        per_device_train_batch_size=1, num_train_epochs=1, logging_steps=1, seed=0),
    )
    if collator is not None:
        trainer.data_collator = collator
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    return capture.grads


def test_batches_without_labels_keep_transformers_behaviour(caplog):
    samples = _samples()
    stock = _train_grads(H.build_model("llama"), samples, "causal", _TargetsTrainer, _RenameLabels(H.RecordingCollator("causal", H.PAD_ID)))
    hf_gradfix.patch()
    try:
        logger = logging.getLogger("hf_gradfix")
        logger.addHandler(caplog.handler)
        try:
            ours = _train_grads(H.build_model("llama"), samples, "causal", _TargetsTrainer, _RenameLabels(H.RecordingCollator("causal", H.PAD_ID)))
        finally:
            logger.removeHandler(caplog.handler)
    finally:
        hf_gradfix.unpatch()
    assert len(stock) == len(ours) == 3
    for a, b in zip(stock, ours):
        assert H.rel_err(b, a) <= 1e-7
    assert any("carry no 'labels'" in r.getMessage() for r in caplog.records)


def test_undeterminable_loss_is_an_error_or_a_warning():
    samples = _samples()
    hf_gradfix.patch({"loss": {"on_undetermined": "error"}})
    try:
        with pytest.raises(hf_gradfix.GradFixError, match="could not tell how.*scales its loss with num_items_in_batch.*on_undetermined: warn"):
            _train_grads(_SqrtLossModel(), samples, "causal")
    finally:
        hf_gradfix.unpatch()
    stock = _train_grads(_SqrtLossModel(), samples, "causal")
    hf_gradfix.patch()  # the default: warn, and train as stock
    try:
        warned = _train_grads(_SqrtLossModel(), samples, "causal")
    finally:
        hf_gradfix.unpatch()
    for a, b in zip(stock, warned):
        assert H.rel_err(b, a) <= 1e-7  # left to transformers, unchanged


def test_every_shipped_config_loads():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert files
    for path in files:
        hf_gradfix.load_config(str(path))


class _SelfScaledTargetsTrainer(_TargetsTrainer):
    """Divides its own loss by the accumulation steps and says so with ``loss_is_scaled_for_ga = True``, set on the
    instance before or after ``super().__init__()`` (both patterns are in user and library code)."""

    def __init__(self, *args, when="before", **kwargs):
        if when == "before":
            self.loss_is_scaled_for_ga = True
        super().__init__(*args, **kwargs)
        if when == "after":
            self.loss_is_scaled_for_ga = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        loss = loss / self.args.gradient_accumulation_steps
        return (loss, outputs) if return_outputs else loss


@pytest.mark.skipif(not hasattr(Trainer, "loss_is_scaled_for_ga"), reason="transformers >= 5.19 reads loss_is_scaled_for_ga")
@pytest.mark.parametrize("when", ["before", "after"])
def test_instance_loss_is_scaled_for_ga_is_honoured(when):
    """Issue 25, finding 6: a subclass's own ``loss_is_scaled_for_ga = True`` (no labels, so the loss stays as the
    trainer computes it): the gradient is each window's sum of micro-batch means / GA, as stock transformers takes
    it; the property of the fixed class used to hide the value set before ``super().__init__()``, and the gradient
    was divided by GA a second time (1/4 of stock's at GA 4)."""
    import functools

    samples = _samples()
    cls = functools.partial(_SelfScaledTargetsTrainer, when=when)
    collator = lambda: _RenameLabels(H.RecordingCollator("causal", H.PAD_ID))  # noqa: E731
    stock = _train_grads(H.build_model("llama"), samples, "causal", cls, collator())
    # the independent reference: each micro-batch's mean token loss / GA, summed over the window, in plain PyTorch
    model = H.build_model("llama")
    reference = []
    for w in range(3):
        model.zero_grad()
        for i in range(4 * w, 4 * w + 4):
            loss_sum, n = H.sample_loss_sum(model, samples[i], "causal")
            (loss_sum / n / 4).backward()
        reference.append({k: p.grad.clone() for k, p in model.named_parameters()})
    hf_gradfix.patch()
    try:
        ours = _train_grads(H.build_model("llama"), samples, "causal", cls, collator())
    finally:
        hf_gradfix.unpatch()
    assert len(stock) == len(ours) == 3
    for a, b, ref in zip(stock, ours, reference):  # learning rate 0: every window at the same weights
        assert H.rel_err(a, ref) <= 1e-5
        assert H.rel_err(b, ref) <= 1e-5, (when, H.norm_ratio(b, ref))


# -- the loss fix over a run's lifecycle (issue 25) -------------------------------------------------------------------


def _lifecycle_trainer(model, samples, callbacks=(), **extra):
    trainer = H.make_trainer(
        model, samples, "seq2seq", callbacks=callbacks,
        extra_args=dict(optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=4,
                        per_device_train_batch_size=1, num_train_epochs=1, logging_steps=1, seed=0, **extra))
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    return trainer


def _check_windows(model, samples, grads, windows):
    """Each recorded window's gradient against the ground truth of its samples (12 samples, GA 4: windows of 4)."""
    assert len(grads) == len(windows)
    for g, w in zip(grads, windows):
        _, gt = H.ground_truth(model, [samples[i] for i in range(4 * w, 4 * w + 4)], "seq2seq")
        assert H.rel_err(g, gt) <= 1e-5, (w, H.rel_err(g, gt))


@pytest.mark.parametrize("entry", ["patch", "callback"])
def test_loss_fix_over_the_lifecycle_of_a_run(entry):
    """t5 (stock's gradient is 1.1 off): a second train() on the same trainer, an exception in the middle of a
    window followed by train() again, and a second trainer on the same model are each exact on every window; after
    unpatch() a new plain trainer on the same model is stock again (the plugin leaves nothing on the model)."""
    samples = _samples("seq2seq", n=12)
    model = H.build_model("t5")
    callbacks = lambda: [hf_gradfix.GradFixCallback()] if entry == "callback" else []  # noqa: E731
    if entry == "patch":
        hf_gradfix.patch()
    try:
        capture = H.GradCapture()
        trainer = _lifecycle_trainer(model, samples, callbacks=[*callbacks(), capture])
        trainer.train()
        trainer.train()  # a second train(): the same 3 windows again
        _check_windows(model, samples, capture.grads, [0, 1, 2, 0, 1, 2])

        class Boom(TrainerCallback):
            def __init__(self):
                self.substeps = 0

            def on_substep_end(self, args, state, control, **kwargs):  # inside window 2 (after 6 micro-batches)
                self.substeps += 1
                if self.substeps == 6:
                    raise RuntimeError("boom")

        boom = Boom()
        trainer.add_callback(boom)
        capture.grads.clear()
        with pytest.raises(RuntimeError, match="boom"):
            trainer.train()
        trainer.remove_callback(boom)
        model.zero_grad(set_to_none=True)  # what the interrupted window accumulated is the user's to drop
        trainer.train()
        _check_windows(model, samples, capture.grads, [0, 0, 1, 2])

        second_capture = H.GradCapture()
        second = _lifecycle_trainer(model, samples, callbacks=[*callbacks(), second_capture])
        second.train()
        _check_windows(model, samples, second_capture.grads, [0, 1, 2])
    finally:
        hf_gradfix.unpatch()
    stock_capture, fresh_capture = H.GradCapture(), H.GradCapture()
    _lifecycle_trainer(model, samples, callbacks=[stock_capture]).train()
    _lifecycle_trainer(H.build_model("t5"), samples, callbacks=[fresh_capture]).train()
    for a, b in zip(stock_capture.grads, fresh_capture.grads):
        assert H.rel_err(a, b) <= 1e-7  # the same model, plain again: stock's gradient, not the fixed one
    _, gt = H.ground_truth(model, samples[:4], "seq2seq")
    assert H.rel_err(stock_capture.grads[0], gt) > 1e-2  # and stock's is wrong: the checks above can fail


class _OwnPredictionStep(Trainer):
    """A prediction_step that computes its loss itself (twice the model's mean: nothing the plugin can count)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with torch.no_grad():
            loss = model(**inputs).loss.detach() * 2
        return loss, None, None


def test_eval_loss_from_an_own_prediction_step_stays_stock_with_a_warning(caplog):
    model = H.build_model("llama")
    samples = _samples(n=11)
    stock = H.make_trainer(model, samples, "causal", trainer_cls=_OwnPredictionStep,
                           extra_args={"per_device_eval_batch_size": 4}).evaluate(eval_dataset=H.ListDataset(samples))
    hf_gradfix.patch()
    logger = logging.getLogger("hf_gradfix")
    logger.addHandler(caplog.handler)
    try:
        ours = H.make_trainer(model, samples, "causal", trainer_cls=_OwnPredictionStep,
                              extra_args={"per_device_eval_batch_size": 4}).evaluate(eval_dataset=H.ListDataset(samples))
    finally:
        logger.removeHandler(caplog.handler)
        hf_gradfix.unpatch()
    assert ours["eval_loss"] == stock["eval_loss"] and "eval_loss_targets" not in ours
    assert any("prediction_step that computes the loss itself" in r.getMessage() for r in caplog.records)
