"""Streaming fill vs the map-style packer on the same lengths (issue 13, item 1).

Lengths: lognormal, median 300, sigma 1.0, clipped to [8, 4096], budget 4096 (as ``bench_packing.py``), in stream
order (seed 0). Map-style: ``PackedBatchSampler.plan`` (global BFD over all lengths, 8 ranks). Streaming:
``StreamingPacker`` with several buffer sizes (``min_fill`` 0.98, 8 ranks). Fill = tokens / (rows x budget);
also the rows each packer needs and the time per 1k samples (the streaming packer works on sample dicts whose
``input_ids`` are ``range`` objects, so only the packing is timed, not tokenization).

    python benchmarks/bench_packing_stream.py                 # 100k samples
    python benchmarks/bench_packing_stream.py --n 20000
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from _common import ROOT, on_path  # noqa: E402

on_path(ROOT)

from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402
from hf_gradfix.packing.stream import StreamingPacker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--buffers", default="16,64,256,1000,4000,16000")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, args.n)), 8, args.budget).astype(np.int64)
    tokens = int(lengths.sum())
    lower = -(-tokens // args.budget)
    print(f"# {args.n:,} samples, {tokens:,} tokens, budget {args.budget}, {args.ranks} ranks; lower bound {lower:,} rows; load avg {os.getloadavg()[0]:.1f}")
    print("| packer | buffer | rows | fill | vs map-style (points) | s per 1k samples |")
    print("|---|---|---|---|---|---|")
    t = time.perf_counter()
    plan = PackedBatchSampler(lengths, args.budget, num_replicas=args.ranks, rank="all").plan(0)
    dt = time.perf_counter() - t
    map_fill = tokens / (plan.n_bins * args.budget)
    print(f"| map-style (global BFD) | all | {plan.n_bins:,} | {100 * map_fill:.3f}% | 0 | {1000 * dt / args.n:.4f} |")
    samples = [{"input_ids": range(int(n))} for n in lengths]
    for size in (int(x) for x in args.buffers.split(",")):
        t = time.perf_counter()
        rows = sum(1 for _ in StreamingPacker(samples, args.budget, buffer_size=size, num_replicas=args.ranks, rank="all"))
        dt = time.perf_counter() - t
        fill = tokens / (rows * args.budget)
        print(f"| streaming | {size:,} | {rows:,} | {100 * fill:.3f}% | {100 * (fill - map_fill):+.3f} | {1000 * dt / args.n:.4f} |")


if __name__ == "__main__":
    main()
