"""Two configurations on one trainer, and unpatch() when someone else wrapped Trainer.__init__ after us.

The rule (hf_gradfix.integration.patching): a GradFixCallback's configuration wins on its trainer over
patch()'s, with a warning naming every overridden setting; added too late to replace what is already built
(packing, optimizer, mesh), it is an error.
"""

from __future__ import annotations

import logging

import pytest
import transformers
from transformers import Trainer

import harness as H
import hf_gradfix
from hf_gradfix import GradFixCallback, state_of
from hf_gradfix.errors import HfGradfixError, PatchError
from hf_gradfix.integration.callback import GradFixCallbackError
from hf_gradfix.integration.nonfinite import guard_of


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_log():
    handler = _Records()
    logger = logging.getLogger("hf_gradfix")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        hf_gradfix.unpatch()


def _args(**kw):
    return transformers.TrainingArguments(
        output_dir="/tmp/hgf_conflicts", optim="sgd", learning_rate=0.0, max_steps=1, per_device_train_batch_size=2,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, remove_unused_columns=False, **kw,
    )


def _trainer(callbacks=()):
    model = H.build_model("llama", seed=0)
    return Trainer(model=model, args=_args(), train_dataset=H.TokenDataset(H.make_samples("causal", n=4, lo=4, hi=8)),
                   data_collator=_collate, callbacks=list(callbacks))


def _collate(rows):
    import torch

    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "labels": labels}


def test_callback_at_construction_wins_over_patch_with_a_warning(warnings_log):
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}, "loss": {"on_nonfinite": "skip"}})
    callback_config = {"loss": {"count_rule": "shifted"}}
    trainer = _trainer([GradFixCallback(callback_config)])
    state = state_of(trainer)
    assert state.source == "GradFixCallback"
    assert state.config == hf_gradfix.load_config(callback_config)
    assert guard_of(trainer).mode == "warn"  # the winner's on_nonfinite
    [line] = [w for w in warnings_log if "two hf_gradfix configurations" in w]
    for overridden in ("hf_gradfix.packing.enabled=True", "hf_gradfix.packing.token_budget=64",
                       "hf_gradfix.loss.count_rule='auto'", "hf_gradfix.loss.on_nonfinite='skip'"):
        assert overridden in line, line
    assert "GradFixCallback's configuration wins" in line


def test_same_configuration_twice_is_silent(warnings_log):
    hf_gradfix.patch({"loss": {"count_rule": "shifted"}})
    _trainer([GradFixCallback({"loss": {"count_rule": "shifted"}})])
    assert not [w for w in warnings_log if "two hf_gradfix configurations" in w]


def test_callback_added_later_overrides_loss_settings(warnings_log):
    hf_gradfix.patch({"loss": {"on_nonfinite": "skip"}})
    trainer = _trainer()
    assert state_of(trainer).source == "patch()"
    trainer.add_callback(GradFixCallback({"loss": {"on_nonfinite": "error", "count_rule": "shifted"}}))
    trainer.train()
    state = state_of(trainer)
    assert state.source == "GradFixCallback" and state.config.loss.count_rule == "shifted"
    assert guard_of(trainer).mode == "error"
    assert any("hf_gradfix.loss.on_nonfinite='skip'" in w for w in warnings_log)


def test_callback_added_too_late_for_packing_is_an_error(warnings_log):
    hf_gradfix.patch({})
    trainer = _trainer()
    trainer.add_callback(GradFixCallback({"packing": {"enabled": True, "token_budget": 64}}))
    with pytest.raises(GradFixCallbackError, match=r"hf_gradfix.packing.enabled=False.*Pass it at construction") as info:
        trainer.train()
    assert isinstance(info.value, HfGradfixError)


def test_failed_unpatch_keeps_the_bookkeeping_true():
    hf_gradfix.patch()
    ours = Trainer.__init__
    calls = []

    def theirs(self, *args, **kwargs):  # another library wraps Trainer.__init__ after hf_gradfix
        calls.append(1)
        return ours(self, *args, **kwargs)

    Trainer.__init__ = theirs
    try:
        with pytest.raises(PatchError, match="replaced by someone else"):
            hf_gradfix.unpatch()
        assert hf_gradfix.is_patched()  # our wrapper is still called, inside theirs
        hf_gradfix.patch()  # idempotent: no second wrapper
        assert Trainer.__init__ is theirs
        trainer = _trainer()
        assert calls == [1] and state_of(trainer) is not None
    finally:
        Trainer.__init__ = ours  # the other library unpatches
    hf_gradfix.unpatch()
    assert not hf_gradfix.is_patched()
    assert not getattr(Trainer.__init__, "_hf_gradfix_patched", False)
