"""Low-rank optimizers through the Trainer: every entry point, hyper-parameters honoured, GA exact, resume exact.

The reference for every run is a hand-written PyTorch loop over the very micro-batches the Trainer saw (recorded by
the collator): the exact token-mean loss of each optimizer window, and an optimizer built directly from
``hf_gradfix.optim`` with the hyper-parameters written out by hand.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers
import yaml
from transformers import Trainer

import harness as H
import hf_gradfix
from hf_gradfix.integration.callback import GradFixCallbackError
from hf_gradfix.integration.trainer_fix import GradFixError
from hf_gradfix.optim import ApolloAdamW, GaLoreAdamW

TASK = "causal"
HP = dict(learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
OPT = {"name": "galore_adamw", "rank": 4, "update_proj_gap": 2, "proj_method": "svd"}


def _args(tmp, **kw):
    base = dict(
        output_dir=str(tmp), report_to="none", use_cpu=True, dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, save_strategy="no", per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, seed=0, **HP,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer(model, samples, tmp, *, callbacks=(), trainer_kwargs=None, **kw):
    collator = H.RecordingCollator(TASK, H.pad_id_of(model))
    t = Trainer(model=model, args=_args(tmp, **kw), train_dataset=H.ListDataset(samples), data_collator=collator,
                callbacks=list(callbacks), **(trainer_kwargs or {}))
    return t, collator


def _no_decay(model):  # written independently of transformers' rule: biases and norm weights
    return [n for n, _ in model.named_parameters() if "norm" in n or n.endswith("bias")]


def _reference(model0, samples, batches, ga, opt_cls=GaLoreAdamW, hp=HP, **opt_kw):
    """Plain PyTorch: the exact token mean of each window, one optimizer step per window."""
    model = copy.deepcopy(model0)
    opt = opt_cls(model, lr=hp["learning_rate"], betas=(hp["adam_beta1"], hp["adam_beta2"]), eps=hp["adam_epsilon"],
                  weight_decay=hp["weight_decay"], no_decay=_no_decay(model), **opt_kw)
    for w in range(len(batches) // ga):
        window = [samples[i] for b in batches[w * ga:(w + 1) * ga] for i in b]
        total, count = 0.0, 0
        for s in window:
            loss_sum, n = H.sample_loss_sum(model, s, TASK)
            total = total + loss_sum
            count += n
        (total / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pa = torch.cat([p.detach().flatten() for p in a.parameters()])
    pb = torch.cat([p.detach().flatten() for p in b.parameters()])
    return float((pa - pb).norm() / pb.norm())


@pytest.fixture(autouse=True)
def _unpatched():
    hf_gradfix.unpatch()
    yield
    hf_gradfix.unpatch()


def _samples(n=16):
    return H.make_samples(TASK, n=n, seed=0)


def _run(entry, tmp_path, monkeypatch, opt_cfg=OPT, **kw):
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    config = {"optimizer": opt_cfg}
    if entry == "patch":
        hf_gradfix.patch(config)
        trainer, coll = _trainer(model, samples, tmp_path, **kw)
    elif entry == "callback":
        trainer, coll = _trainer(model, samples, tmp_path, callbacks=[hf_gradfix.GradFixCallback(config)], **kw)
    elif entry == "yaml":  # an accelerate config file carrying an hf_gradfix section, named by the environment
        path = tmp_path / "accelerate.yaml"
        path.write_text(yaml.safe_dump({"distributed_type": "NO", "num_processes": 1, "hf_gradfix": config}))
        monkeypatch.setenv("HF_GRADFIX_CONFIG", str(path))
        hf_gradfix.patch()
        trainer, coll = _trainer(model, samples, tmp_path, **kw)
    else:
        raise ValueError(entry)
    trainer.train()
    return model0, model, samples, coll, trainer


@pytest.mark.parametrize("entry", ["patch", "callback", "yaml"])
def test_every_entry_point_trains_with_the_trainers_hyperparameters(entry, tmp_path, monkeypatch):
    model0, model, samples, coll, trainer = _run(entry, tmp_path, monkeypatch)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, GaLoreAdamW)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"]) == (3e-3, (0.8, 0.95), 1e-6)
    assert {grp["weight_decay"] for grp in opt.param_groups} == {0.1, 0.0}
    ref = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, proj_method="svd")
    assert _rel(model, ref) <= 1e-5
    # The comparison can fail: the same loop with torch's default betas/eps and no weight decay ends elsewhere.
    other = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, proj_method="svd",
                       hp={**HP, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8})
    assert _rel(other, ref) > 1e-3


def test_apollo_through_the_config(tmp_path, monkeypatch):
    cfg = {"name": "apollo_adamw", "rank": 4, "update_proj_gap": 2}
    model0, model, samples, coll, trainer = _run("patch", tmp_path, monkeypatch, opt_cfg=cfg)
    ref = _reference(model0, samples, coll.batches, ga=2, opt_cls=ApolloAdamW, rank=4, update_proj_gap=2)
    assert _rel(model, ref) <= 1e-5


def test_gradient_accumulation_equals_one_big_batch(tmp_path, monkeypatch):
    """GA 2 x batch 2 == GA 1 x batch 4 with GaLore (the projection acts on the accumulated gradient)."""
    model0, m_ga, samples, coll, _ = _run("patch", tmp_path / "a", monkeypatch)
    hf_gradfix.unpatch()
    m_big = copy.deepcopy(model0)
    hf_gradfix.patch({"optimizer": OPT})
    # replay the same windows as single micro-batches of 4
    order = [i for b in coll.batches for i in b]

    class Fixed(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(order)

        def __len__(self):
            return len(order)

    trainer, _ = _trainer(m_big, samples, tmp_path / "b", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    trainer._get_train_sampler = lambda *a, **k: Fixed()
    trainer.train()
    assert _rel(m_ga, m_big) <= 1e-5


def test_optimizer_cls_and_kwargs_gets_names_and_hyperparameters(tmp_path):
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    hf_gradfix.patch({})
    trainer, coll = _trainer(model, samples, tmp_path, trainer_kwargs={
        "optimizer_cls_and_kwargs": (GaLoreAdamW, {"rank": 4, "update_proj_gap": 2, "proj_method": "svd"})})
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, GaLoreAdamW)
    assert all("embed" not in n and "lm_head" not in n for n in opt.projected_names)
    ref = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, proj_method="svd")
    assert _rel(model, ref) <= 1e-5


@pytest.mark.parametrize("resume_at", [2, 3])  # 2: the next step refreshes the basis; 3: mid-gap
def test_trainer_checkpoint_resume_continues_exactly(resume_at, tmp_path):
    model0 = H.build_model("llama")
    samples = _samples(24)
    hf_gradfix.patch({"optimizer": {**OPT, "proj_method": "randomized", "on_switch": "reproject"}})
    straight = copy.deepcopy(model0)
    t1, _ = _trainer(straight, samples, tmp_path / "a", max_steps=6)
    t1.train()
    resumed = copy.deepcopy(model0)
    t2, _ = _trainer(resumed, samples, tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=resume_at)
    t2.train()
    ckpt = tmp_path / "b" / f"checkpoint-{resume_at}"
    # the optimizer file loads with weights_only=True (galore-torch's pickled projector does not)
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    again = copy.deepcopy(model0)
    t3, _ = _trainer(again, samples, tmp_path / "b", max_steps=6)
    t3.train(resume_from_checkpoint=str(ckpt))
    assert _rel(again, straight) <= 1e-6


def test_layerwise_galore_with_accumulation_is_refused(tmp_path):
    hf_gradfix.patch({})
    with pytest.raises(GradFixError, match="layerwise.*gradient_accumulation_steps=2"):
        _trainer(H.build_model("llama"), _samples(), tmp_path, optim="galore_adamw_layerwise",
                 optim_target_modules=["attn"])


def test_callback_added_after_construction_with_an_optimizer_is_an_error(tmp_path):
    trainer, _ = _trainer(H.build_model("llama"), _samples(), tmp_path)
    trainer.add_callback(hf_gradfix.GradFixCallback({"optimizer": OPT}))
    with pytest.raises(GradFixCallbackError, match="optimizer.*callbacks=\\[GradFixCallback"):
        trainer.train()


def test_deepspeed_is_refused(tmp_path):
    from hf_gradfix.config import load_config
    from hf_gradfix.integration.optim_trainer import check_optimizer_setup

    trainer, _ = _trainer(H.build_model("llama"), _samples(), tmp_path)
    trainer.is_deepspeed_enabled = True  # what Trainer.__init__ sets when the accelerate config selects DeepSpeed
    with pytest.raises(GradFixError, match="DeepSpeed ZeRO"):
        check_optimizer_setup(trainer, load_config({"optimizer": OPT}).optimizer)
    check_optimizer_setup(trainer, load_config({}).optimizer)  # no low-rank optimizer: nothing to refuse


def test_bad_optimizer_settings_name_the_key(tmp_path):
    with pytest.raises(hf_gradfix.config.ConfigError, match="optimizer.update_proj_gap: invalid value 0"):
        hf_gradfix.patch({"optimizer": {**OPT, "update_proj_gap": 0}})
    hf_gradfix.patch({"optimizer": {**OPT, "targets": ["atn"]}})
    trainer, _ = _trainer(H.build_model("llama"), _samples(), tmp_path)
    with pytest.raises(ValueError, match=r"targets \['atn'\] match no trainable"):
        trainer.train()
    hf_gradfix.unpatch()
    hf_gradfix.patch({"optimizer": {**OPT, "targets": ["q_proj"], "rank": 64}})
    trainer, _ = _trainer(H.build_model("llama"), _samples(), tmp_path)
    with pytest.raises(ValueError, match="rank=64 is not below"):
        trainer.train()


def test_transformers_galore_optim_is_rebuilt_with_every_hyperparameter(tmp_path):
    """optim="galore_adamw" under the plugin: same GaLore settings, but weight decay, betas and eps honoured."""
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    hf_gradfix.patch({})
    trainer, coll = _trainer(model, samples, tmp_path, optim="galore_adamw", optim_target_modules=["attn", "mlp"],
                             optim_args="rank=4,update_proj_gap=2,scale=0.5")
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, GaLoreAdamW)
    assert sorted({n.split(".")[3] for n in opt.projected_names}) == ["mlp", "self_attn"]
    ref = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, scale=0.5, proj_side="std",
                     proj_method="svd", targets=["attn", "mlp"])
    assert _rel(model, ref) <= 1e-5


def test_the_optim_package_imports_neither_transformers_nor_accelerate():
    import subprocess
    import sys

    code = "import sys, hf_gradfix.optim; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_stock_trainer_with_our_optimizer_resumes_exactly(tmp_path):
    """No plugin at all: Trainer(optimizers=(GaLoreAdamW(...), None)) saves a weights_only-loadable state and
    resumes to the uninterrupted result (galore-torch's pickled projector fails here with UnpicklingError)."""
    model0 = H.build_model("llama")
    samples = _samples(24)

    def run(out, resume=None, **kw):
        model = copy.deepcopy(model0)
        opt = GaLoreAdamW(model, lr=3e-3, rank=4, update_proj_gap=2, proj_method="randomized")
        trainer, _ = _trainer(model, samples, out, max_steps=6, trainer_kwargs={"optimizers": (opt, None)}, **kw)
        trainer.train(resume_from_checkpoint=resume)
        return model

    straight = run(tmp_path / "a")
    run(tmp_path / "b", save_strategy="steps", save_steps=3)
    resumed = run(tmp_path / "b", resume=str(tmp_path / "b" / "checkpoint-3"))
    assert _rel(resumed, straight) <= 1e-6
    # and the comparison is not vacuous: resuming without the optimizer state (moments, bases) ends elsewhere
    import shutil

    bare = tmp_path / "c" / "checkpoint-3"
    shutil.copytree(tmp_path / "b" / "checkpoint-3", bare)
    (bare / "optimizer.pt").unlink()
    restarted = run(tmp_path / "c", resume=str(bare))
    assert _rel(restarted, straight) > 1e-4


# ------------------------------------------------------------------------------------------------ low-rank gradients

LOWRANK = {**OPT, "lowrank_grads": True}


def test_lowrank_grads_trainer_ga_equals_full_gradient_galore(tmp_path, monkeypatch):
    """optimizer.lowrank_grads: the Trainer's GA-2 run equals full-gradient GaLore (same staggered refreshes) in a
    hand-written loop; no projected weight keeps a full gradient outside its refresh steps; grad_norm is logged."""
    model0, model, samples, coll, trainer = _run("patch", tmp_path, monkeypatch, opt_cfg=LOWRANK)
    opt = trainer.optimizer.optimizer
    assert opt.lowrank_grads and opt.param_groups[0]["stagger"]
    ref = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, proj_method="svd", stagger=True)
    assert _rel(model, ref) <= 1e-5
    other = _reference(model0, samples, coll.batches, ga=2, rank=4, update_proj_gap=2, proj_method="svd", stagger=False)
    assert _rel(other, ref) > 1e-4  # the staggered schedule matters: the comparison can fail
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if hasattr(trainer, "_get_grad_norm"):  # transformers 5.x logs grad_norm also without clipping (4.57 does not)
        assert len(norms) == 4 and all(n > 0 for n in norms)


