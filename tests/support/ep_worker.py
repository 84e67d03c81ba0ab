"""Expert-parallel worker (gloo on CPU, 2 processes): cases in sequence inside ONE torch.distributed.run launch.

Run (normally through ``test_ep.py``)::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/ep_worker.py --out DIR --cases patched,stock,...

Every case builds the tiny Qwen3-MoE of ``harness.build_moe`` (6 experts, top-2, 2 layers, router aux coef 0.5; same
seed on every rank), shards it with transformers' own expert parallelism as a user would load it
(``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"))``
on a checkpoint saved by rank 0: 3 whole experts per rank, dense modules FSDP2 over the 2 ranks), trains a
``transformers.Trainer`` with SGD lr 0, bs 2, GA 2 on 16 samples (the short ones on rank 0, the long ones on rank 1:
unequal tokens per rank and per expert) and records at each ``on_pre_optimizer_step`` the FULL gradient (DTensor
shards gathered with ``full_tensor()``, expert shards included). Rank r writes ``DIR/<case>/rank{r}.pt``.

Cases: ``patched`` (``hf_gradfix.patch``, ``loss.aux_loss: micro``), ``config_ep`` (the plain model given to the
Trainer, ``parallel: {dp_shard: 2, ep: 2}`` in the section: hf_gradfix has transformers shard it), ``stock`` (no hf_gradfix), ``unscaled`` (stock,
the expert modules' gradient divide factor set to 1: what an expert gradient that is not averaged over the data
ranks gives), ``unscaled_refused`` (the same model under hf_gradfix: must be refused before training). ``ep_resume``,
``config_ep_resume``, ``ep_resume_refused``: checkpoint resume under ep (AdamW lr 1e-2; :func:`run_resume_case`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import harness  # noqa: E402
import multiproc  # noqa: E402

N_SAMPLES = 16
COEF = 0.5


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_sizes(model) -> dict:
    """This rank's share of the sharded model, routed experts (``.mlp.experts.``) apart from the rest: elements of
    ``p.to_local()`` / ``p.grad.to_local()``, FSDP2's padded shard sizes, and the bytes of the storages (a gradient
    storage is the reduce-scatter output of an FSDP2 unit, counted once). For tests/parallel/test_ep.py's planner check."""
    from torch.distributed.tensor import DTensor

    keys = ("param_numel", "param_storage_bytes", "fsdp_padded_numel", "grad_numel", "grad_storage_bytes")
    out = {k: {"experts": 0, "dense": 0} for k in keys}
    seen: set = set()
    group_of = {id(p): "experts" if ".mlp.experts." in n else "dense" for n, p in model.named_parameters()}
    states = {}  # FSDP2's own record of each shard's padded size (FSDPParam); one state may serve several modules
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):
            states.setdefault(id(module._get_fsdp_state()), module._get_fsdp_state())
    for state in states.values():
        for g in state._fsdp_param_groups:
            for fp in g.fsdp_params:
                out["fsdp_padded_numel"][group_of[id(fp.sharded_param)]] += fp.padded_sharded_param_size.numel()
    for name, p in model.named_parameters():
        group = group_of[id(p)]
        for kind, t in (("param", p), ("grad", p.grad)):
            if t is None:
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            out[f"{kind}_numel"][group] += local.numel()
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[f"{kind}_storage_bytes"][group] += storage.nbytes()
    return out


def _recorder():
    from transformers import TrainerCallback

    class FullGradRecorder(TrainerCallback):
        def __init__(self):
            self.trainer, self.collator, self.steps, self._seen = None, None, [], 0

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            tr = self.trainer
            if not self.steps:  # the first window's gradients, before any optimizer step
                self.local_sizes = _local_sizes(tr.model)
            n = tr._hgf_consumed
            batches, self._seen = self.collator.batches[self._seen : n], n
            grads = {}
            for name, p in tr.model.named_parameters():  # a collective: every rank gathers every shard
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                grads[name] = _full(g).detach().clone().cpu()
            self.steps.append(dict(idx_batches=[list(b) for b in batches], grads=grads))

    return FullGradRecorder()


