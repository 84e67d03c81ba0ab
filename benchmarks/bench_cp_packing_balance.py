"""Per-rank attention work of context parallelism over packed rows, with and without the document-aware balancers.

A realistic length mix (lognormal documents, median ~400 tokens, plus a few long ones of 3-7k tokens) is packed by
hf_gradfix's own sampler into rows of 8192 tokens; every row is laid out as :mod:`hf_gradfix.parallel.context_packing`
lays it out and split over cp ranks by:

* ``none``: contiguous shards (rank r gets tokens [r L/cp, (r+1) L/cp));
* ``head_tail``: torch's whole-row head-tail balancer (what causal CP without documents uses);
* ``per_document_torch_order``: torch 2.13's ``_PerDocumentHeadTailLoadBalancer`` indices split contiguously, as
  torch's own ``_context_parallel_shard`` does (its chunks come document by document);
* ``per_document``: the same balancer regrouped by rank (``parallel.cp_balance: per_document``): every rank gets a
  head and a tail chunk of every document;
* ``long_documents`` (``parallel.cp_balance: long_documents``): only the documents longer than the threshold (by
  default: longer than a rank's share of the row) are cut head-tail; the others stay whole and are dealt to the rank
  with the least attention work.

The first four pad every document to a multiple of 2 x cp and the row to a multiple of cp x 128; ``long_documents``
pads only the documents it cuts, and each rank's slice to a multiple of 128.

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
        [--threshold N] [--time-every N] [--reps N]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from _common import ROOT, on_path, results_path  # noqa: E402

on_path(ROOT)

from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402
from hf_gradfix.parallel.context_packing import (load_balance_indices, long_document_indices,  # noqa: E402
                                                 masked_pairs_per_rank)

ROW, BLOCK = 8192, 128
BALANCERS = ("none", "head_tail", "per_document_torch_order", "per_document", "long_documents")
TIMED = ("none", "per_document", "long_documents")
SWEEP = (512, 1024, 2048, None)  # long_documents thresholds compared (None: documents longer than a rank's share)


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
    """The per-document layout: every document padded to a multiple of 2 x cp, the row to a multiple of cp x 128."""
    padded = [n + (-n) % (2 * cp) for n in docs]
    multiple = cp * BLOCK
    tail = (-sum(padded)) % multiple
    return padded + ([tail] if tail else [])


def work(docs: list[int], cp: int, balancer: str, block: int, threshold: int | None) -> list[int]:
    """Per-rank work of one packed row (``docs``: the documents as packed) under ``balancer``."""
    if balancer == "long_documents":
        return masked_pairs_per_rank(docs, cp, balancer, block=block, threshold=threshold)
    return masked_pairs_per_rank(layout(docs, cp), cp, balancer, block=block)


def row_tokens(docs: list[int], cp: int, balancer: str, threshold: int | None) -> int:
    """The laid-out row's length (documents and pads)."""
    if balancer == "long_documents":
        return long_document_indices([docs], cp, threshold, multiple=BLOCK)[1].shape[1]
    return sum(layout(docs, cp))


