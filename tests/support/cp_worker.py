"""Context-parallel worker (gloo on CPU): several scenarios in sequence inside ONE torch.distributed.run launch.

Run (normally through ``test_context_parallel.py``)::

    hf-gradfix launch --config_file configs/cpu_cp.yaml --main_process_port PORT \
        tests/support/cp_worker.py --out DIR --scenarios attention,cp2,...
    python -m torch.distributed.run --nproc_per_node 4 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/cp_worker.py --out DIR --scenarios shard2_cp2,...

* ``attention``: torch's own ``context_parallel`` on a cp mesh of the whole world with the CPU SDPA kernel
  registered (:mod:`hf_gradfix.parallel.cpu_ring_attention`): causal attention output and q/k/v gradients,
  fp32 and fp64, plain and GQA; and the same call without the registration (must raise torch's error).
* Trainer scenarios (``nd_worker.run_scenario`` with a ``parallel`` section holding ``cp``): a tiny sdpa Llama,
  SGD lr 0, bs 1, GA 2, 12 samples of 3-41 tokens with a masked prompt (unequal targets per shard and per data
  rank), the full gradient recorded at every optimizer step. Names ending in ``_control_*`` break one rule of the
  CP batch preparation on purpose (labels shifted after the split; no global position_ids) and must be off.
* ``moe_cp2``: the same with a tiny sdpa Qwen3-MoE (router loss ``micro``, coef 0.5), padded micro-batches of 2;
  ``moe_cp2_control_shard_mean`` trains the router loss as before the fix (each shard's own aux_loss, averaged).
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
import nd_worker  # noqa: E402

PROMPT_MASK = 0.4
CP_SCENARIOS: dict[str, tuple[dict, dict]] = {
    # launched by `hf-gradfix launch --config_file configs/cpu_cp.yaml`: patch() reads the file's hf_gradfix section
    "cp2": ({"parallel": {"dp_shard": 1, "cp": 2}}, {"eval": True, "from_env": True}),
    "cp2_control_shift_after_split": ({"parallel": {"dp_shard": 1, "cp": 2}}, {"control": "shift_after_split"}),
    "cp2_control_no_position_ids": ({"parallel": {"dp_shard": 1, "cp": 2}}, {"control": "no_position_ids"}),
    # the guard: without the data mesh accelerate shards over both processes, so the cp ranks get different batches
    "cp2_data_differs_refused": ({"parallel": {"dp_shard": 1, "cp": 2}}, {"break_tp_data": True}),
    "cp2_eager_refused": ({"parallel": {"dp_shard": 1, "cp": 2}}, {"attn": "eager"}),
    "shard2_cp2": ({"parallel": {"dp_shard": 2, "cp": 2}}, {"eval": True}),
    "cp2_tp2": ({"parallel": {"dp_shard": 1, "cp": 2, "tp": 2}}, {}),
    "rep2_cp2": ({"parallel": {"dp_replicate": 2, "dp_shard": 1, "cp": 2}}, {}),
    # MoE router loss `micro` under cp (issue 36): a tiny sdpa Qwen3-MoE, padded micro-batches of 2, GA 2; the
    # control trains the old per-shard mean (each cp rank's own aux_loss, pads counted) and must be off
    "moe_cp2": ({"parallel": {"dp_shard": 1, "cp": 2}, "loss": {"aux_loss": "micro"}}, {"moe": True, "batch": 2}),
    "moe_cp2_control_shard_mean": ({"parallel": {"dp_shard": 1, "cp": 2}, "loss": {"aux_loss": "micro"}},
                                   {"moe": True, "batch": 2, "control": "shard_mean"}),
}


# CP x packing (issue 29): rows packed by the plugin's own collator, split over the cp ranks with the document mask
PACKED_BUDGET, PACKED_GA, PACKED_SEED = 128, 2, 3
PACKED_SCENARIOS: dict[str, dict] = {
    "packed_cp2": {"parallel": {"dp_shard": 1, "cp": 2}},
    # negative controls: the mask built after the split (each rank's own sdpa over its permuted shard, the model's
    # mask from the local position_ids), and positions numbered per shard (not split with the tokens); positions not
    # restarted per document (0..L-1 over the row) is recorded too: exact on a RoPE model (relative positions)
    "packed_cp2_control_mask_after_split": {"parallel": {"dp_shard": 1, "cp": 2}},
    "packed_cp2_control_positions_local": {"parallel": {"dp_shard": 1, "cp": 2}},
    "packed_cp2_control_positions_not_restarted": {"parallel": {"dp_shard": 1, "cp": 2}},
    "packed_shard2_cp2": {"parallel": {"dp_shard": 2, "cp": 2}},
    # parallel.cp_balance: long_documents (issue 40): documents over 32 tokens cut head-tail, the rest dealt whole
    "packed_cp2_long_documents": {"parallel": {"dp_shard": 1, "cp": 2, "cp_balance": "long_documents",
                                               "cp_balance_threshold": 32}},
    "packed_cp2_tp2": {"parallel": {"dp_shard": 1, "cp": 2, "tp": 2}},
}


def packed_samples() -> list[dict]:
    """Short documents (3-41 tokens, 40% prompt masked) and three long ones (70-110 tokens, longer than a rank's
    shard of a row), so packed rows hold documents shorter than a shard and documents across both shards."""
    short = harness.make_samples("causal", n=14, seed=0, prompt_mask_frac=PROMPT_MASK)
    long = harness.make_samples("causal", n=3, lo=70, hi=110, seed=5, prompt_mask_frac=PROMPT_MASK)
    out = short + long
    return [dict(s, idx=i) for i, s in enumerate(out)]


def packed_case(name: str, out: Path, rank: int, world: int) -> None:
    import transformers
    from transformers import TrainerCallback

    import hf_gradfix
    from hf_gradfix.parallel import context_packing

    # the controls switch the guard off: it refuses the broken attention path before training (as it should)
    packing = {"enabled": True, "token_budget": PACKED_BUDGET, "guard": "_control_" not in name}
    config = dict(PACKED_SCENARIOS[name], packing=packing)
    original_block, original_build = context_packing.packed_attention_block, context_packing.PackedLayout.build
    if name.endswith("mask_after_split"):
        context_packing.packed_attention_block = lambda *a, **k: __import__("contextlib").nullcontext()
    elif "_control_positions" in name:
        def build(inputs, cp, pad_token_id=0, **layout_options):
            layout = original_build(inputs, cp, pad_token_id, **layout_options)
            pos = layout.padded["position_ids"]
            if name.endswith("not_restarted"):  # 0..L-1 over the whole row (RoPE is relative: harmless, measured)
                layout.padded["position_ids"] = torch.arange(pos.shape[1]).expand_as(pos).clone()
            else:  # "local": positions not split with the tokens; each rank numbers its own shard 0..L/cp-1
                shard = pos.shape[1] // cp
                local = torch.arange(shard).repeat(cp).expand_as(pos)
                layout.padded["position_ids"] = torch.empty_like(pos).scatter_(1, layout.indices, local)
            return layout
        context_packing.PackedLayout.build = staticmethod(build)
    try:
        hf_gradfix.patch(config)
        model = nd_worker.build_model(attn="sdpa")
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}

        class Full(TrainerCallback):
            grads: list = []

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                self.grads.append({n: nd_worker._full(p.grad).detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None})

        recorder = Full()
        recorder.grads = []
        args = transformers.TrainingArguments(
            output_dir=str(out / name / f"trainer_rank{rank}"), optim="sgd", learning_rate=0.0, max_grad_norm=0.0,
            gradient_accumulation_steps=PACKED_GA, per_device_train_batch_size=1, num_train_epochs=1, logging_steps=1,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=PACKED_SEED,
            remove_unused_columns=False, dataloader_num_workers=0, dataloader_pin_memory=False,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=harness.TokenDataset(packed_samples()),
                                       callbacks=[recorder])
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.train()
        state = hf_gradfix.state_of(trainer)
        extra = {}
        if name == "packed_cp2":  # eval on packed rows too: transformers' own flattening collator (restarted positions)
            trainer.data_collator = transformers.DataCollatorWithFlattening()
            trainer.args.per_device_eval_batch_size = 4
            before = state.nd.packed_cp_batches
            metrics = trainer.evaluate(eval_dataset=harness.TokenDataset(packed_samples()[:11]))
            extra = dict(eval_loss=metrics["eval_loss"], eval_targets=metrics.get("eval_loss_targets"),
                         eval_packed_batches=state.nd.packed_cp_batches - before)
        payload = dict(**extra,
            grads=recorder.grads, init=init, dims=state.nd.dims, packing_line=state.packing_line,
            logged=[float(h["loss"]) for h in trainer.state.log_history if "loss" in h],
            packed_batches=state.nd.packed_cp_batches, attention_calls=state.nd.packed_cp_calls[0],
            model_class=type(trainer.model).__name__,
        )
        torch.save(payload, out / name / f"rank{rank}.pt")
    finally:
        context_packing.packed_attention_block, context_packing.PackedLayout.build = original_block, original_build
        hf_gradfix.unpatch()


def _cp_samples(config: dict, world: int, seed: int = 0, **_sizes) -> list[dict]:  # the cp scenarios' own sizes
    samples = harness.make_samples("causal", n=nd_worker.N_SAMPLES, seed=seed, prompt_mask_frac=PROMPT_MASK)
    return harness.arrange_for_ranks(samples, nd_worker.dp_size(config, world), 1)


def _break(control: str) -> None:
    """Negative controls: the CP batch preparation with one rule broken (what users get wrong)."""
    from hf_gradfix.parallel import context

    if control == "shard_mean":  # the router loss as before the fix: the mean of each cp shard's own aux_loss
        from hf_gradfix.integration import moe

        moe._cp_micro_share = lambda *a, **k: None
        return
    original = context.prepare_batch

    def broken(inputs, cp, pad_token_id=0):
        out, buffers, dims = original(inputs, cp, pad_token_id)
        drop = "shift_labels" if control == "shift_after_split" else "position_ids"
        gone = out.pop(drop)
        keep = [(b, d) for b, d in zip(buffers, dims) if b is not gone]
        return out, [b for b, _ in keep], [d for _, d in keep]

    context.prepare_batch = broken


def attention_case(out: Path, rank: int, world: int) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    from hf_gradfix.parallel import cpu_ring_attention as cra

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results: dict = {}

    def run(dtype, kv_heads, register=True):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 8 * world, 16, dtype=dtype)
        k, v = (torch.randn(2, kv_heads, 8 * world, 16, dtype=dtype) for _ in range(2))
        go = torch.randn_like(q)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        gqa = kv_heads != 4
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=gqa)
        ref_out.backward(go)
        if gqa:  # ring attention takes equal heads: expand K/V (what hf_gradfix's CP block does)
            k, v = k.repeat_interleave(4 // kv_heads, dim=1), v.repeat_interleave(4 // kv_heads, dim=1)
        local = [t.clone() for t in (q, k, v, go)]
        _cp_options.convert_to_f32 = dtype != torch.float64
        if register:
            cra.register()
        try:
            with context_parallel(mesh, buffers=local, buffer_seq_dims=[2] * 4, no_restore_buffers=set(local)):
                lq, lk, lv, lgo = local
                for t in (lq, lk, lv):
                    t.requires_grad_()
                o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                o.backward(lgo)
            full = context_parallel_unshard(mesh, [o.detach(), lq.grad, lk.grad, lv.grad], [2] * 4)
        finally:
            _cp_options.convert_to_f32 = True
            cra.unregister()
        gk, gv = full[2], full[3]
        if gqa:  # gradients of the expanded heads summed back onto their KV head
            gk = gk.unflatten(1, (kv_heads, 4 // kv_heads)).sum(2)
            gv = gv.unflatten(1, (kv_heads, 4 // kv_heads)).sum(2)
        got = [full[0], full[1], gk, gv]
        want = [ref_out.detach(), ref[0].grad, ref[1].grad, ref[2].grad]
        return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]

    results["fp32"] = run(torch.float32, 4)
    results["fp64"] = run(torch.float64, 4)
    results["fp32_gqa"] = run(torch.float32, 2)
    try:
        run(torch.float32, 4, register=False)
        results["unregistered"] = "no error"
    except Exception as err:  # noqa: BLE001 - the error torch raises without the registration
        results["unregistered"] = f"{type(err).__name__}: {err}"
    results["registered_after"] = cra.registered()
    torch.save(results, out / "attention" / f"rank{rank}.pt")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    out = Path(a.out)
    nd_worker.SCENARIOS.update(CP_SCENARIOS)
    nd_worker.scenario_samples = _cp_samples
    from hf_gradfix.parallel import context

    from hf_gradfix.integration import moe

    original_prepare = context.prepare_batch
    original_build = nd_worker.build_model
    original_share = moe._cp_micro_share
    import hf_gradfix

    def run_one(name: str) -> None:
        if name == "attention":
            attention_case(out, rank, world)
        elif name in PACKED_SCENARIOS:
            packed_case(name, out, rank, world)
        elif name == "verify":  # hf-gradfix verify under CP (its own ground truth, lr 1e-3: the weights move)
            from hf_gradfix.verify import verify

            report = verify(config={"parallel": {"dp_shard": 1, "cp": world}}, steps=2, grad_accum=2,
                            output_dir=str(out / name / f"trainer_rank{rank}"))
            torch.save(dict(exact=report.exact, errors=[s.grad_rel_err for s in report.steps],
                            loss_errors=[s.loss_rel_err for s in report.steps]), out / name / f"rank{rank}.pt")
        else:
            opts = CP_SCENARIOS[name][1]
            if "control" in opts:
                _break(opts["control"])
            attn = opts.get("attn", "sdpa")
            if opts.get("moe"):
                nd_worker.build_model = lambda seed=0: harness.build_moe("qwen3_moe")  # sdpa, 6 experts top-2
            else:
                nd_worker.build_model = lambda seed=0, attn=attn: original_build(seed, attn)
            nd_worker.run_scenario(name, out, rank, world)

    def cleanup(name: str) -> None:
        hf_gradfix.unpatch()
        context.prepare_batch = original_prepare
        nd_worker.build_model = original_build
        moe._cp_micro_share = original_share

    multiproc.run_cases(a.scenarios.split(","), out, rank, run_one, cleanup=cleanup)


if __name__ == "__main__":
    main()
