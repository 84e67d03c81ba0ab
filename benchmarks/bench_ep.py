"""Expert parallelism on 2 processes: step time and per-rank memory of ep 2 against dp 2 and fsdp 2 (CPU, gloo).

    python benchmarks/bench_ep.py                  # ~3-4 min on 2 CPU cores; writes benchmarks/results/ep.md
    python benchmarks/bench_ep.py --hidden 64 --moe-intermediate 128 --layers 2 --seq 64 --steps 1 --no-write  # smoke

Workload: a random-init Qwen3-MoE (default hidden 256, 4 layers, every layer sparse, 16 experts top-2 of
moe_intermediate 512, so the experts hold ~97 % of the parameters; vocabulary 259, router loss coefficient 0.001),
sequences of 256 random tokens (no padding), micro-batch 4 per rank, gradient accumulation 2, AdamW, fp32, CPU, one
torch thread per process. Every arm is one ``torch.distributed.run`` launch of 2 gloo processes on 127.0.0.1 that
trains the same weights (built from the same seed on every rank) through ``transformers.Trainer`` after
``hf_gradfix.patch({"parallel": ..., "loss": {"aux_loss": ...}})`` for ``--warmup`` + ``--steps`` optimizer steps:

* ``dp2``: ``parallel: {dp_replicate: 2, dp_shard: 1}`` (DDP: every rank holds every expert and the whole AdamW state);
* ``fsdp2``: ``parallel: {dp_shard: 2}`` (transformers' FSDP2: every parameter sharded over the 2 ranks);
* ``ep2``: ``parallel: {dp_shard: 2, ep: 2}`` (transformers' ``DistributedConfig(fsdp_size=2, ep_size=2,
  ep_implementation="all_to_all")``: each rank holds half of the experts whole, tokens reach them by all-to-all, the
  dense modules FSDP2-sharded);
* ``ep2-global``: ``ep2`` with ``loss.aux_loss: global`` (the routing pre-pass: one extra no-grad forward per
  micro-batch); every other arm uses ``micro``.

One launch per arm, so ``ru_maxrss`` (a process's high-water mark) is that arm's own. Reported per arm: the median
optimizer-step time over the measured steps (each step: the slower rank's time between consecutive ``on_step_end``;
the warm-up steps, where hf_gradfix probes the loss and AdamW allocates its state, are left out); per-rank bytes of
parameters, gradients and optimizer state counted on the local shards (``DTensor.to_local()``; the larger rank);
peak RSS per rank; their ratios to ``dp2``; for ``ep2-global`` the seconds per step inside the routing pre-pass
(``bench_moe.DirectTimer``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import peak_rss_bytes, results_path  # noqa: E402

ARMS = {
    "dp2": ({"dp_replicate": 2, "dp_shard": 1}, "micro"),
    "fsdp2": ({"dp_shard": 2}, "micro"),
    "ep2": ({"dp_shard": 2, "ep": 2}, "micro"),
    "ep2-global": ({"dp_shard": 2, "ep": 2}, "global"),
}


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _samples(args, world: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1)
    n = (args.warmup + args.steps) * args.ga * args.batch * world
    return [{"input_ids": torch.randint(4, 259, (args.seq,), generator=g).tolist()} for _ in range(n)]


def worker(args) -> None:
    """Under torch.distributed.run: one arm; rank 0 writes every rank's numbers as JSON."""
    import psutil
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import TrainerCallback

    import hf_gradfix
    from bench_moe import DirectTimer, build_model, collate

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    transformers.logging.set_verbosity_error()
    parallel, aux = ARMS[args.arm]
    model = build_model(args)  # same seed on every rank (hf_gradfix also broadcasts rank 0's weights when it shards)
    n_params = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    rss_before = psutil.Process().memory_info().rss
    rec: dict = {"stamps": [], "grad_bytes": 0, "param_bytes": 0, "state_bytes": 0}

    class Probe(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            rec["stamps"].append(time.perf_counter())

        def on_pre_optimizer_step(self, a, state, control, model=None, **kw):
            if state.global_step == 0:  # the accumulated gradients of the first window, as the optimizer sees them
                rec["grad_bytes"] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)

        def on_step_end(self, a, state, control, model=None, optimizer=None, **kw):
            rec["stamps"].append(time.perf_counter())
            if state.global_step == 1:
                rec["param_bytes"] = sum(_local_bytes(p) for p in model.parameters())
                opt = getattr(optimizer, "optimizer", optimizer)
                rec["state_bytes"] = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor))

    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hgf_bench_ep_"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.ga, max_steps=args.warmup + args.steps, learning_rate=1e-4,
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1, remove_unused_columns=False,
        dataloader_num_workers=0, dataloader_pin_memory=False, seed=0, data_seed=0)
    hf_gradfix.patch({"parallel": parallel, "loss": {"aux_loss": aux}, "log_fixes": False})
    direct = DirectTimer()
    try:
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=_samples(args, world),
                                       data_collator=collate, callbacks=[Probe()])
        trainer.train()
        state = hf_gradfix.state_of(trainer)
        line = state.nd.line if state is not None and state.nd is not None else "no ND plan (plain DDP)"
    finally:
        direct.close()
        hf_gradfix.unpatch()
    mine = dict(rank=rank, steps=[b - a for a, b in zip(rec["stamps"], rec["stamps"][1:])],
                param_bytes=rec["param_bytes"], grad_bytes=rec["grad_bytes"], state_bytes=rec["state_bytes"],
                maxrss=peak_rss_bytes(), rss_before=rss_before,
                prepass_s=direct.seconds, losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                line=line, wrapped=type(trainer.model_wrapped).__name__, n_params=n_params, n_experts=n_experts,
                experts_impl=getattr(model.config, "_experts_implementation", None))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(arm: str, args, out: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", "--arm", arm, "--out", str(out)]
    for k in ("hidden", "moe_intermediate", "layers", "experts", "coef", "seq", "batch", "ga", "warmup", "steps",
              "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("HF_GRADFIX_CONFIG", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench_ep: arm {arm} failed (exit {proc.returncode})")
    return json.loads(out.read_text()), time.perf_counter() - t0


def summarize(ranks: list[dict], warmup: int) -> dict:
    steps = [max(r["steps"][k] for r in ranks) for k in range(warmup, len(ranks[0]["steps"]))]
    pgo = [r["param_bytes"] + r["grad_bytes"] + r["state_bytes"] for r in ranks]
    worst = ranks[pgo.index(max(pgo))]
    return dict(step=statistics.median(steps), steps=steps, params=worst["param_bytes"], grads=worst["grad_bytes"],
                state=worst["state_bytes"], pgo=max(pgo), pgo_ranks=pgo, rss=max(r["maxrss"] for r in ranks),
                rss_ranks=[r["maxrss"] for r in ranks], rss_before=max(r["rss_before"] for r in ranks),
                prepass=max(r["prepass_s"] for r in ranks) / max(1, len(ranks[0]["steps"])),
                loss1=ranks[0]["losses"][0] if ranks[0]["losses"] else float("nan"), line=ranks[0]["line"],
                wrapped=ranks[0]["wrapped"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--coef", type=float, default=0.001)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--note", default="", help="a line added to the results file (e.g. what else ran)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--write", default=results_path("ep.md"))
    p.add_argument("--no-write", dest="write", action="store_const", const="")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    import torch
    import transformers

    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="hgf_bench_ep_"))
    arms = [a for a in args.arms.split(",") if a]
    res, raw, wall = {}, {}, {}
    for arm in arms:
        raw[arm], wall[arm] = launch(arm, args, tmp / f"{arm}.json")
        res[arm] = summarize(raw[arm], args.warmup)
        print(f"bench_ep: {arm}: {res[arm]['step']:.3f} s/step, {wall[arm]:.0f} s launch", file=sys.stderr)
    first = raw[arms[0]][0]
    base = res.get("dp2")
    mib = 2**20

    def ratio(arm, key):
        return f"{res[arm][key] / base[key]:.2f}" if base else "-"

    load = os.getloadavg()
    cmd = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_ep.py"] + list(argv if argv is not None
                                                                                      else sys.argv[1:]))
    lines = [
        "# Expert parallelism 2 vs data parallelism 2 (CPU, gloo): step time and per-rank memory", "",
        f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - start:.0f} s). "
        f"**{os.cpu_count()}-core CPU, gloo; not a GPU number.** {platform.machine()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {args.nproc} processes x {args.threads} torch thread(s), "
        f"load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) at the end.", "",
        f"Qwen3-MoE random init, hidden {args.hidden}, {args.layers} layers (all sparse), {args.experts} experts top-2, "
        f"moe_intermediate {args.moe_intermediate}: {first['n_params'] / 1e6:.2f}M parameters, "
        f"{first['n_experts'] / first['n_params']:.1%} of them in experts (experts implementation "
        f"`{first['experts_impl']}`); {args.seq} tokens x micro-batch {args.batch} per rank, GA {args.ga}, AdamW, fp32; "
        f"{args.warmup} warm-up + {args.steps} measured optimizer steps per arm, one `torch.distributed.run` launch "
        "per arm.", "",
        "| arm | `parallel` / `aux_loss` | step s (median) | vs dp2 | params MiB / rank | grads MiB / rank | "
        "optimizer state MiB / rank | params+grads+state MiB / rank | vs dp2 | peak RSS MiB / rank | vs dp2 | "
        "first logged loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in arms:
        r = res[arm]
        par, aux = ARMS[arm]
        spec = "{" + ", ".join(f"{k}: {v}" for k, v in par.items()) + "} / " + aux
        lines.append(
            f"| {arm} | `{spec}` | {r['step']:.3f} | {ratio(arm, 'step')} | {r['params'] / mib:.1f} | "
            f"{r['grads'] / mib:.1f} | {r['state'] / mib:.1f} | {r['pgo'] / mib:.1f} | {ratio(arm, 'pgo')} | "
            f"{r['rss'] / mib:.0f} | {ratio(arm, 'rss')} | {r['loss1']:.4f} |")
    lines += [""]
    if "ep2" in res and "ep2-global" in res:
        g, m = res["ep2-global"], res["ep2"]
        lines.append(f"- Routing pre-pass under ep 2 (`aux_loss: global` vs `micro`): step {g['step']:.3f} s vs "
                     f"{m['step']:.3f} s ({g['step'] / m['step']:.2f}x); time inside the pre-pass {g['prepass']:.3f} "
                     f"s / step = {g['prepass'] / m['step']:.2f} of an ep2 `micro` step (max over ranks, averaged "
                     "over all steps, `bench_moe.DirectTimer`).")
    for arm in arms:
        r = res[arm]
        lines.append(f"- {arm}: step times (s, slower rank) {', '.join(f'{s:.3f}' for s in r['steps'])}; "
                     f"params+grads+state per rank {', '.join(f'{b / mib:.1f}' for b in r['pgo_ranks'])} MiB; peak RSS "
                     f"per rank {', '.join(f'{b / mib:.0f}' for b in r['rss_ranks'])} MiB (RSS before the Trainer, "
                     f"full model built: {r['rss_before'] / mib:.0f} MiB); model `{r['wrapped']}`; hf_gradfix: "
                     f"{r['line']}")
    lines += [
        "",
        "How to read it:",
        "",
        "- Bytes are counted on each rank's local shards (`DTensor.to_local()`): parameters and AdamW state after the "
        "first optimizer step, gradients as the first optimizer step sees them; the larger rank is shown. DDP's "
        "gradient buckets and the transient unsharded parameters of FSDP2 are not counted there (they are in the RSS).",
        "- Peak RSS is `ru_maxrss` of each worker process (one launch per arm): it includes python, torch and "
        "transformers (~several hundred MiB before any model) and the full model every rank builds before the Trainer "
        "shards it (hf_gradfix shards the plain model it is given), so its ratios are much closer to 1 than the "
        "shard bytes'.",
        "- Step time: both processes share this machine's cores; the all-to-all (ep) and the FSDP2 all-gather / "
        "reduce-scatter run on gloo over loopback, i.e. memory copies through the kernel's TCP stack, and the "
        "experts are computed by the CPU. A GPU with NVLink / NCCL overlaps and prices these collectives entirely "
        "differently; the CPU step-time ratios say nothing about GPU speed. The shard-byte columns carry over "
        "(they depend on the sharding, not the device; RSS does not); the time columns show only that ep and the pre-pass run, and what "
        "they cost relative to each other on this CPU.",
    ]
    if args.note:
        lines += ["", args.note]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