def rank_queries(docs: list[int], cp: int, balancer: str, full: int, threshold: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the permutation of the laid-out row padded to ``full`` tokens, document of every laid-out token, the
    permutation as the ranks hold it [cp, full / cp])."""
    if balancer == "long_documents":
        laid, indices = long_document_indices([docs], cp, threshold, multiple=BLOCK, length=full)
        row, indices = laid[0], indices[0]
    else:
        row = layout(docs, cp)
        row = row + [full - sum(row)] if full > sum(row) else row  # the padding to the common length: one document
        if balancer == "none":
            indices = torch.arange(full)
        elif balancer == "head_tail":
            indices = load_balance_indices([[full]], cp)[0]
        else:
            indices = load_balance_indices([row], cp, by_rank=balancer == "per_document")[0]
    doc = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
    return indices, doc, indices.reshape(cp, full // cp)


def time_attention(packed: list[list[int]], cps: list[int], threshold: int | None, every: int = 1, heads: int = 4,
                   head_dim: int = 64, reps: int = 3) -> list[str]:
    """Per balancer: the attention forward time a step waits for (sum over rows of the slowest rank), FlexAttention
    compiled for the CPU under the block mask each rank's queries get; every row padded to the same length. Rows
    with a document > 2048 tokens (the cut long documents dominate them) and rows without (short documents only,
    where per_document cuts every one) are summed apart."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    kernel = torch.compile(flex_attention, dynamic=False)
    timed = packed[::every]
    groups = {"with a document > 2048": [d for d in timed if max(d) > ROW // 4],
              "without": [d for d in timed if max(d) <= ROW // 4]}
    groups["all"] = groups["with a document > 2048"] + groups["without"]
    which = "every row" if every == 1 else f"one row in {every} ({len(timed)} of {len(packed)}, to keep the run short)"
    out = [
        "",
        "## Step time on CPU: attention forward, FlexAttention (block-sparse) compiled for the CPU",
        "",
        f"{which[0].upper()}{which[1:]}, every row padded to the same length (the longest layout of the three); each "
        f"rank's local queries against the whole row ({heads} heads x {head_dim}, fp32, one thread), fastest of {reps} "
        "interleaved rounds per (row, rank, balancer). Step = sum over the rows of the slowest rank (what a "
        "synchronous step waits for); ideal = sum over the rows of the mean rank. Rows holding a document > 2048 "
        "tokens and rows without are summed apart. torch's FlexAttention backward is not implemented on CPU, so this "
        "is the forward; its backward skips the same blocks.",
        "",
        "| cp | rows | balancer | step (s) | ideal (s) | step / ideal | step vs none | step vs per_document |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    torch.set_num_threads(1)
    for cp in cps:
        full = max(max(row_tokens(docs, cp, b, threshold) for b in ("per_document", "long_documents"))
                   for docs in timed)
        shard = full // cp
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, shard, head_dim, generator=g)
        k = torch.randn(1, heads, full, head_dim, generator=g)
        v = torch.randn(1, heads, full, head_dim, generator=g)
        step = {name: dict.fromkeys(TIMED, 0.0) for name in groups}
        ideal = {name: dict.fromkeys(TIMED, 0.0) for name in groups}
        kernel_ready = False
        for docs in timed:
            masks = {}
            for balancer in TIMED:
                indices, doc, by_rank = rank_queries(docs, cp, balancer, full, threshold)
                for r in range(cp):
                    def mask_mod(b, h, qi, ki, mine=by_rank[r], indices=indices, doc=doc):
                        gq, gk = mine[qi], indices[ki]
                        return (doc[gq] == doc[gk]) & (gk <= gq)

                    masks[balancer, r] = create_block_mask(mask_mod, 1, 1, shard, full, device="cpu", BLOCK_SIZE=BLOCK)
            if not kernel_ready:  # warm-up: the compile, once per cp
                kernel(q, k, v, block_mask=masks[TIMED[0], 0])
                kernel_ready = True
            best = dict.fromkeys(masks, float("inf"))
            # interleaved rounds, fastest of each: drift and other load on the shared cores hit every balancer alike
            for _ in range(reps):
                for key, block_mask in masks.items():
                    t = time.perf_counter()
                    kernel(q, k, v, block_mask=block_mask)
                    best[key] = min(best[key], time.perf_counter() - t)
            for name, rows_of_group in groups.items():
                if any(docs is d for d in rows_of_group):
                    for balancer in TIMED:
                        times = [best[balancer, r] for r in range(cp)]
                        step[name][balancer] += max(times)
                        ideal[name][balancer] += sum(times) / cp
        for name, rows_of_group in groups.items():
            for balancer in TIMED:
                st, ie = step[name][balancer], ideal[name][balancer]
                out.append(f"| {cp} | {name} ({len(rows_of_group)}) | {balancer} | {st:.2f} | {ie:.2f} | {st / ie:.2f} | "
                           f"{st / step[name]['none']:.2f} | {st / step[name]['per_document']:.2f} |")
                print(out[-1], flush=True)
    return out


def imbalance_table(packed: list[list[int]], cps: list[int], threshold: int | None) -> list[str]:
    lines = [
        "| cp | balancer | allowed (q, k) pairs: mean / worst | 128x128 blocks computed: mean / worst | pairs, rows with a document > 2048 tokens: mean |",
        "|---|---|---|---|---|",
    ]
    for cp in cps:
        for balancer in BALANCERS:
            pair_ratios, block_ratios, long_ratios = [], [], []
            for docs in packed:
                for ratios, blk in ((pair_ratios, 0), (block_ratios, BLOCK)):
                    w = work(docs, cp, balancer, blk, threshold)
                    ratios.append(max(w) / (sum(w) / cp))
                if max(docs) > ROW // 4:
                    long_ratios.append(pair_ratios[-1])
            lines.append(f"| {cp} | {balancer} | {sum(pair_ratios) / len(pair_ratios):.2f} / {max(pair_ratios):.2f} | "
                         f"{sum(block_ratios) / len(block_ratios):.2f} / {max(block_ratios):.2f} | "
                         f"{sum(long_ratios) / len(long_ratios):.2f} ({len(long_ratios)} rows) |")
            print(lines[-1], flush=True)
    return lines


def totals(packed: list[list[int]], cp: int, balancer: str, threshold: int | None) -> dict[str, int]:
    """Over every row: laid-out tokens, blocks summed over the ranks, blocks of the slowest rank."""
    out = dict(tokens=0, blocks=0, slowest=0)
    for docs in packed:
        w = work(docs, cp, balancer, BLOCK, threshold)
        out["tokens"] += row_tokens(docs, cp, balancer, threshold)
        out["blocks"] += sum(w)
        out["slowest"] += max(w)
    return out


def block_work_table(packed: list[list[int]], cps: list[int], threshold: int | None) -> list[str]:
    documents = sum(sum(docs) for docs in packed)
    lines = [
        "| cp | balancer | row tokens (pads %) | blocks, all ranks | vs none | vs per_document | blocks, slowest rank | vs none | vs per_document |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cp in cps:
        t = {b: totals(packed, cp, b, threshold) for b in TIMED}
        for b in TIMED:
            lines.append(
                f"| {cp} | {b} | {t[b]['tokens']} ({100 * (t[b]['tokens'] / documents - 1):.1f} %) | {t[b]['blocks']} | "
                f"{t[b]['blocks'] / t['none']['blocks']:.2f} | {t[b]['blocks'] / t['per_document']['blocks']:.2f} | "
                f"{t[b]['slowest']} | {t[b]['slowest'] / t['none']['slowest']:.2f} | "
                f"{t[b]['slowest'] / t['per_document']['slowest']:.2f} |")
            print(lines[-1], flush=True)
    return lines


def dense_table(packed: list[list[int]], cps: list[int], threshold: int | None) -> list[str]:
    """The layouts as training builds them (no rounding to 128-blocks): pads, and the dense path's score work
    ((L/cp) x L per rank and row, what SDPA with a dense mask computes whatever the balance)."""
    documents = sum(sum(docs) for docs in packed)
    lines = [
        "| cp | per_document: pads % | long_documents: pads % | dense scores, long_documents / per_document |",
        "|---|---:|---:|---:|",
    ]
    for cp in cps:
        per_doc = [sum(n + (-n) % (2 * cp) for n in docs) for docs in packed]
        long_docs = [long_document_indices([docs], cp, threshold)[1].shape[1] for docs in packed]
        lines.append(f"| {cp} | {100 * (sum(per_doc) / documents - 1):.2f} | {100 * (sum(long_docs) / documents - 1):.2f} | "
                     f"{sum(n * n for n in long_docs) / sum(n * n for n in per_doc):.3f} |")
        print(lines[-1], flush=True)
    return lines


def sweep_table(packed: list[list[int]], cps: list[int]) -> list[str]:
    lines = [
        "| cp | threshold | pairs: mean / worst | blocks: mean / worst | row tokens vs per_document | blocks, all ranks vs per_document | blocks, slowest rank vs per_document |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for cp in cps:
        base = totals(packed, cp, "per_document", None)
        for threshold in SWEEP:
            t = totals(packed, cp, "long_documents", threshold)
            pairs, blocks = [], []
            for docs in packed:
                for ratios, blk in ((pairs, 0), (blocks, BLOCK)):
                    w = work(docs, cp, "long_documents", blk, threshold)
                    ratios.append(max(w) / (sum(w) / cp))
            name = threshold if threshold is not None else f"none (a rank's share, {ROW // cp})"
            lines.append(f"| {cp} | {name} | {sum(pairs) / len(pairs):.2f} / {max(pairs):.2f} | "
                         f"{sum(blocks) / len(blocks):.2f} / {max(blocks):.2f} | {t['tokens'] / base['tokens']:.2f} | "
                         f"{t['blocks'] / base['blocks']:.2f} | {t['slowest'] / base['slowest']:.2f} |")
            print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=results_path("cp_packing_balance.md"))
    p.add_argument("--cp", default="2,4,8")
    p.add_argument("--time-cp", default="2,4", help="cp degrees of the step-time table ('' to skip it)")
    p.add_argument("--threshold", type=int, default=None,
                   help="long_documents: cut documents longer than this (default: those longer than a rank's share)")
    p.add_argument("--time-every", type=int, default=1, help="time every N-th packed row only (1: all)")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per (row, rank, balancer); the fastest is kept")
    a = p.parse_args(argv)
    lens = lengths()
    packed = rows(lens)
    cps = [int(c) for c in a.cp.split(",")]
    threshold = "a rank's share of the row (the default)" if a.threshold is None else f"{a.threshold} tokens"
    flags = (("--cp", a.cp, "2,4,8"), ("--time-cp", a.time_cp, "2,4"), ("--threshold", a.threshold, None),
             ("--time-every", a.time_every, 1), ("--reps", a.reps, 3))
    command = "python benchmarks/bench_cp_packing_balance.py" + "".join(
        f" {flag} {value if value != '' else repr('')}" for flag, value, default in flags if value != default)
    lines = [
        "# CP x packing: per-rank attention work with and without the document-aware balancers",
        "",
        f"{len(lens)} documents (lognormal, median 400 tokens, sigma 1.0, 16-{ROW}; plus 6 of 3000-7000 tokens) packed "
        f"into {len(packed)} rows of <= {ROW} tokens by hf_gradfix's PackedBatchSampler. Imbalance = max / mean work "
        "over the cp ranks of a row (1.00 = perfect; a step waits for the slowest rank): mean over rows / worst row. "
        f"long_documents splits the documents longer than {threshold}. torch {torch.__version__}. Produced by "
        f"`{command}`.",
        "",
    ]
    start = time.time()
    lines += imbalance_table(packed, cps, a.threshold)
    lines += ["", "On the CPU path (SDPA with a dense (L/cp) x L mask) every rank computes all its scores, so the step time "
              "is the same on every rank whatever the balancer; these ratios are the step-time ratios of a kernel that "
              "skips masked scores (pairs) or masked 128-blocks (FlexAttention-style).",
              "", "## Block work: long_documents vs per_document and none", "",
              "Summed over the rows: the laid-out tokens (pads % over the documents' tokens), the 128x128 blocks every "
              "rank computes together (total work) and those of the slowest rank of each row (what a step waits for).",
              ""]
    lines += block_work_table(packed, cps, a.threshold)
    lines += ["", "## The dense-mask path (what trains here)", "",
              "Training lays each row out alone (no rounding to 128-blocks) and attends through SDPA with a dense "
              "(L/cp) x L mask: every rank computes all its scores, so the balance does not change the step; only the "
              "pads do (row length L).", ""]
    lines += dense_table(packed, cps, a.threshold)
    lines += ["", "## long_documents: the threshold", "",
              "Documents longer than the threshold are cut head-tail over the ranks (and always those longer than a "
              "rank's share of the row); the ratios are over every row, against per_document.", ""]
    lines += sweep_table(packed, cps)
    if a.time_cp:
        lines += time_attention(packed, [int(c) for c in a.time_cp.split(",")], a.threshold, a.time_every, reps=a.reps)
    lines += ["", f"({time.time() - start:.0f} s on CPU)", ""]
    Path(a.out).write_text("\n".join(lines))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
