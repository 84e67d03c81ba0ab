"""ND-parallel worker (gloo on CPU): several scenarios in sequence inside ONE torch.distributed.run launch.

Run (normally through ``test_nd_parallel.py``)::

    python -m torch.distributed.run --nproc_per_node 4 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/nd_worker.py --out DIR --scenarios shard2_tp2,rep2_shard2,...

Every scenario builds the same tiny fp32 Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128; same seed on
every rank), calls ``hf_gradfix.patch(<config with a parallel section>)``, trains a ``transformers.Trainer`` with SGD
lr 0 (weights never change), bs 1, GA 2 on 12 samples of 3-41 tokens arranged so that data-parallel rank 0 gets
the short samples and rank 1 the long ones (unequal token counts per rank), and records at each
``on_pre_optimizer_step`` the FULL gradient (DTensor shards gathered with ``full_tensor()``), the idx of the
micro-batches each rank consumed, its losses and its mesh coordinates. Rank r writes ``DIR/<scenario>/rank{r}.pt``.
Scenarios whose name ends in ``_refused`` expect the Trainer to refuse the setup and record the message.

The ``ep*`` scenarios (transformers 5.x only: the test leaves them out where DistributedConfig has no ep) train
tests/support/ep_worker.py's tiny Qwen3-MoE (6 experts, top-2, router aux coef 0.5) with expert parallelism on the 4
processes instead: bs 2, GA 2, 32 samples, 4 data ranks (short samples on rank 0, long ones on rank 3). The plain
model is given to the Trainer and hf_gradfix shards it from the ``parallel`` section; ``*_stock`` loads it with
transformers' DistributedConfig itself and trains without hf_gradfix.
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

import ep_worker  # noqa: E402
import harness  # noqa: E402
import multiproc  # noqa: E402

N_SAMPLES = 12
MOE_SAMPLES, MOE_BATCH = 32, 2  # 2 windows of 4 data ranks x bs 2 x GA 2
LLAMA = harness.TINY_GQA_LLAMA

# name -> (hf_gradfix config, options). "yaml": write the config to a YAML file and patch() with its path.
SCENARIOS: dict[str, tuple[dict, dict]] = {
    "shard2_tp2": ({"parallel": {"dp_shard": 2, "tp": 2}}, {"yaml": True, "eval": True}),
    "shard2_tp2_avg_false": ({"parallel": {"dp_shard": 2, "tp": 2}}, {"avg_false": True}),
    # negative control: the loss fix off, the same mesh: transformers' own loss with average_tokens_across_devices=False
    "shard2_tp2_avg_false_stock": ({"parallel": {"dp_shard": 2, "tp": 2}, "loss": {"enabled": False}}, {"avg_false": True}),
    "rep2_shard2": ({"parallel": {"dp_replicate": 2, "dp_shard": 2}}, {}),
    # loss.head: lean on FSDP2 (HSDP) and under tp (a DTensor head: found in its forward, kept stock)
    "rep2_shard2_lean": ({"parallel": {"dp_replicate": 2, "dp_shard": 2}, "loss": {"head": "lean"}}, {}),
    "shard2_tp2_lean": ({"parallel": {"dp_shard": 2, "tp": 2}, "loss": {"head": "lean"}}, {}),
    "rep2_tp2": ({"parallel": {"dp_replicate": 2, "dp_shard": 1, "tp": 2}}, {}),
    "shard2_tp2_iterable": ({"parallel": {"dp_shard": 2, "tp": 2}}, {"iterable": True}),
    "tp4_refused": ({"parallel": {"dp_shard": 1, "tp": 4}}, {}),
    "world_mismatch_refused": ({"parallel": {"dp_shard": 3, "tp": 2}}, {}),
    # the guard: accelerate's data mesh removed after setup, so the loader shards over all 4 processes and the
    # two ranks of a TP group get different batches; the first window must be refused (on every rank, no hang)
    "tp_data_differs_refused": ({"parallel": {"dp_shard": 2, "tp": 2}}, {"break_tp_data": True}),
    # expert parallelism over 4 data ranks: ep 2 x efsdp 2 (each expert FSDP2-sharded over 2 ranks) and ep 2 x
    # dp_replicate 2 (HSDP; "file": patch() with the shipped config, whose section is this dict, aux_loss micro by default)
    "ep2_efsdp2_micro": ({"parallel": {"dp_shard": 4, "ep": 2}, "loss": {"aux_loss": "micro"}}, {"moe": True}),
    "ep2_efsdp2_global": ({"parallel": {"dp_shard": 4, "ep": 2}, "loss": {"aux_loss": "global"}}, {"moe": True}),
    "ep2_rep2_micro": ({"parallel": {"dp_replicate": 2, "dp_shard": 2, "ep": 2}}, {"moe": True, "file": "configs/cpu_ep4.yaml"}),
    "ep2_rep2_global": ({"parallel": {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "loss": {"aux_loss": "global"}}, {"moe": True}),
    # ep 2 x tp 2 x dp_shard 2 (efsdp 2) on the Qwen3-MoE with 2 KV heads: q_norm / k_norm are tp
    # 'replicated_with_grad_allreduce', whose accumulated-gradient all-reduce hf_gradfix corrects (patching.py);
    # "_unfixed": the same run with transformers' own all-reduce put back (the control: q_norm / k_norm off)
    "ep2_tp2_micro": ({"parallel": {"dp_shard": 2, "tp": 2, "ep": 2}, "loss": {"aux_loss": "micro"}}, {"moe": "qwen3_moe_kv2", "n": 16}),
    "ep2_tp2_global": ({"parallel": {"dp_shard": 2, "tp": 2, "ep": 2}, "loss": {"aux_loss": "global"}}, {"moe": "qwen3_moe_kv2", "n": 16}),
    "ep2_tp2_unfixed": ({"parallel": {"dp_shard": 2, "tp": 2, "ep": 2}, "loss": {"aux_loss": "micro"}},
                        {"moe": "qwen3_moe_kv2", "unfix": True, "n": 16}),
    # the control: no hf_gradfix, the model loaded with DistributedConfig(fsdp_size=4, ep_size=2) by the user
    "ep2_efsdp2_stock": ({"parallel": {"dp_shard": 4, "ep": 2}}, {"moe": True, "stock": True}),
}


def build_model(seed: int = 0, attn: str = "eager"):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**LLAMA), attn_implementation=attn).float()
    model.train()
    return model


def dp_size(config: dict, world: int) -> int:
    """Data-parallel ranks of the scenario's mesh (1 for a mesh the plugin must refuse)."""
    from hf_gradfix.parallel import ParallelDims, ParallelDimsError

    p = config.get("parallel", {})
    try:
        return ParallelDims(world, **{k: p[k] for k in ("dp_replicate", "dp_shard", "tp", "cp") if k in p}).dp
    except ParallelDimsError:
        return 1


