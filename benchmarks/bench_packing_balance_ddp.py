"""Compute-balanced vs token-balanced dealing of packed rows, in a real 2-process DDP run of the Trainer.

    python benchmarks/bench_packing_balance_ddp.py            # ~5 min on 2 CPU cores; markdown table
    python benchmarks/bench_packing_balance_ddp.py --rounds 3 --out benchmarks/results/packing-balance-ddp.md

The companion of ``bench_packing_balance.py`` (which times every row once in one process and sums each step's
slowest rank, for 2 and 4 ranks): here two gloo processes on 127.0.0.1, one torch thread each (2 cores: one each),
train one epoch of the same long-tailed mix through ``transformers.Trainer`` + ``hf_gradfix.patch()`` with
``packing.balance: tokens`` or ``compute``, the arms alternating over ``--rounds`` launches. DDP's gradient all-reduce
makes every step wait for its slowest rank, so the epoch's wall time (``on_train_begin`` -> ``on_train_end``, rank
0) is what the deal costs, collectives included. Also read from the run's own logs: ``packing/imbalance_tokens``
and ``packing/imbalance_compute`` (the mean over steps of max / mean over the ranks). Four processes on these 2
cores would time the scheduler, not the deal; the 4-rank figure stays with ``bench_packing_balance.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import HERE, ROOT  # noqa: E402


def _worker(out: Path, balance: str, samples: int, budget: int) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(HERE))
    from bench_packing_balance import long_tailed

    import hf_gradfix

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=budget)
    model = transformers.LlamaForCausalLM(cfg)
    lengths = long_tailed(samples, budget, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in (torch.randint(4, cfg.vocab_size, (int(n),), generator=g).tolist() for n in lengths)]

    class Dataset(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_train_end(self, *a, **k):
            self.seconds = time.perf_counter() - self.start

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": budget, "balance": balance}, "log_fixes": False})
    clock = Clock()
    args = transformers.TrainingArguments(
        output_dir=str(out / f"trainer-{balance}"), per_device_train_batch_size=1, gradient_accumulation_steps=1,
        num_train_epochs=1, optim="sgd", learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, remove_unused_columns=False,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Dataset(), callbacks=[clock])
    trainer.train()
    if int(os.environ.get("RANK", 0)) == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        mean = lambda key: statistics.fmean(h[key] for h in logs if key in h) if any(key in h for h in logs) else None  # noqa: E731
        (out / f"{balance}.json").write_text(json.dumps({
            "seconds": clock.seconds, "steps": trainer.state.global_step,
            "imbalance_tokens": mean("packing/imbalance_tokens"), "imbalance_compute": mean("packing/imbalance_compute"),
        }))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, balance: str, samples: int, budget: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, "--worker", "--balance", balance, "--dir", str(out),
           "--samples", str(samples), "--budget", str(budget)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {balance} launch failed:\n{done.stderr[-4000:]}")
    return json.loads((out / f"{balance}.json").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balance", default="tokens", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.dir, args.balance, args.samples, args.budget)
        return 0
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {"tokens": [], "compute": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for balance in (("tokens", "compute") if r % 2 == 0 else ("compute", "tokens")):
                runs[balance].append(_launch(Path(tmp), balance, args.samples, args.budget))
                print(f"round {r + 1}/{args.rounds} {balance}: {runs[balance][-1]['seconds']:.1f} s", file=sys.stderr,
                      flush=True)
    import torch

    med = {b: statistics.median(x["seconds"] for x in v) for b, v in runs.items()}
    lines = [
        f"One epoch of `transformers.Trainer` + `hf_gradfix.patch()` on 2 gloo processes (one torch thread each, 2 "
        f"CPU cores), packed rows of <= {args.budget} tokens, {args.samples} documents (lognormal median 200 + 2 % at "
        f"60-100 % of the budget), tiny Llama (hidden 128, 2 layers, varlen reference attention), GA 1, torch "
        f"{torch.__version__}; the arms alternate over {args.rounds} launches each; "
        f"`python benchmarks/bench_packing_balance_ddp.py --samples {args.samples} --budget {args.budget} --rounds "
        f"{args.rounds}` ({time.perf_counter() - started:.0f} s).",
        "",
        "| deal | epoch wall time, s (median; each launch) | compute / tokens | steps | logged imbalance: tokens | "
        "compute |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for balance in ("tokens", "compute"):
        each = ", ".join(f"{x['seconds']:.1f}" for x in runs[balance])
        last = runs[balance][-1]
        ratio = f"{med['compute'] / med['tokens']:.2f}" if balance == "compute" else ""
        lines.append(f"| {balance} | {med[balance]:.1f} ({each}) | {ratio} | {last['steps']} | "
                     f"{last['imbalance_tokens']:.3f} | {last['imbalance_compute']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text("# Compute-balanced packing in a real 2-process DDP run\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
