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

Step time on CPU (``--time-cp``): the attention forward of each rank's local queries against the gathered row,
timed with a block-sparse kernel that runs here, torch's FlexAttention compiled for the CPU (forward only: its
backward is not implemented on CPU in torch 2.13), under each balancer's document-causal block mask. A step waits
for its slowest rank, so the step's attention time is the sum over rows of the slowest rank's time.

    python benchmarks/bench_cp_packing_balance.py [--out benchmarks/results/cp_packing_balance.md] [--time-cp 2,4]
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


def rank_queries(row: list[int], cp: int, balancer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids of the permuted row, document of every original token, the permutation as rank r sees it)."""
    from hf_gradfix.parallel.context_packing import load_balance_indices

    length = sum(row)
    if balancer == "none":
        indices = torch.arange(length)
    elif balancer == "head_tail":
        indices = load_balance_indices([[length]], cp)[0]
    else:
        indices = load_balance_indices([row], cp, by_rank=balancer == "per_document")[0]
    doc = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
    return indices, doc, indices.reshape(cp, length // cp)


def time_attention(packed: list[list[int]], cps: list[int], heads: int = 4, head_dim: int = 64, reps: int = 3) -> list[str]:
    """Per balancer: the attention forward time a step waits for (sum over rows of the slowest rank), FlexAttention
    compiled for the CPU under the block mask each rank's queries get; every row padded to the same length."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    kernel = torch.compile(flex_attention, dynamic=False)
    long_rows = [docs for docs in packed if max(docs) > ROW // 4]
    out = [
        "",
        f"## Step time on CPU: attention forward, FlexAttention (block-sparse) compiled for the CPU",
        "",
        f"The {len(long_rows)} rows holding a document > 2048 tokens, every row padded to the same length; each rank's "
        f"local queries against the whole row ({heads} heads x {head_dim}, fp32, one thread), fastest of {reps} interleaved "
        "rounds per (row, rank, balancer). Step = sum over rows of the slowest rank (what a synchronous step waits for); ideal = sum "
        "over rows of the mean rank. torch's FlexAttention backward is not implemented on CPU, so this is the forward; "
        "its backward skips the same blocks.",
        "",
        "| cp | balancer | step (s) | ideal (s) | step / ideal | step vs none |",
        "|---|---|---:|---:|---:|---:|",
    ]
    torch.set_num_threads(1)
    for cp in cps:
        rows_laid = [layout(docs, cp) for docs in long_rows]
        full = max(sum(r) for r in rows_laid)
        rows_laid = [r + [full - sum(r)] if full > sum(r) else r for r in rows_laid]
        shard = full // cp
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, shard, head_dim, generator=g)
        k = torch.randn(1, heads, full, head_dim, generator=g)
        v = torch.randn(1, heads, full, head_dim, generator=g)
        step = dict.fromkeys(BALANCERS, 0.0)
        ideal = dict.fromkeys(BALANCERS, 0.0)
        for row in rows_laid:
            masks = {}
            for balancer in BALANCERS:
                indices, doc, by_rank = rank_queries(row, cp, balancer)
                for r in range(cp):
                    def mask_mod(b, h, qi, ki, mine=by_rank[r], indices=indices, doc=doc):
                        gq, gk = mine[qi], indices[ki]
                        return (doc[gq] == doc[gk]) & (gk <= gq)

                    masks[balancer, r] = create_block_mask(mask_mod, 1, 1, shard, full, device="cpu", BLOCK_SIZE=BLOCK)
            best = dict.fromkeys(masks, float("inf"))
            kernel(q, k, v, block_mask=masks[BALANCERS[0], 0])  # warm-up (the compile, once per cp)
            # interleaved rounds, fastest of each: drift and other load on the shared cores hit every balancer alike
            for _ in range(reps):
                for key, block_mask in masks.items():
                    t = time.perf_counter()
                    kernel(q, k, v, block_mask=block_mask)
                    best[key] = min(best[key], time.perf_counter() - t)
            for balancer in BALANCERS:
                times = [best[balancer, r] for r in range(cp)]
                step[balancer] += max(times)
                ideal[balancer] += sum(times) / cp
        for balancer in BALANCERS:
            out.append(f"| {cp} | {balancer} | {step[balancer]:.2f} | {ideal[balancer]:.2f} | "
                       f"{step[balancer] / ideal[balancer]:.2f} | {step[balancer] / step['none']:.2f} |")
            print(out[-1], flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cp_packing_balance.md"))
    p.add_argument("--cp", default="2,4,8")
    p.add_argument("--time-cp", default="2,4", help="cp degrees of the step-time table ('' to skip it)")
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
              "skips masked scores (pairs) or masked 128-blocks (FlexAttention-style)."]
    if a.time_cp:
        lines += time_attention(packed, [int(c) for c in a.time_cp.split(",")])
    lines += ["", f"({time.time() - start:.0f} s on CPU)", ""]
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