def scenario_samples(config: dict, world: int, seed: int = 0, *, n: int = N_SAMPLES, batch: int = 1) -> list[dict]:
    samples = harness.make_samples("causal", n=n, seed=seed)
    return harness.arrange_for_ranks(samples, dp_size(config, world), batch)


class StreamDataset(torch.utils.data.IterableDataset):
    """The samples as a stream (no __len__): accelerate must shard it per data-parallel rank."""

    def __init__(self, samples):
        self.samples = list(samples)

    def __iter__(self):
        for s in self.samples:
            yield dict(s)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _make_callback():
    from transformers import TrainerCallback

    class FullGradRecorder(TrainerCallback):
        """Full gradients at on_pre_optimizer_step (a collective: every rank gathers every DTensor shard)."""

        def __init__(self):
            self.trainer = None
            self.collator = None
            self.steps: list[dict] = []
            self._seen = 0

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            tr = self.trainer
            n = tr._hgf_consumed
            batches = self.collator.batches[self._seen : n]
            self._seen = n
            grads = {}
            for name, p in tr.model.named_parameters():
                if p.requires_grad:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    grads[name] = _full(g).detach().clone().cpu()
            self.steps.append(dict(idx_batches=[list(b) for b in batches], grads=grads, local_loss=tr._hgf_step_loss))
            tr._hgf_step_loss = 0.0

    return FullGradRecorder()