def load_ep_model(out: Path, rank: int, world: int, config=None):
    """The tiny Qwen3-MoE, saved by rank 0 and loaded by every rank with transformers' expert parallelism
    (``config``: a ``DistributedConfig``; default ep = fsdp = world)."""
    import transformers as tf
    from transformers.distributed import DistributedConfig

    model = harness.build_moe("qwen3_moe", coef=COEF)
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = out / "checkpoint"
    if rank == 0 and not (path / "config.json").exists():
        model.save_pretrained(path)
    torch.distributed.barrier()
    if config is None:
        config = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
    model = tf.Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)
    return model.train(), initial_state


def _whole_optimizer(trainer) -> dict:
    """The AdamW state of every parameter, shards gathered (a collective: same parameter order on every rank)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out = {}
    for name, p in trainer.model.named_parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out[f"{name}.{key}"] = _full(value).detach().clone().cpu() if torch.is_tensor(value) else value
    out["lr"] = [g["lr"] for g in optimizer.param_groups]
    return out


def _whole(trainer) -> dict:
    return {n: _full(p).detach().clone().cpu() for n, p in trainer.model.named_parameters()}


def run_resume_case(name: str, out: Path, rank: int, world: int) -> None:
    """4 AdamW windows straight (checkpoints every 2) vs a fresh model and trainer resumed from checkpoint-2 to 4.

    ``ep_resume``: the model loaded with ``from_pretrained(distributed_config=...)`` (route "model"), plus the control:
    the same resume with the optimizer state left unloaded (the scheduler loaded). ``config_ep_resume``: the plain
    model sharded by hf_gradfix from ``parallel: {dp_shard: 2, ep: 2}``. ``ep_resume_refused``: a run without ep
    (``parallel: {dp_shard: 2}``) given ep_resume's checkpoint must refuse it in one line.
    """
    import transformers

    import hf_gradfix

    config = {"loss": {"aux_loss": "micro"}, "log_fixes": False}
    if name != "ep_resume":
        config["parallel"] = {"dp_shard": world, "ep": world} if name == "config_ep_resume" else {"dp_shard": world}
    hf_gradfix.patch(config)

    def model():
        if name == "ep_resume":
            return load_ep_model(out, rank, world)[0]
        return harness.build_moe("qwen3_moe", coef=COEF).train()

    samples = harness.arrange_for_ranks(harness.make_samples("causal", n=N_SAMPLES, seed=0), world, 2)
    collator = harness.RecordingCollator("causal", harness.pad_id_of(harness.build_moe("qwen3_moe", coef=COEF)))
    refused = name.endswith("_refused")
    args = transformers.TrainingArguments(
        output_dir=str(out / name / "trainer"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, save_steps=2, save_strategy="no" if refused else "steps", optim="adamw_torch",
        learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="linear", logging_steps=1,
        report_to="none", use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        remove_unused_columns=False, disable_tqdm=True, seed=0, data_seed=0,
    )

    def trainer():
        from transformers.trainer_callback import PrinterCallback

        made = harness._subclass(transformers.Trainer)(
            model=model(), args=args, train_dataset=harness.ListDataset(samples), data_collator=collator)
        made.remove_callback(PrinterCallback)
        return made

    def after(t, step=0) -> list:
        return [(h["step"], h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h and h["step"] > step]

    payload: dict = dict(case=name, rank=rank, world_size=world)
    if refused:
        try:
            trainer().train(resume_from_checkpoint=str(out / "ep_resume" / "trainer" / "checkpoint-2"))
        except Exception as err:  # noqa: BLE001 - recorded, checked by the test
            payload["error"] = f"{type(err).__name__}: {err}"
            torch.save(payload, out / name / f"rank{rank}.pt")
            return
        raise AssertionError(f"{name}: the Trainer resumed from a checkpoint another mesh wrote")
    straight = trainer()
    straight.train()
    payload.update(straight=_whole(straight), straight_optimizer=_whole_optimizer(straight), straight_log=after(straight, 2),
                   files=sorted(os.listdir(out / name / "trainer" / "checkpoint-2")))
    checkpoint = str(out / name / "trainer" / "checkpoint-2")
    resumed = trainer()
    resumed.train(resume_from_checkpoint=checkpoint)
    payload.update(resumed=_whole(resumed), resumed_optimizer=_whole_optimizer(resumed), resumed_log=after(resumed, 2))
    if name == "ep_resume":  # the control: the same resume without the optimizer state (scheduler loaded)
        control = trainer()

        def scheduler_only(path, *a, **k):
            control.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))

        control._load_optimizer_and_scheduler = scheduler_only
        control.train(resume_from_checkpoint=checkpoint)
        payload.update(control=_whole(control), control_log=after(control, 2))
    if rank != 0:  # rank 0 holds the record the test reads (every rank joined the gathers)
        payload = {k: v for k, v in payload.items() if not isinstance(v, dict)}
    torch.save(payload, out / name / f"rank{rank}.pt")


def run_case(name: str, out: Path, rank: int, world: int) -> None:
    import time

    if "resume" in name:
        return run_resume_case(name, out, rank, world)

    import transformers

    start = time.perf_counter()

    import hf_gradfix

    if name in ("patched", "unscaled_refused"):
        hf_gradfix.patch({"loss": {"aux_loss": "micro"}, "log_fixes": False})
    if name == "patched_global":  # the window's router loss: the routing pre-pass under expert parallelism
        hf_gradfix.patch({"loss": {"aux_loss": "global"}, "log_fixes": False})
    family, convention = "qwen3_moe", "micro"
    if name.startswith("family_"):  # family_<family>_<convention>: another MoE family with an ep plan, config route
        family, convention = name[len("family_"):].rsplit("_", 1)
    if name == "config_ep" or name.startswith("family_"):  # the section asks for ep; the Trainer gets the plain model
        hf_gradfix.patch({"parallel": {"dp_shard": world, "ep": world}, "loss": {"aux_loss": convention},
                          "log_fixes": False})
        model = harness.build_moe(family, coef=COEF).train()
        initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        model, initial_state = load_ep_model(out, rank, world)
    if name.startswith("unscaled"):
        from hf_gradfix.parallel.ep import expert_modules

        for _, module in expert_modules(model):
            module.set_gradient_divide_factor(1.0)
    samples = harness.arrange_for_ranks(harness.make_samples("causal", n=N_SAMPLES, seed=0), world, 2)
    collator = harness.RecordingCollator("causal", harness.pad_id_of(model))
    recorder = _recorder()
    recorder.collator = collator
    args = transformers.TrainingArguments(
        output_dir=str(out / name / f"trainer_rank{rank}"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, num_train_epochs=1, optim="sgd", learning_rate=0.0, weight_decay=0.0,
        max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False,
        disable_tqdm=True, seed=0, data_seed=0,
    )
    payload: dict = dict(case=name, rank=rank, world_size=world)
    try:
        trainer = harness._subclass(transformers.Trainer)(
            model=model, args=args, train_dataset=harness.ListDataset(samples), data_collator=collator,
            callbacks=[recorder],
        )
        recorder.trainer = trainer
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.train()
    except Exception as err:  # noqa: BLE001 - the *_refused cases record the error
        if not name.endswith("_refused"):
            raise
        payload["error"] = f"{type(err).__name__}: {err}"
        torch.save(payload, out / name / f"rank{rank}.pt")
        return
    if name.endswith("_refused"):
        raise AssertionError(f"{name}: the Trainer accepted a setup it should refuse")
    state = hf_gradfix.state_of(trainer)
    payload.update(
        steps=recorder.steps,
        logged_losses=[float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
        line=state.nd.line if state is not None and state.nd is not None else None,
        wrapped=type(trainer.model_wrapped).__name__,
        seconds=time.perf_counter() - start,
        hf_gradfix_file=hf_gradfix.__file__,
        local_sizes=getattr(recorder, "local_sizes", None),
    )
    if rank == 0:
        payload.update(samples=samples, initial_state=initial_state)
    torch.save(payload, out / name / f"rank{rank}.pt")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="comma-separated: patched, stock, unscaled, unscaled_refused")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(a.out)
    import hf_gradfix

    multiproc.run_cases(a.cases.split(","), out, rank, lambda name: run_case(name, out, rank, world),
                        cleanup=lambda name: hf_gradfix.unpatch())


if __name__ == "__main__":
    main()
