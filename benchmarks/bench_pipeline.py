"""Pipeline parallelism: step time of each schedule vs the same tokens on one process, and the measured bubble.

For each schedule (GPipe, 1F1B, Interleaved 1F1B, zero bubble) the same window (m micro-batches of B rows x T
tokens) is trained through ``hf_gradfix.parallel.pipeline`` on ``p`` processes (gloo on CPU, NCCL on GPUs) with the
exact window loss (``scale_grads=False``), and once on one process (the whole model, the micro-batches one after
the other, one backward each). The measured bubble is the share of the pipeline step the ranks were not computing,
against a perfect split of the one-process work::

    bubble_measured = 1 - T_one / (p * T_pipeline)         formula: hf_gradfix.plan.pipeline.bubble_fraction
    ((p-1)/(m+p-1) for GPipe / 1F1B, (p-1)/(v*m+p-1) interleaved, (p-1)/(3*v*m+p-1) zero bubble)

Communication and the per-micro-batch overheads count as bubble here (they are idle time for the ranks), so the
measured bubble is an upper bound of the schedule's own. On a CPU the processes share the cores: a step-time
comparison is only fair with at least ``p`` free cores.

    python benchmarks/bench_pipeline.py --pp 2 --micro-batches 4 8 --steps 3        # writes benchmarks/results/pipeline.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, on_path, results_path  # noqa: E402

on_path(ROOT)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]


def _model(args):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                            tie_word_embeddings=False, use_cache=False)
    return tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()


def _window(args, m):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 1024, (m * args.rows, args.seq), generator=g)
    return ids, ids.clone()


def one_process(args, m) -> float:
    """Seconds per window on one process: the whole model, m micro-batches, sum / N loss, one backward each."""
    import torch

    torch.set_num_threads(args.threads)
    model = _model(args)
    ids, labels = _window(args, m)
    n = int((labels[:, 1:] != -100).sum())
    times = []
    for step in range(args.steps + 1):
        model.zero_grad()
        t0 = time.perf_counter()
        for k in range(m):
            rows = slice(k * args.rows, (k + 1) * args.rows)
            model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=n).loss.backward()
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def worker(args) -> None:
    """Under torch.distributed.run: every schedule, every micro-batch count; rank 0 writes the times as JSON."""
    import torch
    import torch.distributed as dist

    from hf_gradfix.parallel.pipeline import build_stages, make_schedule, window_loss_fn

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    results = []
    for m in args.micro_batches:
        ids, labels = _window(args, m)
        n = torch.tensor(float((labels[:, 1:] != -100).sum()))
        mask = torch.ones_like(ids)
        pos = torch.arange(args.seq).expand(ids.shape[0], args.seq).contiguous()
        for name, virtual in SCHEDULES:
            if args.layers < pp * virtual:
                continue
            model = _model(args)
            _, stages = build_stages(model, pp=pp, pp_rank=rank, virtual_stages=virtual, device=torch.device("cpu"),
                                     group=dist.group.WORLD)
            try:
                schedule = make_schedule(name, stages, m, window_loss_fn(model, 1))
            except Exception as err:  # noqa: BLE001 - a schedule torch cannot build for this m: reported, not timed
                results.append(dict(schedule=name, virtual=virtual, m=m, error=str(err).splitlines()[0]))
                continue
            times = []
            for step in range(args.steps + 1):
                model.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                schedule.step(ids, mask, pos, target=labels, loss_kwargs={"num_items": n}, return_outputs=False)
                dist.barrier()
                if step:
                    times.append(time.perf_counter() - t0)
            results.append(dict(schedule=name, virtual=virtual, m=m, seconds=sorted(times)[len(times) // 2]))
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (the one-process run too)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--write", default=results_path("pipeline.md"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    from hf_gradfix.plan.pipeline import PipelineSpec, bubble_fraction  # the planner's formulas

    out = Path(tempfile.mkdtemp(prefix="hgf_bench_pp_")) / "times.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.pp), "--master_addr",
           "127.0.0.1", "--master_port", str(29000 + os.getpid() % 1000), __file__, "--worker", "--out", str(out),
           "--micro-batches", *map(str, args.micro_batches), "--rows", str(args.rows), "--seq", str(args.seq),
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    piped = json.loads(out.read_text())
    base = {m: one_process(args, m) for m in args.micro_batches}
    lines = [
        f"# Pipeline schedules: step time vs one process (pp={args.pp}, CPU gloo, {args.threads} thread(s) per process)",
        "",
        f"Tiny Llama ({args.layers} layers, hidden {args.hidden}), micro-batches of {args.rows} x {args.seq} tokens, "
        f"median of {args.steps} steps, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end. "
        "`python benchmarks/bench_pipeline.py` writes this file. Measured bubble = 1 - T_one / (p x T_pp) "
        "(communication counts as bubble); formula: the planner's (p-1)/(m+p-1) for GPipe / 1F1B, (p-1)/(v*m+p-1) "
        "interleaved, (p-1)/(3*v*m+p-1) zero bubble (forward, input-gradient and weight-gradient passes of equal length).",
        "",
        "| schedule | v | m | one process (s) | pipeline (s) | speed-up | bubble measured | bubble formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in piped:
        if "error" in r:
            lines.append(f"| {r['schedule']} | {r['virtual']} | {r['m']} | | not built: {r['error'][:80]} | | | |")
            continue
        t1, tp = base[r["m"]], r["seconds"]
        measured = 1 - t1 / (args.pp * tp)
        formula = bubble_fraction(PipelineSpec(args.pp, r["schedule"], r["virtual"], r["m"]))
        lines.append(f"| {r['schedule']} | {r['virtual']} | {r['m']} | {t1:.3f} | {tp:.3f} | {t1 / tp:.2f}x | "
                     f"{measured:.0%} | {formula:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        Path(args.write).write_text(text)


if __name__ == "__main__":
    main()