def test_noise_scale_callback_refuses_lowrank_grads(tmp_path, monkeypatch):
    """The noise-scale callback's big-batch norm would be the projected one: it stops with the reason and the fix
    at train start; with full gradients the same run measures."""
    from hf_gradfix import GradientNoiseScaleCallback
    from hf_gradfix.integration.diagnostics.gns import GradientNoiseScaleError

    with pytest.raises(GradientNoiseScaleError, match="lowrank_grads: true.*lowrank_grads: false"):
        _run("patch", tmp_path / "low", monkeypatch, opt_cfg=LOWRANK, callbacks=[GradientNoiseScaleCallback()])
    hf_gradfix.unpatch()
    gns = GradientNoiseScaleCallback()
    _run("patch", tmp_path / "full", monkeypatch, opt_cfg=OPT, callbacks=[gns])
    assert gns.history  # measured


def test_lowrank_grads_trainer_clips_the_accumulators(tmp_path, monkeypatch):
    """max_grad_norm with lowrank_grads clips what the optimizer steps on (GaLoreAdamW.clip_grad_norm_): the Trainer's
    run equals a hand-written loop calling it, and differs from clipping only the remaining full gradients."""
    model0, model, samples, coll, trainer = _run("patch", tmp_path, monkeypatch, opt_cfg=LOWRANK, max_grad_norm=0.05)

    def loop(route: bool):
        m = copy.deepcopy(model0)
        opt = GaLoreAdamW(m, lr=HP["learning_rate"], betas=(HP["adam_beta1"], HP["adam_beta2"]), eps=HP["adam_epsilon"],
                          weight_decay=HP["weight_decay"], no_decay=_no_decay(m), rank=4, update_proj_gap=2,
                          proj_method="svd", lowrank_grads=True)
        norms = []
        for w in range(len(coll.batches) // 2):
            window = [samples[i] for b in coll.batches[w * 2:(w + 1) * 2] for i in b]
            count = sum(H.sample_loss_sum(m, s, TASK)[1] for s in window)
            for b in coll.batches[w * 2:(w + 1) * 2]:  # per micro-batch backward: the hooks see each one
                total = sum(H.sample_loss_sum(m, samples[i], TASK)[0] for i in b)
                (total / count).backward()
            if route:
                norms.append(float(opt.clip_grad_norm_(0.05)))
            else:  # the control: only .grad clipped, as a stock Trainer's max_grad_norm does (refused unless declared)
                opt.clipping_routed = True
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, norms

    ref, ref_norms = loop(True)
    assert _rel(model, ref) <= 1e-5
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(logged, ref_norms)) and min(ref_norms) > 0.05
    wrong, _ = loop(False)
    assert _rel(wrong, ref) > 1e-4


