"""Compute-balanced vs token-balanced dealing of packed rows (``packing.balance``): the slowest rank's step time,
measured, on 2 and 4 data-parallel ranks, with a long-tailed length mix.

    python benchmarks/bench_packing_balance.py                     # ~10 min on 2 CPU cores; markdown table
    python benchmarks/bench_packing_balance.py --out benchmarks/results/packing-balance.md

Both deals hold the same rows (the packing is by tokens; only which rank gets which row in which step differs), so
each row's training step (forward + backward of a tiny Llama, hidden 128, 2 layers, varlen mode through the
plugin's packed collator and the reference varlen attention: per-document attention, as FlashAttention's varlen
kernel on a GPU) is timed once, in one process (the median of ``--repeats``), and each deal's epoch is the sum over
its steps of the slowest rank's row time: what data-parallel ranks that wait for each other at every step pay.
This measures the compute each rank has to do; the collectives' own time is the same for both deals and is left
out. Also printed: the mean over steps of max / mean over ranks of tokens, of the cost model ``L * (c + L)`` and of
the measured time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from hf_gradfix.packing.attention import select_varlen_attention, set_attention_implementation  # noqa: E402
from hf_gradfix.packing.balance import attention_cost_coeff, document_cost  # noqa: E402
from hf_gradfix.packing.collator import PackedCollator  # noqa: E402
from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402
from _common import median_time  # noqa: E402

transformers.logging.set_verbosity_error()


def long_tailed(n: int, budget: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median 200) plus 2 % of documents at 60-100 % of the budget (the long-context tail)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(200), 1.0, n), 16, budget).astype(int)
    tail = rng.choice(n, max(1, n // 50), replace=False)
    lengths[tail] = rng.integers(int(0.6 * budget), budget + 1, tail.size)
    return lengths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=args.budget)
    model = transformers.LlamaForCausalLM(cfg)
    set_attention_implementation(model, select_varlen_attention("cpu"))
    c, how = attention_cost_coeff(cfg)
    lengths = long_tailed(args.samples, args.budget, seed=0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(4, cfg.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    collate = PackedCollator("varlen", max_tokens=args.budget, pad_token_id=0)

    plans = {}
    for world in args.worlds:
        plans[(world, "tokens")] = PackedBatchSampler(lengths, args.budget, num_replicas=world, rank="all").plan()
        plans[(world, "compute")] = PackedBatchSampler(lengths, args.budget, num_replicas=world, rank="all",
                                                       cost_coeff=c).plan()
    # every plan of every world holds the same rows only per world (the tail re-deal depends on W): time each
    # distinct row once
    rows = {}
    for plan in plans.values():
        for b in range(plan.n_bins):
            rows.setdefault(tuple(plan.bin(b)), None)
    print(f"timing {len(rows)} distinct rows ({args.repeats} repeats each) ...", file=sys.stderr, flush=True)
    for k, key in enumerate(rows):
        batch = collate([{"input_ids": docs[i], "labels": docs[i]} for i in key])
        rows[key] = median_time(lambda: model(**batch).loss.backward(), args.repeats,
                                before=lambda: model.zero_grad(set_to_none=True))
        if k % 50 == 0:
            print(f"  {k}/{len(rows)}", file=sys.stderr, flush=True)

    lines = [
        f"Slowest rank's row time summed over the steps of one epoch (s), tiny Llama (hidden 128, 2 layers, varlen, "
        f"CPU, torch {torch.__version__}), {args.samples} documents (lognormal median 200 + 2 % at 60-100 % of the "
        f"{args.budget}-token budget), cost model c = {c:,.0f}; `python benchmarks/bench_packing_balance.py`.",
        "",
        "| ranks | deal | epoch (slowest rank per step), s | compute / tokens | step imbalance: tokens | cost model | "
        "measured time |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for world in args.worlds:
        totals = {}
        for deal in ("tokens", "compute"):
            plan = plans[(world, deal)]
            bin_time = np.array([rows[tuple(plan.bin(b))] for b in range(plan.n_bins)])
            costs = np.add.reduceat(document_cost(lengths[plan.items], c), plan.offsets[:-1])
            totals[deal] = float(bin_time[plan.schedule].max(axis=1).sum())
            ratio = "" if deal == "tokens" else f"{totals['compute'] / totals['tokens']:.3f}"
            lines.append(f"| {world} | {deal} | {totals[deal]:.2f} | {ratio} | {plan.step_imbalance():.3f} | "
                         f"{plan.step_imbalance(costs):.3f} | {plan.step_imbalance(bin_time):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text("# Compute-balanced packing: the slowest rank's time\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
