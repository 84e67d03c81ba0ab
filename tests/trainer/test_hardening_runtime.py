"""Runtime silent acceptances of issue 26, each now an error or one warning: packing an empty dataset,
``packing.guard: false``, ``patch()`` after a Trainer was built, ``add_callback`` of a packing callback after
construction, a truncated streaming-packer state file in a checkpoint, and the packing fix-log line."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
import transformers
from transformers import Trainer

import harness as H
import hf_gradfix
from hf_gradfix.errors import UsageError
from hf_gradfix.integration.callback import GradFixCallbackError

BUDGET = 64


def _args(out, **kw):
    base = dict(output_dir=str(out), optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=1,
                per_device_train_batch_size=1, max_steps=1, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=3, remove_unused_columns=False)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _dataset(n=8):
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]}
            for s in H.make_samples("causal", n=n, seed=0, lo=2, hi=30, prompt_mask_frac=0.3)]
    return datasets.Dataset.from_list(rows)


def test_packing_an_empty_dataset_is_an_error_not_zero_steps(tmp_path):
    empty = datasets.Dataset.from_dict({"input_ids": [], "labels": []})
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET}})
    try:
        with pytest.raises(UsageError, match="the train dataset is empty"):
            Trainer(model=H.build_model("llama", attn_implementation="sdpa"), args=_args(tmp_path),
                    train_dataset=empty).train()
    finally:
        hf_gradfix.unpatch()


def test_guard_off_warns_once_and_the_fix_line_reads_right(tmp_path, caplog):
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": "rows", "guard": False}})
    try:
        with caplog.at_level(logging.INFO, logger="hf_gradfix"):
            Trainer(model=H.build_model("llama", attn_implementation="sdpa"), args=_args(tmp_path),
                    train_dataset=_dataset()).train()
    finally:
        hf_gradfix.unpatch()
    text = caplog.text
    assert text.count("packing.guard is false") == 1, text
    assert "rows rows" not in text and "packing: rows mode, rows of <= 64 tokens" in text, text


def test_patch_after_a_trainer_was_built_warns(tmp_path):
    stock = Trainer(model=H.build_model("llama", attn_implementation="sdpa"), args=_args(tmp_path),
                    train_dataset=_dataset())
    try:
        with pytest.warns(UserWarning, match=r"after 1 Trainer\(s\) \(Trainer\) were built; those stay stock"):
            hf_gradfix.patch()
    finally:
        hf_gradfix.unpatch()
    assert hf_gradfix.state_of(stock) is None


def test_add_callback_with_packing_after_construction_is_refused_before_any_batch(tmp_path):
    trainer = Trainer(model=H.build_model("llama", attn_implementation="sdpa"), args=_args(tmp_path),
                      train_dataset=_dataset())
    trainer.add_callback(hf_gradfix.GradFixCallback({"packing": {"enabled": True, "token_budget": BUDGET}}))
    with pytest.raises(GradFixCallbackError, match="add_callback after the Trainer was built"):
        trainer.train()


def test_truncated_stream_state_falls_back_to_replay_and_names_the_file(tmp_path, caplog):
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]}
            for s in H.make_samples("causal", n=40, seed=2, lo=2, hi=30, prompt_mask_frac=0.3)]
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=2)

    def train(max_steps, resume=None):
        model = H.build_model("llama", attn_implementation="sdpa")
        args = _args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=stream)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 8}})
    try:
        train(2)
        state_file = tmp_path / "checkpoint-2" / "hf_gradfix_stream_rank0.pt"
        data = state_file.read_bytes()
        state_file.write_bytes(data[: len(data) // 2])  # a copy cut short (disk full, interrupted sync): not the
        with pytest.raises(UsageError, match="hf_gradfix_stream_rank0.pt holds"):  # file its save wrote
            train(4, resume=str(tmp_path / "checkpoint-2"))
        state_file.write_bytes(b"\0" * len(data))  # whole in size, unreadable (bit rot): the loader's fallback
        with caplog.at_level(logging.WARNING, logger="hf_gradfix"):
            resumed = train(4, resume=str(tmp_path / "checkpoint-2"))
    finally:
        hf_gradfix.unpatch()
    assert resumed.state.global_step == 4
    assert "cannot read the stream state" in caplog.text and str(state_file) in caplog.text, caplog.text


def test_a_count_rule_the_loss_contradicts_is_refused_before_the_first_step(tmp_path):
    """loss.count_rule: unshifted on a causal LM (its loss sums the shifted targets) would divide each window by the
    wrong count; the probe measures the model's rule and the contradiction is one line naming both and the fix.
    Controls: the rule it measures, set explicitly, trains; so does auto."""
    from hf_gradfix import GradFixError

    for rule, refused in (("unshifted", True), ("shifted", False), ("auto", False)):
        hf_gradfix.patch({"loss": {"count_rule": rule}})
        try:
            trainer = Trainer(model=H.build_model("llama", attn_implementation="sdpa"), args=_args(tmp_path / rule),
                              train_dataset=_dataset())
            if refused:
                with pytest.raises(GradFixError, match=r"hf_gradfix.loss.count_rule: 'unshifted', but .* measurably sums "
                                                       r"shifted targets.*set count_rule: shifted"):
                    trainer.train()
                assert trainer.state.global_step == 0
            else:
                trainer.train()
                assert trainer.state.global_step == 1
        finally:
            hf_gradfix.unpatch()