@pytest.mark.parametrize("resume_at", [2, 3])
def test_lowrank_grads_trainer_resume_is_exact(resume_at, tmp_path):
    model0 = H.build_model("llama")
    samples = _samples(24)
    hf_gradfix.patch({"optimizer": LOWRANK})
    straight = copy.deepcopy(model0)
    t1, _ = _trainer(straight, samples, tmp_path / "a", max_steps=6, max_grad_norm=1.0)
    t1.train()
    resumed = copy.deepcopy(model0)
    t2, _ = _trainer(resumed, samples, tmp_path / "b", max_steps=6, max_grad_norm=1.0, save_strategy="steps",
                     save_steps=resume_at)
    t2.train()
    ckpt = tmp_path / "b" / f"checkpoint-{resume_at}"
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    again = copy.deepcopy(model0)
    t3, _ = _trainer(again, samples, tmp_path / "b", max_steps=6, max_grad_norm=1.0)
    t3.train(resume_from_checkpoint=str(ckpt))
    assert _rel(again, straight) <= 1e-6


def test_lowrank_grads_refusals_name_the_reason(tmp_path):
    from hf_gradfix.config import load_config
    from hf_gradfix.integration.optim_trainer import check_optimizer_setup

    trainer, _ = _trainer(H.build_model("llama"), _samples(), tmp_path)
    cfg = load_config({"optimizer": LOWRANK}).optimizer
    check_optimizer_setup(trainer, cfg)  # DDP / one process: fine
    trainer.is_fsdp_enabled = True
    with pytest.raises(GradFixError, match="lowrank_grads=true under FSDP"):
        check_optimizer_setup(trainer, cfg)
    trainer.is_fsdp_enabled = False
    from hf_gradfix.config import ConfigError, OptimizerConfig

    with pytest.raises(ConfigError, match="lowrank_grads is GaLore-only"):  # the loader refuses it first
        load_config({"optimizer": {"name": "apollo_adamw", "lowrank_grads": True}})
    with pytest.raises(GradFixError, match="needs optimizer.name: galore_adamw"):  # a config built in code
        check_optimizer_setup(trainer, OptimizerConfig(name="apollo_adamw", lowrank_grads=True))


