"""loss.on_nonfinite: a NaN loss in one micro-batch, in each mode, against ground truths.

- skip: the weights and the optimizer state after the bad step are bit-equal to those before it (and the lr
  schedule did not move); training goes on finite;
- warn: a warning naming the step and the micro-batch, and otherwise exactly stock transformers (bit-equal
  weights, NaN included, to an unpatched run);
- error: NonFiniteError naming step and micro-batch, raised before the update;
- the low-rank optimizers honour the same setting in a plain loop (GaLore applies no NaN update in skip mode).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from torch.utils.data import SequentialSampler
from transformers import Trainer

import hf_gradfix
from hf_gradfix.errors import HfGradfixError, NonFiniteError
from hf_gradfix.integration.diagnostics.nonfinite import NonFiniteWarning
from hf_gradfix.optim import ApolloAdamW, GaLoreAdamW

import harness as H
from multiproc import run_launch, torchrun, worker_env

MARK = 3  # token id never drawn by make_samples for causal LM: the sample that carries it gets a NaN forward


class _InOrder(Trainer):
    """Sequential batches, so we know which micro-batch of which step carries the marked sample."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def _samples():
    samples = H.make_samples("causal", n=8, seed=0, lo=4, hi=12)
    samples[3]["input_ids"] = [MARK] + list(samples[3]["input_ids"][1:])  # step 2, micro-batch 2 (batch 1, ga 2)
    return samples


def _poison(model):
    emb = model.get_input_embeddings()

    def hook(module, args, output):
        if (args[0] == MARK).any():
            return output * float("nan")
        return output

    return emb.register_forward_hook(hook)