def run_scenario(name: str, out: Path, rank: int, world: int) -> None:
    import time

    import transformers

    import hf_gradfix

    start = time.perf_counter()
    config, opts = SCENARIOS[name]
    moe, stock = bool(opts.get("moe")), bool(opts.get("stock"))
    source = None if opts.get("from_env") else config  # from_env: patch() reads $HF_GRADFIX_CONFIG (hf-gradfix launch)
    if opts.get("yaml"):
        import yaml

        path = out / f"{name}.yaml"
        if rank == 0:
            path.write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "hf_gradfix": config}))
        torch.distributed.barrier()
        source = str(path)
    if opts.get("file"):
        source = str(harness.REPO_ROOT / opts["file"])
    if stock:  # the user shards the model at load time; no hf_gradfix
        from hf_gradfix.integration.parallel.nd import distributed_config
        from hf_gradfix.parallel import ParallelDims

        model, initial_state = ep_worker.load_ep_model(out, rank, world, distributed_config(ParallelDims(world, **config["parallel"])))
    else:
        hf_gradfix.patch(source)
        family = opts["moe"] if isinstance(opts.get("moe"), str) else "qwen3_moe"
        model = harness.build_moe(family, coef=ep_worker.COEF).train() if moe else build_model()
        initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n, batch = (opts.get("n", MOE_SAMPLES), MOE_BATCH) if moe else (N_SAMPLES, 1)  # n 16 under tp: 2 windows
    batch = opts.get("batch", batch)
    samples = scenario_samples(config, world, n=n, batch=batch)
    collator = harness.RecordingCollator("causal", harness.pad_id_of(model) if moe else harness.PAD_ID)
    recorder = _make_callback()
    recorder.collator = collator
    extra = dict(average_tokens_across_devices=False) if opts.get("avg_false") else {}
    iterable = bool(opts.get("iterable"))
    args = transformers.TrainingArguments(
        output_dir=str(out / name / f"trainer_rank{rank}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        max_steps=N_SAMPLES // (2 * dp_size(config, world)) if iterable else -1,
        optim="sgd",
        learning_rate=0.0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        **extra,
    )
    dataset = StreamDataset(samples) if iterable else harness.ListDataset(samples)
    payload: dict = dict(scenario=name, rank=rank, world_size=world, config=config, opts=opts)
    try:
        trainer = harness._subclass(transformers.Trainer)(
            model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[recorder]
        )
    except Exception as err:  # noqa: BLE001 - the *_refused scenarios record the error
        if not name.endswith("_refused"):
            raise
        payload["error"] = f"{type(err).__name__}: {err}"
        torch.save(payload, out / name / f"rank{rank}.pt")
        return
    recorder.trainer = trainer
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    if opts.get("unfix"):
        from hf_gradfix.integration.parallel.tensor_parallel import restore_partial_grad_allreduce

        payload["restored"] = restore_partial_grad_allreduce(trainer.model)
    if opts.get("break_tp_data"):
        trainer.accelerator.state.device_mesh = None
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001
        if not name.endswith("_refused"):
            raise
        payload["error"] = f"{type(err).__name__}: {err}"
        torch.save(payload, out / name / f"rank{rank}.pt")
        return
    if name.endswith("_refused"):
        raise AssertionError(f"{name}: the Trainer accepted a setup it should refuse")
    if opts.get("eval"):  # 11 samples, bs 2, 2 data ranks: accelerate pads the last batch (even_batches)
        trainer.args.per_device_eval_batch_size = 2
        metrics = trainer.evaluate(eval_dataset=harness.ListDataset(samples[: N_SAMPLES - 1]))
        payload.update(eval_loss=metrics["eval_loss"], eval_targets=metrics.get("eval_loss_targets"))
    payload.update(
        steps=recorder.steps,
        logged_losses=[float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
        grad_norms=[float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
        model_class=type(trainer.model).__name__,
        dtensor_params=sum(1 for p in trainer.model.parameters() if type(p.data).__name__ == "DTensor"),
        seconds=time.perf_counter() - start,
    )
    state = hf_gradfix.state_of(trainer)
    lean = getattr(state, "lean", None) if state is not None else None
    payload["lean"] = (lean.calls, lean.stock_calls, dict(lean.refused)) if lean is not None else None
    plan = state.nd if state is not None else None
    if plan is not None:  # None: the stock control
        payload.update(
            route=plan.route,
            line=plan.line,
            dims=dict(dp_replicate=plan.dims.dp_replicate, dp_shard=plan.dims.dp_shard, tp=plan.dims.tp, cp=plan.dims.cp),
            coords=plan.dims.coords(rank),
            data_rank=plan.dims.data_rank(rank),
            dataloader=type(trainer.get_train_dataloader()).__name__,
            fixes=list(state.fixes),
            partial_grad_fixed=list(plan.partial_grad_fixed),
            moe_cp=(state.moe.cp_checked, state.moe.cp_fallback) if getattr(state, "moe", None) is not None else None,
        )
    if rank == 0:
        payload["samples"] = samples
        payload["initial_state"] = initial_state
    torch.save(payload, out / name / f"rank{rank}.pt")
    hf_gradfix.unpatch()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", required=True, help="comma-separated names of SCENARIOS")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(a.out)
    import hf_gradfix

    multiproc.run_cases(a.scenarios.split(","), out, rank, lambda name: run_scenario(name, out, rank, world),
                        cleanup=lambda name: hf_gradfix.unpatch())


if __name__ == "__main__":
    main()
