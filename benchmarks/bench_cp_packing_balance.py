"""Per-rank attention work of context parallelism over packed rows, with and without the document-aware balancer.

A realistic length mix (lognormal documents, median ~400 tokens, plus a few long ones of 3-7k tokens) is packed by
hf_gradfix's own sampler into rows of 8192 tokens; every row is laid out as :mod:`hf_gradfix.parallel.context_packing`
lays it out (documents padded to a multiple of 2 x cp, the row to a multiple of cp x 128) and split over cp ranks by:

* ``none``: contiguous shards (rank r gets tokens [r L/cp, (r+1) L/cp));
* ``head_tail``: torch's whole-row head-tail balancer (what causal CP without documents uses);
* ``per_document_torch_order``: torch 2.13's ``_PerDocumentHeadTailLoadBalancer`` indices split contiguously, as
  torch's own ``_context_parallel_shard`` does (its chunks come document by document);
* ``per_document``: the same balancer regrouped by rank (what hf_gradfix trains with): every rank gets a head and a
  tail chunk of every document.

Work per rank: (query, key) pairs the document-causal mask allows (exact FLOP share of any kernel that skips masked
scores) and 128 x 128 score blocks with at least one allowed pair (what a block-sparse kernel such as FlexAttention
computes). A step waits for its slowest rank, so the figure is max / mean over ranks per row (1.0 = perfect), averaged
over the rows and worst row. The CPU path (SDPA with a dense mask) computes every score of its local rows whatever the
balance, so this matters on block-sparse kernels; the pair counts are the FLOPs the mask keeps.

    python benchmarks/bench_cp_packing_balance.py [--out benchmarks/results/cp_packing_balance.md]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402
from hf_gradfix.parallel.context_packing import masked_pairs_per_rank  # noqa: E402

ROW, BLOCK = 8192, 128
BALANCERS = ("none", "head_tail", "per_document_torch_order", "per_document")


def lengths(n: int = 600, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.exp(math.log(400) + 1.0 * torch.randn(n, generator=g)).clamp(16, ROW).round().long().tolist()
    long = torch.randint(3000, 7000, (6,), generator=g).tolist()
    return body + long


def rows(lens: list[int]) -> list[list[int]]:
    sampler = PackedBatchSampler(lens, ROW, num_replicas=1, rank="all", seed=0)
    sampler.set_epoch(0)
    return [[lens[i] for i in b] for b in sampler]


def layout(docs: list[int], cp: int) -> list[int]:
    padded = [n + (-n) % (2 * cp) for n in docs]
    multiple = cp * BLOCK
    tail = (-sum(padded)) % multiple
    return padded + ([tail] if tail else [])


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cp_packing_balance.md"))
    p.add_argument("--cp", default="2,4,8")
    a = p.parse_args(argv)
    lens = lengths()
    packed = rows(lens)
    lines = [
        "# CP x packing: per-rank attention work with and without the document-aware balancer",
        "",
        f"{len(lens)} documents (lognormal, median 400 tokens, sigma 1.0, 16-{ROW}; plus 6 of 3000-7000 tokens) packed "
        f"into {len(packed)} rows of <= {ROW} tokens by hf_gradfix's PackedBatchSampler. Imbalance = max / mean work "
        "over the cp ranks of a row (1.00 = perfect; a step waits for the slowest rank): mean over rows / worst row. "
        f"torch {torch.__version__}. Produced by `python benchmarks/bench_cp_packing_balance.py`.",
        "",
        "| cp | balancer | allowed (q, k) pairs: mean / worst | 128x128 blocks computed: mean / worst | pairs, rows with a document > 2048 tokens: mean |",
        "|---|---|---|---|---|",
    ]
    start = time.time()
    for cp in (int(c) for c in a.cp.split(",")):
        for balancer in BALANCERS:
            pair_ratios, block_ratios, long_ratios = [], [], []
            for docs in packed:
                row = layout(docs, cp)
                for ratios, blk in ((pair_ratios, 0), (block_ratios, BLOCK)):
                    work = masked_pairs_per_rank(row, cp, balancer, block=blk)
                    ratios.append(max(work) / (sum(work) / cp))
                if max(docs) > ROW // 4:
                    long_ratios.append(pair_ratios[-1])
            lines.append(f"| {cp} | {balancer} | {sum(pair_ratios) / len(pair_ratios):.2f} / {max(pair_ratios):.2f} | "
                         f"{sum(block_ratios) / len(block_ratios):.2f} / {max(block_ratios):.2f} | "
                         f"{sum(long_ratios) / len(long_ratios):.2f} ({len(long_ratios)} rows) |")
            print(lines[-1], flush=True)
    lines += ["", "On the CPU path (SDPA with a dense (L/cp) x L mask) every rank computes all its scores, so the step time "
              "is the same on every rank whatever the balancer; these ratios are the step-time ratios of a kernel that "
              "skips masked scores (pairs) or masked 128-blocks (FlexAttention-style).", "",
              f"({time.time() - start:.0f} s on CPU)", ""]
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