class _Snapshots:
    """A callback: parameters, optimizer state and lr after every optimizer step (clones)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.trainer = None

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        opt = self.trainer.optimizer
        inner = getattr(opt, "optimizer", opt)
        self.steps.append({
            "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "state": copy.deepcopy({i: dict(s) for i, s in enumerate(inner.state.values())}),
            "lr": [g["lr"] for g in inner.param_groups],
        })


def _run(config=None, optim="adamw_torch", patched=True):
    model = H.build_model("llama", seed=0)
    handle = _poison(model)
    snaps = _Snapshots()
    args = transformers.TrainingArguments(
        output_dir="/tmp/hgf_nonfinite", optim=optim, learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=0.0,
        gradient_accumulation_steps=2, per_device_train_batch_size=1, max_steps=4, logging_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, seed=3, remove_unused_columns=False,
    )
    if patched:
        hf_gradfix.patch(config or {})
    try:
        trainer = _InOrder(model=model, args=args, train_dataset=H.TokenDataset(_samples()), callbacks=[snaps])
        snaps.trainer = trainer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        if patched:
            hf_gradfix.unpatch()
        handle.remove()
    _LAST_WARNINGS[:] = caught
    return snaps.steps, [w for w in caught if issubclass(w.category, NonFiniteWarning)]


_LAST_WARNINGS: list = []


def _bit_equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _bit_equal(x, y):
                return False
        elif torch.is_tensor(x):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(torch.nan_to_num(x, nan=7.25), torch.nan_to_num(y, nan=7.25)) \
                    or not torch.equal(x.isnan(), y.isnan()):
                return False
        elif x != y:
            return False
    return True


def _finite(snapshot: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in snapshot["params"].values())


@pytest.mark.parametrize("optim_section", [{}, {"name": "galore_adamw", "rank": 4, "update_proj_gap": 1, "min_size": 1}])
def test_skip_leaves_weights_and_optimizer_state_bit_equal(optim_section):
    steps, caught = _run({"loss": {"on_nonfinite": "skip"}, "optimizer": optim_section})
    assert len(steps) == 4
    assert _finite(steps[0]) and _bit_equal(steps[1]["params"], steps[0]["params"])
    assert _bit_equal(steps[1]["state"], steps[0]["state"]), "optimizer state moved on a skipped step"
    assert steps[1]["lr"] == steps[0]["lr"], "the lr schedule advanced on a skipped step"
    assert _finite(steps[2]) and not _bit_equal(steps[2]["params"], steps[1]["params"])  # training goes on
    assert len(caught) == 1 and "optimizer step 2" in str(caught[0].message) and "micro-batch 2 of 2" in str(caught[0].message)


@pytest.mark.parametrize("mode", ["warn", "skip"])
def test_the_guard_leaves_the_lr_schedulers_step_wrapper_alone(mode):
    """torch's LR scheduler warns "optimizer.step() has been overridden" when its wrapper on the optimizer is gone;
    the guard (on in every patched run) used to remove it at every optimizer step, and the skip mode for good."""
    _, caught = _run({"loss": {"on_nonfinite": mode}})
    assert caught  # the guard saw the NaN step (warn: also the NaN steps after it)
    overridden = [str(w.message) for w in _LAST_WARNINGS if "has been overridden" in str(w.message)]
    assert not overridden, overridden


def test_warn_is_stock_behaviour_with_a_warning_naming_step_and_micro_batch():
    stock, none_caught = _run(patched=False)
    steps, caught = _run({"loss": {"enabled": False, "on_nonfinite": "warn"}})
    assert not none_caught
    assert not _finite(stock[1])  # stock transformers: every weight NaN after the bad step
    for ours, theirs in zip(steps, stock, strict=True):
        assert _bit_equal(ours["params"], theirs["params"]) and _bit_equal(ours["state"], theirs["state"])
    assert len(caught) >= 1
    message = str(caught[0].message)
    assert "optimizer step 2" in message and "micro-batch 2 of 2" in message and "on_nonfinite: skip" in message


def test_error_stops_before_the_update_naming_step_and_micro_batch():
    model_steps = []
    with pytest.raises(NonFiniteError, match=r"optimizer step 2: non-finite loss in micro-batch 2 of 2") as info:
        model_steps, _ = _run({"loss": {"on_nonfinite": "error"}})
    assert isinstance(info.value, HfGradfixError)


def test_bad_on_nonfinite_value_is_a_config_error():
    with pytest.raises(hf_gradfix.ConfigError, match=r"loss.on_nonfinite: invalid value 'skipp'.*did you mean 'skip'"):
        hf_gradfix.load_config({"loss": {"on_nonfinite": "skipp"}})


def _plain_loop_state(opt_cls, mode, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 4))
    opt = opt_cls(model, lr=1e-2, rank=2, update_proj_gap=1, min_size=1, on_nonfinite=mode, **kw)
    x = torch.randn(8, 16)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    model[0].weight.grad[0, 0] = float("nan")
    before = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    return model, opt, before


@pytest.mark.parametrize("opt_cls", [GaLoreAdamW, ApolloAdamW])
def test_low_rank_optimizers_honour_on_nonfinite(opt_cls):
    model, opt, (params, state) = _plain_loop_state(opt_cls, "skip")
    with pytest.warns(RuntimeWarning, match="update skipped"):
        opt.step()
    assert _bit_equal({k: v for k, v in model.state_dict().items()}, params)
    assert _bit_equal(opt.state_dict()["state"], state["state"])

    model, opt, _ = _plain_loop_state(opt_cls, "error")
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        opt.step()

    model, opt, _ = _plain_loop_state(opt_cls, "warn")  # stock: the NaN update is applied, with a warning
    with pytest.warns(RuntimeWarning, match="on_nonfinite='skip'"):
        opt.step()
    assert not bool(torch.isfinite(model[0].weight).all())


@pytest.mark.parametrize("opt_cls", [GaLoreAdamW, ApolloAdamW])
def test_low_rank_optimizers_take_huge_finite_gradients_as_finite(opt_cls):
    """Gradients of 3e38 are finite although their 2-norm overflows to inf (the fast first pass): the max-abs pass
    settles it, so on_nonfinite='error' steps; the NaN of the same loop (the control) still stops it."""
    model, opt, _ = _plain_loop_state(opt_cls, "error")
    model[0].weight.grad.fill_(3e38)
    assert not torch.isfinite(torch.linalg.vector_norm(model[0].weight.grad))  # the 2-norm does overflow
    opt.step()
    model, opt, _ = _plain_loop_state(opt_cls, "error")
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        opt.step()


def test_low_rank_optimizer_range_checks():
    model = torch.nn.Sequential(torch.nn.Linear(16, 12))
    for kw, match in (({"scale": float("inf")}, "scale"), ({"seed": 2**70}, "seed"), ({"on_nonfinite": "nope"}, "on_nonfinite")):
        with pytest.raises(HfGradfixError, match=match):
            GaLoreAdamW(model, rank=2, **kw)


@pytest.mark.distributed
def test_two_ranks_agree_to_skip_when_one_rank_sees_a_nan(tmp_path):
    """Only rank 1 sees the NaN loss: both ranks skip the same step and stay bit-equal to before it."""
    import json

    proc = run_launch(torchrun(H.TESTS_DIR / "nonfinite_worker.py", tmp_path), env=worker_env(), step="nonfinite_worker.py launch")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["same_as_previous"] == [True, False] and r["finite"] == [True, True, True], r
        assert len(r["warnings"]) == 1 and "optimizer step 2" in r["warnings"][0]
    assert "micro-batch 2 of 2" in r1["warnings"][0]  # the rank that saw it names the micro-batch
    assert "another rank had a non-finite loss" in r0["warnings"][0]  # rank 0's own losses were finite


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_guard_leaves_the_callback_list_as_stock_builds_it(disable_tqdm, tmp_path):
    """transformers' test_trainer_callback.py asserts the exact callback list (default callbacks, a custom one given
    at construction, PrinterCallback without tqdm): patched, the list is stock's, and the guard still runs (it raises
    on the poisoned step under on_nonfinite: error, the control that it is attached)."""
    from hf_gradfix.integration.internal_callbacks import internal_callbacks
    from hf_gradfix.integration.diagnostics.nonfinite import guard_of

    class Custom(transformers.TrainerCallback):
        pass

    def build():
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=disable_tqdm, max_steps=4,
            save_strategy="no", gradient_accumulation_steps=2, per_device_train_batch_size=1, seed=3,
            remove_unused_columns=False)
        return _InOrder(model=H.build_model("llama", seed=0), args=args, train_dataset=H.TokenDataset(_samples()),
                        callbacks=[Custom()])

    def names(trainer):
        return sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks)

    stock = names(build())
    hf_gradfix.patch({"loss": {"on_nonfinite": "error"}})
    try:
        trainer = build()
        assert names(trainer) == stock
        guard = guard_of(trainer)
        assert guard is not None and guard in internal_callbacks(trainer)
        _poison(trainer.model)
        with pytest.raises(NonFiniteError):
            trainer.train()
    finally:
        hf_gradfix.unpatch()


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "control-not-replayed"])
@pytest.mark.parametrize("way_in", ["patch", "callback"])
def test_handlers_get_on_train_begin_on_a_callback_handler_a_subclass_replaces(way_in, replay, tmp_path, monkeypatch):
    """hf_gradfix's own handlers (the DeepSpeed checks link the engine and check clipping in on_train_begin) on a
    Trainer subclass that builds a new callback handler after super().__init__: the run's on_train_begin reaches
    them once, with the run's state, before its first optimizer step. Control: without the replay the guard's
    training_step only re-wraps the new handler, and on_train_begin is missed (the assertion must fail)."""
    from transformers.trainer_callback import CallbackHandler

    from hf_gradfix.integration.diagnostics import nonfinite
    from hf_gradfix.integration.internal_callbacks import add_internal_callback

    class Recorder:
        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append(("on_train_begin", state))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.events.append(("on_pre_optimizer_step", state))

    recorder = Recorder()

    class NewHandler(_InOrder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            add_internal_callback(self, recorder)  # as the DeepSpeed checks are, before the subclass's rebuild
            old = self.callback_handler
            self.callback_handler = CallbackHandler(old.callbacks, self.model, self.processing_class, self.optimizer,
                                                    self.lr_scheduler)

    if not replay:
        real = nonfinite.add_internal_callback
        monkeypatch.setattr(nonfinite, "add_internal_callback", lambda trainer, callback, **kw: real(trainer, callback))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2, save_strategy="no",
        gradient_accumulation_steps=2, per_device_train_batch_size=1, seed=3, remove_unused_columns=False,
        disable_tqdm=True)
    if way_in == "patch":
        hf_gradfix.patch()
    try:
        callbacks = [hf_gradfix.GradFixCallback()] if way_in == "callback" else []
        trainer = NewHandler(model=H.build_model("llama", seed=0), args=args, train_dataset=H.TokenDataset(_samples()),
                             callbacks=callbacks)
        states = []
        for _ in range(2):  # a second train() on the same trainer: its own state, its own on_train_begin, once
            trainer.train()
            states.append(trainer.state)
    finally:
        if way_in == "patch":
            hf_gradfix.unpatch()
    seen = [(event, next(i for i, s in enumerate(states) if s is state)) for event, state in recorder.events]
    run = [("on_train_begin", 0), ("on_pre_optimizer_step", 0), ("on_pre_optimizer_step", 0)]
    second = [(event, 1) for event, _ in run]  # by then the new handler is wrapped: dispatched, not replayed
    if replay:
        assert seen == run + second
    else:
        assert seen == run[1:] + second


@pytest.mark.parametrize("way_in", ["patch", "callback"])
def test_the_guard_follows_a_callback_handler_a_subclass_replaces(way_in, tmp_path):
    """A Trainer subclass that builds a new callback handler from the old one's list after super().__init__ (as TRL's
    experimental BEMA DPOTrainer does): the guard still runs on the new handler (on_nonfinite: error raises at the
    poisoned step), by either way in; the callback list stays the user's."""
    from transformers.trainer_callback import CallbackHandler

    class NewHandler(_InOrder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            old = self.callback_handler
            self.callback_handler = CallbackHandler(old.callbacks, self.model, self.processing_class, self.optimizer,
                                                    self.lr_scheduler)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=4, save_strategy="no",
        gradient_accumulation_steps=2, per_device_train_batch_size=1, seed=3, remove_unused_columns=False,
        disable_tqdm=True)
    config = {"loss": {"on_nonfinite": "error"}}
    model = H.build_model("llama", seed=0)
    handle = _poison(model)
    if way_in == "patch":
        hf_gradfix.patch(config)
    try:
        callbacks = [hf_gradfix.GradFixCallback(config)] if way_in == "callback" else []
        trainer = NewHandler(model=model, args=args, train_dataset=H.TokenDataset(_samples()), callbacks=callbacks)
        assert not any(type(cb).__name__ == "NonFiniteGuard" for cb in trainer.callback_handler.callbacks)
        with pytest.raises(NonFiniteError):
            trainer.train()
    finally:
        if way_in == "patch":
            hf_gradfix.unpatch()
        handle.remove()
