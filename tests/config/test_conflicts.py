"""Settings from several sources on one trainer, and unpatch() when someone else wrapped Trainer.__init__ after us.

The rule (hf_gradfix.config.sources): $HF_GRADFIX_CONFIG (the launch file's section), patch(config) and
GradFixCallback(config) each set the keys they name and keep the others'; a key two of them set to different values
is refused in one line naming both sources; the start line names the sources. A callback added too late to change
what is already built (packing, optimizer, mesh) is an error.
"""

from __future__ import annotations

import logging

import pytest
import transformers
from transformers import Trainer

import harness as H
import hf_gradfix
from hf_gradfix import GradFixCallback, state_of
from hf_gradfix.config import ConfigError
from hf_gradfix.errors import HfGradfixError, PatchError
from hf_gradfix.integration.callback import GradFixCallbackError
from hf_gradfix.integration.diagnostics.nonfinite import guard_of


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


def test_patch_and_callback_settings_combine(warnings_log):
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}, "loss": {"on_nonfinite": "skip"}})
    callback_config = {"loss": {"count_rule": "shifted"}}
    trainer = _trainer([GradFixCallback(callback_config)])
    state = state_of(trainer)
    assert state.config == hf_gradfix.load_config(
        {"packing": {"enabled": True, "token_budget": 64}, "loss": {"on_nonfinite": "skip", "count_rule": "shifted"}})
    assert state.settings_from == "patch(dict) + GradFixCallback(dict)"
    assert guard_of(trainer).mode == "skip"  # patch()'s on_nonfinite, kept
    assert not warnings_log


def test_a_key_set_twice_to_different_values_is_refused_naming_both(warnings_log):
    hf_gradfix.patch({"loss": {"on_nonfinite": "skip"}})
    with pytest.raises(ConfigError) as info:
        GradFixCallback({"loss": {"on_nonfinite": "error"}})
    line = str(info.value)
    assert "\n" not in line
    assert "hf_gradfix.loss.on_nonfinite" in line and "'skip' by patch(dict)" in line
    assert "'error' by GradFixCallback(dict)" in line


def test_same_configuration_twice_is_silent(warnings_log):
    hf_gradfix.patch({"loss": {"count_rule": "shifted"}})
    trainer = _trainer([GradFixCallback({"loss": {"count_rule": "shifted"}})])
    assert state_of(trainer).config.loss.count_rule == "shifted"
    assert not warnings_log


def test_callback_added_later_adds_loss_settings(warnings_log):
    hf_gradfix.patch({"loss": {"on_nonfinite": "skip"}})
    trainer = _trainer()
    assert state_of(trainer).source == "patch()"
    trainer.add_callback(GradFixCallback({"loss": {"count_rule": "shifted"}}))
    trainer.train()
    state = state_of(trainer)
    assert state.config.loss.count_rule == "shifted" and state.config.loss.on_nonfinite == "skip"
    assert guard_of(trainer).mode == "skip"


def _launch_env(monkeypatch, tmp_path, section):
    """What `hf-gradfix launch --config_file F` leaves every rank: the section in a file named by $HF_GRADFIX_CONFIG,
    and the launch file's name."""
    import yaml

    path = tmp_path / "section.yaml"
    path.write_text(yaml.safe_dump({"hf_gradfix": section}))
    monkeypatch.setenv("HF_GRADFIX_CONFIG", str(path))
    monkeypatch.setenv("HF_GRADFIX_CONFIG_ORIGIN", "configs/cpu_pp.yaml")


def test_patch_dict_keeps_the_launch_files_mesh(warnings_log, monkeypatch, tmp_path):
    """The launch file's pp 2 and a script's patch({"packing": ...}) combine: the mesh is kept (not silently dropped
    for plain DDP), and the combination meets the refusal of packing under pp."""
    from hf_gradfix.parallel.pipeline import check_combination

    _launch_env(monkeypatch, tmp_path, {"parallel": {"pp": 2, "dp_shard": 1}})
    cfg = hf_gradfix.patch({"packing": {"enabled": True}})
    assert cfg.parallel.pp == 2 and cfg.packing.enabled
    trainer_free = cfg.parallel
    with pytest.raises(HfGradfixError, match=r"packing"):
        check_combination(pp=trainer_free.pp, tp=1, cp=1, dp_shard=1, packing=cfg.packing.enabled, optimizer="none",
                          fsdp_plugin=False, optimizer_key="optimizer.name")


def test_patch_dict_that_changes_the_launch_files_mesh_is_refused(warnings_log, monkeypatch, tmp_path):
    _launch_env(monkeypatch, tmp_path, {"parallel": {"pp": 2}})
    with pytest.raises(ConfigError, match=r"hf_gradfix\.parallel\.pp: set to 2 by hf-gradfix launch --config_file "
                                          r"configs/cpu_pp\.yaml and to 1 by patch\(dict\)"):
        hf_gradfix.patch({"parallel": {"pp": 1}})
    assert not hf_gradfix.is_patched()


def test_settings_from_is_in_the_start_line(monkeypatch, tmp_path):
    _launch_env(monkeypatch, tmp_path, {"loss": {"on_nonfinite": "skip"}})
    handler = _Records()
    handler.setLevel(logging.INFO)
    logger = logging.getLogger("hf_gradfix")
    logger.addHandler(handler)
    try:
        hf_gradfix.patch({"loss": {"count_rule": "shifted"}})
        _trainer().train()
    finally:
        logger.removeHandler(handler)
        hf_gradfix.unpatch()
    [line] = [m for m in handler.lines if "settings from:" in m]
    assert "settings from: hf-gradfix launch --config_file configs/cpu_pp.yaml + patch(dict)" in line


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