# ---------------------------------------------------------------- low-rank gradients: the lifecycle of a run (issue 25)

LR_KW = dict(lr=HP["learning_rate"], betas=(HP["adam_beta1"], HP["adam_beta2"]), eps=HP["adam_epsilon"],
             weight_decay=HP["weight_decay"], rank=4, update_proj_gap=2, proj_method="svd", lowrank_grads=True)


def _lowrank_loop(model0, samples, batches, clip: float | None, route: bool = True):
    """Plain PyTorch: per-micro-batch backward of each window's exact token mean, GaLoreAdamW(lowrank_grads=True)
    written out by hand, clipped by the optimizer's own clip_grad_norm_ (``route``) or by torch's (``not route``).
    Returns the model and the norms before clipping."""
    m = copy.deepcopy(model0)
    opt = GaLoreAdamW(m, no_decay=_no_decay(m), **LR_KW)
    norms = []
    for w in range(len(batches) // 2):
        window = batches[w * 2:(w + 1) * 2]
        count = sum(H.sample_loss_sum(m, samples[i], TASK)[1] for b in window for i in b)
        for b in window:  # per micro-batch backward: the hooks see each one
            total = sum(H.sample_loss_sum(m, samples[i], TASK)[0] for i in b)
            (total / count).backward()
        if clip is not None:
            opt.clipping_routed = not route  # the control clips only .grad on purpose (refused unless declared)
            clip_fn = opt.clip_grad_norm_ if route else lambda c: torch.nn.utils.clip_grad_norm_(m.parameters(), c)
            norms.append(float(clip_fn(clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.remove_lowrank_hooks()
    return m, norms


def _hooks_on(model) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def _lowrank_trainer(entry, model, samples, tmp, **kw):
    """A lowrank_grads GaLoreAdamW arriving each way: the config (patch / callback), optimizer_cls_and_kwargs,
    or the constructor's optimizers=(opt, None), under patch() or a GradFixCallback."""
    trainer_kwargs, callbacks = {}, []
    if entry in ("config-patch", "config-callback"):
        cfg = {"optimizer": LOWRANK}
    else:
        cfg = {}
        if entry.startswith("cls"):
            trainer_kwargs["optimizer_cls_and_kwargs"] = (GaLoreAdamW, dict(LR_KW, no_decay=_no_decay(model)))
        else:
            trainer_kwargs["optimizers"] = (GaLoreAdamW(model, no_decay=_no_decay(model), **LR_KW), None)
    if entry.endswith("callback"):
        callbacks.append(hf_gradfix.GradFixCallback(cfg))
    else:
        hf_gradfix.patch(cfg)
    return _trainer(model, samples, tmp, callbacks=callbacks, trainer_kwargs=trainer_kwargs, **kw)


class _Watch(transformers.TrainerCallback):
    """At each optimizer step: whether the low-rank hooks were on and how many accumulators the step consumed."""

    def __init__(self):
        self.seen = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        opt = getattr(optimizer, "optimizer", optimizer)
        self.seen.append((opt.lowrank_hooks_attached, len(opt._lowrank_acc)))


ENTRIES = ["config-patch", "config-callback", "cls-patch", "cls-callback", "ctor-patch", "ctor-callback"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_lowrank_every_way_in_clips_logs_and_lets_go_of_the_model(entry, tmp_path):
    """Issue 25, findings 2 and 3, each way the optimizer arrives: max_grad_norm clips the accumulators and grad_norm
    includes them (the run equals the hand-written loop that calls the optimizer's clip_grad_norm_); after train()
    no hook is left on the model, DDP's ignore list is empty again, the optimizer is not kept alive by the model, and
    a second, plain Trainer on the same model trains every weight exactly like a plain PyTorch AdamW loop.
    Measured before: constructor path stepped on norms 0.14-0.22 (max_grad_norm 0.05) and logged 0.87-1.29 vs
    0.88-1.31; a second trainer left 7 of 21 tensors frozen."""
    import gc
    import weakref

    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    watch = _Watch()
    trainer, coll = _lowrank_trainer(entry, model, samples, tmp_path / "a", max_grad_norm=0.05)
    trainer.add_callback(watch)
    trainer.train()
    assert [s[0] for s in watch.seen] == [True] * 4 and all(n > 0 for _, n in watch.seen[1:])  # accumulating
    ref, ref_norms = _lowrank_loop(model0, samples, coll.batches, clip=0.05)
    assert _rel(model, ref) <= 1e-5
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == 4 and all(abs(a - b) <= 1e-4 * b for a, b in zip(logged, ref_norms)), (logged, ref_norms)
    assert min(ref_norms) > 0.05  # clipping was active at every step
    wrong, _ = _lowrank_loop(model0, samples, coll.batches, clip=0.05, route=False)
    assert _rel(wrong, ref) > 1e-4  # clipping only the full gradients ends elsewhere: the comparison can fail

    # the end of training: the model is free of this optimizer
    assert _hooks_on(model) == 0
    assert not getattr(model, "_ddp_params_and_buffers_to_ignore", [])
    assert not any(getattr(p, "_ddp_ignored", False) for p in model.parameters())
    opt_ref = weakref.ref(trainer.optimizer.optimizer)
    hf_gradfix.unpatch()
    del trainer, watch
    gc.collect()
    assert opt_ref() is None

    # a second, plain Trainer on the same model: every weight trains, exactly as on a copy that never had our hooks,
    # and (transformers 5.x, whose Llama loss is the exact token mean) as plain torch AdamW on the same batches
    start = copy.deepcopy(model)
    second, coll2 = _trainer(model, samples, tmp_path / "b", weight_decay=0.0, optim="adamw_torch")
    second.train()
    clean = copy.deepcopy(start)
    _trainer(clean, samples, tmp_path / "c", weight_decay=0.0, optim="adamw_torch")[0].train()
    assert _rel(model, clean) == 0.0
    frozen = [n for (n, a), (_, b) in zip(model.named_parameters(), start.named_parameters()) if torch.equal(a, b)]
    assert not frozen
    if int(transformers.__version__.split(".")[0]) < 5:
        return  # 4.57 normalizes a Llama loss by unshifted labels (stock's own error, not the plugin's)
    plain = copy.deepcopy(start)
    opt = torch.optim.AdamW(plain.parameters(), lr=HP["learning_rate"], betas=(HP["adam_beta1"], HP["adam_beta2"]),
                            eps=HP["adam_epsilon"], weight_decay=0.0)
    for w in range(4):
        window = [samples[i] for b in coll2.batches[w * 2:(w + 1) * 2] for i in b]
        sums = [H.sample_loss_sum(plain, s, TASK) for s in window]
        (sum(t for t, _ in sums) / sum(n for _, n in sums)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert _rel(model, plain) <= 1e-5


def test_lowrank_second_train_and_an_exception_mid_run(tmp_path):
    """A second train() on the same trainer accumulates low-rank again (the hooks come back at its start), and the
    two calls together equal the hand-written loop over every window they drew; an exception inside the run takes
    the hooks off too (and the dropped half-window leaves no accumulator behind)."""
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    watch = _Watch()
    trainer, coll = _lowrank_trainer("ctor-patch", model, samples, tmp_path, max_steps=2, max_grad_norm=0.05)
    trainer.add_callback(watch)
    trainer.train()
    assert _hooks_on(model) == 0
    first = len(coll.batches)  # accelerate's loader reads one batch ahead: the 4 trained on, then one unused
    trainer.train()
    assert [s[0] for s in watch.seen] == [True] * 4 and watch.seen[3][1] > 0
    assert _hooks_on(model) == 0
    used = coll.batches[:4] + coll.batches[first:first + 4]
    ref, _ = _lowrank_loop(model0, samples, used, clip=0.05)
    assert _rel(model, ref) <= 1e-5
    once, _ = _lowrank_loop(model0, samples, used[:4], clip=0.05)
    assert _rel(once, ref) > 1e-3  # the second call's steps count

    class Boom(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):  # after the first micro-batch's backward
            raise RuntimeError("boom")

    boom = Boom()
    trainer.add_callback(boom)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    opt = trainer.optimizer.optimizer
    assert _hooks_on(model) == 0 and not opt._lowrank_acc and not opt.lowrank_hooks_attached
    trainer.remove_callback(boom)
    model.zero_grad(set_to_none=True)
    trainer.train()  # and it trains again, accumulating
    assert watch.seen[-1] == (True, watch.seen[-1][1]) and watch.seen[-1][1] > 0


@pytest.mark.parametrize("entry", ["ctor-patch", "cls-callback"])
def test_lowrank_resume_through_the_constructor_is_exact(entry, tmp_path):
    """Resume mid-gap with the optimizer from optimizer_cls_and_kwargs or the constructor: equals the straight run."""
    model0 = H.build_model("llama")
    samples = _samples(24)
    straight = copy.deepcopy(model0)
    t1, _ = _lowrank_trainer(entry, straight, samples, tmp_path / "a", max_steps=6, max_grad_norm=0.05)
    t1.train()
    hf_gradfix.unpatch()
    resumed = copy.deepcopy(model0)
    t2, _ = _lowrank_trainer(entry, resumed, samples, tmp_path / "b", max_steps=6, max_grad_norm=0.05,
                             save_strategy="steps", save_steps=3)
    t2.train()
    hf_gradfix.unpatch()
    again = copy.deepcopy(model0)
    t3, _ = _lowrank_trainer(entry, again, samples, tmp_path / "b", max_steps=6, max_grad_norm=0.05)
    t3.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    assert _rel(again, straight) <= 1e-6 and _rel(straight, model0) > 1e-3


def test_stock_trainer_with_a_lowrank_optimizer_refuses_clipping_it_cannot_reach(tmp_path):
    """Without patch() or a GradFixCallback a stock Trainer's max_grad_norm clips .grad only, so from the second step
    Adam would consume unclipped rank-r accumulators: refused at the first step, before any update, naming the fix.
    Control: the same run without clipping trains (one warning that nothing clipped the accumulators); with
    GradFixCallback the clip reaches what the step consumes and it trains."""
    from hf_gradfix.errors import UsageError

    model = H.build_model("llama")
    before = copy.deepcopy(model)
    opt = GaLoreAdamW(model, **LR_KW)
    trainer, _ = _trainer(model, _samples(), tmp_path / "a", trainer_kwargs={"optimizers": (opt, None)},
                          max_grad_norm=0.05)
    with pytest.raises(UsageError, match=r"changed in place between backward and step\(\).*hf_gradfix.patch\(\) or "
                                         r"GradFixCallback.*no update was applied"):
        trainer.train()
    assert _rel(model, before) == 0.0  # refused before the first update
    opt.remove_lowrank_hooks()
    del trainer
    import gc

    gc.collect()
    assert _hooks_on(model) == 0

    unclipped = copy.deepcopy(before)  # control 1: no clipping asked for, nothing to refuse
    opt = GaLoreAdamW(unclipped, **LR_KW)
    trainer, _ = _trainer(unclipped, _samples(), tmp_path / "b", trainer_kwargs={"optimizers": (opt, None)},
                          max_grad_norm=0.0)
    with pytest.warns(RuntimeWarning, match="no clip_grad_norm_ of its own saw.*hf_gradfix.patch\\(\\) or GradFixCallback"):
        trainer.train()
    assert _rel(unclipped, before) > 1e-4
    opt.remove_lowrank_hooks()

    routed = copy.deepcopy(before)  # control 2: the callback routes max_grad_norm to the accumulators
    opt = GaLoreAdamW(routed, **LR_KW)
    trainer, _ = _trainer(routed, _samples(), tmp_path / "c", trainer_kwargs={"optimizers": (opt, None)},
                          callbacks=[hf_gradfix.GradFixCallback()], max_grad_norm=0.05)
    trainer.train()
    assert _rel(routed, before) > 1e-6
    opt.remove_lowrank_hooks()


def _consumed_norms(opt, grads_only=None) -> list:
    """The 2-norm of what each optimizer.step() consumes (plain and refreshing .grad, the rank-r accumulators of the
    others), taken by a step pre-hook from the tensors themselves, before the step reads them; ``grads_only`` gets
    the norm of the .grad part alone (what torch's clip_grad_norm_ sees)."""
    norms = []

    def record(optimizer, args, kwargs):
        tensors = [p.grad for g in optimizer.param_groups for p in g["params"]
                   if p.grad is not None and p not in optimizer._lowrank_acc]
        norms.append(float(torch.nn.utils.get_total_norm(tensors + list(optimizer._lowrank_acc.values()))))
        if grads_only is not None:
            grads_only.append(float(torch.nn.utils.get_total_norm(tensors)))

    opt.register_step_pre_hook(record)
    return norms


@pytest.mark.parametrize("clip", ["issue", "just_above_grad"])
def test_max_grad_norm_bounds_what_every_step_consumes_or_the_run_is_refused(clip, tmp_path, monkeypatch):
    """Issue 50: a lowrank_grads GaLoreAdamW given to a stock Trainer (optimizers=(opt, None)) with max_grad_norm 0.05
    was clipped on step 1 only (every projected weight still held its full gradient), later steps consumed norms of
    0.28-0.39. Ground truth: the norm of what each step consumes, taken from the tensors at the step. Under a
    GradFixCallback every step consumes <= max_grad_norm; without the plugin the run is refused before the first
    update the clip cannot reach, also where torch's clip left .grad unscaled (``just_above_grad``: the threshold
    between the plain gradients' norm and the consumed norm of step 2, which only the caller's max_grad_norm tells).
    Control: both refusals taken out (the bug planted): some step consumes more than max_grad_norm."""
    from hf_gradfix.errors import UsageError
    from hf_gradfix.optim.lowrank import clipping as lowrank

    model0 = H.build_model("llama")

    grads_only = []

    def run(max_grad_norm, *, callbacks=(), name="run"):
        model = copy.deepcopy(model0)
        opt = GaLoreAdamW(model, **LR_KW)
        norms = _consumed_norms(opt, grads_only if name == "measure" else None)
        trainer, _ = _trainer(model, _samples(), tmp_path / name, trainer_kwargs={"optimizers": (opt, None)},
                              callbacks=callbacks, max_grad_norm=max_grad_norm)
        try:
            trainer.train()
            refused = None
        except UsageError as err:
            refused = str(err)
        finally:
            opt.remove_lowrank_hooks()
        return norms, opt._steps_taken(), refused

    if clip == "issue":
        max_grad_norm = 0.05
    else:
        with pytest.warns(RuntimeWarning, match="no clip_grad_norm_ of its own saw"):
            free, _, _ = run(0.0, name="measure")  # unclipped: the consumed norms of each step
        max_grad_norm = (grads_only[1] + free[1]) / 2  # above step 2's .grad norm, below what it consumes
        assert max(free[0], grads_only[1]) < max_grad_norm < free[1], (free, grads_only)
    bound = max_grad_norm * (1 + 1e-5)
    norms, steps, refused = run(max_grad_norm, callbacks=[hf_gradfix.GradFixCallback()], name="routed")
    assert refused is None and steps == 4 and len(norms) == 4 and max(norms) <= bound, norms
    norms, steps, refused = run(max_grad_norm, name="stock")
    assert refused is not None and "\n" not in refused and "no update was applied" in refused, refused
    assert all(n <= bound for n in norms[:steps]) and len(norms) == steps + 1  # the refused step applied nothing
    monkeypatch.setattr(lowrank, "_callers_max_grad_norm", lambda: None)  # planted: no refusal at all
    monkeypatch.setattr(GaLoreAdamW, "_refuse_outside_clipping", lambda self: None)
    with pytest.warns(RuntimeWarning, match="no clip_grad_norm_ of its own saw"):
        norms, steps, refused = run(max_grad_norm, name="planted")
    assert refused is None and steps == 4 and max(norms) > bound, norms


def test_a_second_lowrank_optimizer_takes_the_hooks_over():
    """Two lowrank_grads optimizers on one model: the newer one owns the hooks (the older one's would project and
    free the same gradients); dropping an optimizer drops its hooks."""
    import gc

    model = H.build_model("llama")
    first = GaLoreAdamW(model, **LR_KW)
    n = _hooks_on(model)
    second = GaLoreAdamW(model, **LR_KW)
    assert _hooks_on(model) == n and not first.lowrank_hooks_attached and second.lowrank_hooks_attached
    del second
    gc.collect()
    assert _hooks_on(model) == 0


@pytest.mark.parametrize("entry", ["config-patch", "ctor-patch"])
def test_verify_trainer_on_a_lowrank_run_then_train(entry, tmp_path):
    """verify_trainer checks the gradient as formed (full gradients for its steps, said in a note; before: step 2
    reported NOT EXACT, 0.29, the projected weights' gradient being in the accumulators); the trainer then trains,
    accumulating low-rank again, exactly like the hand-written loop."""
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    trainer, coll = _lowrank_trainer(entry, model, samples, tmp_path, max_grad_norm=0.05)
    report = hf_gradfix.verify_trainer(trainer, steps=2)
    assert report.exact and any("lowrank_grads=True) took full gradients" in n for n in report.notes)
    assert _hooks_on(model) == 0 and _rel(model, model0) == 0.0  # verify put the weights back
    watch = _Watch()
    trainer.add_callback(watch)
    start = len(coll.batches)
    trainer.train()
    assert [s[0] for s in watch.seen] == [True] * 4 and all(n > 0 for _, n in watch.seen[1:])
    ref, _ = _lowrank_loop(model0, samples, coll.batches[start:start + 8], clip=0.05)
    assert _rel(model, ref) <= 1e-5


@pytest.mark.parametrize("name,opt_cls", [("galore_adamw", GaLoreAdamW), ("apollo_adamw", ApolloAdamW)])
def test_lean_head_with_a_low_rank_optimizer_is_exact(name, opt_cls, tmp_path):
    """loss.head: lean beside GaLore / APOLLO (issue 40): lean on every micro-batch, and the weights after 4 windows
    are plain PyTorch's (stock head, exact token mean per window, the same optimizer)."""
    from hf_gradfix.integration.state import state_of

    cfg = {"name": name, "rank": 4, "update_proj_gap": 2, **({"proj_method": "svd"} if name == "galore_adamw" else {})}
    model0 = H.build_model("llama")
    model = copy.deepcopy(model0)
    samples = _samples()
    hf_gradfix.patch({"optimizer": cfg, "loss": {"head": "lean"}})
    trainer, coll = _trainer(model, samples, tmp_path)
    trainer.train()
    lean = state_of(trainer).lean
    assert lean is not None and lean.calls == 8 and lean.stock_calls == 0, lean
    kw = {k: v for k, v in cfg.items() if k != "name"}
    assert _rel(model, _reference(model0, samples, coll.batches, ga=2, opt_cls=opt_cls, **kw)) <= 1e-5
