"""Epoch-plan time and host memory of ``PackedBatchSampler`` at 10M samples (issue 13, item 2).

Case: lognormal lengths (median 300, sigma 1.0, clipped to [8, 4096]), budget 4096, as in
``bench_packing.py``; every rank builds the full plan (``rank="all"``, what accelerate's
``BatchSamplerShard`` iterates) and keeps it for the epoch.

Reported per rank (one process plays one rank): sampler construction (lengths, fingerprint) and
``plan(0)`` wall time; the plan's retained bytes (its arrays); the Python-heap + numpy peak during
construction and planning (``tracemalloc``, which numpy reports its buffers to); the process's
max RSS growth. Also the time to iterate one rank's bins (what the DataLoader does over an epoch).
numba is used if importable (``--backend``), else the numpy fallback; the output says which.

    python benchmarks/bench_packing_plan.py                         # 10M samples, 8 ranks
    python benchmarks/bench_packing_plan.py --n 1000000 --ranks 64
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
import tracemalloc

import numpy as np

from _common import ROOT, on_path, peak_rss_bytes  # noqa: E402

on_path(ROOT)

from hf_gradfix.packing import binpack  # noqa: E402
from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402


def lognormal_lengths(n: int, seed: int = 0, budget: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(300), 1.0, n)), 8, budget).astype(np.int32)


def _rss_mib() -> float:
    return peak_rss_bytes() / 2**20


def plan_bytes(plan) -> int:
    total = 0
    for value in vars(plan).values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--backend", default="auto", choices=["auto", "numba", "numpy"])
    ap.add_argument("--iterate", action="store_true", help="also time iterating one rank's bins")
    args = ap.parse_args()

    lengths = lognormal_lengths(args.n, budget=args.budget)
    backend = args.backend
    if backend == "auto":
        backend = "numba" if binpack.numba_available() else "numpy"
    print(f"# PackedBatchSampler plan: {args.n:,} samples, {args.ranks} ranks, budget {args.budget}, backend {backend}")
    print(f"# python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    if backend == "numba":  # compile/load the kernel outside the timing
        binpack.pack_arrays(lengths[:1000], args.budget, backend="numba")
    gc.collect()
    # yardstick for this machine's speed right now: one permutation of n (about 0.25 s for 10M on an idle core)
    c = time.process_time()
    np.random.default_rng(1).permutation(args.n)
    yard = time.process_time() - c
    # 1. time (no tracing): wall and CPU seconds (the CPU time is what a loaded machine does not inflate much)
    w0, c0 = time.perf_counter(), time.process_time()
    sampler = PackedBatchSampler(lengths, args.budget, num_replicas=args.ranks, rank="all", seed=0, backend=backend)
    w1, c1 = time.perf_counter(), time.process_time()
    plan = sampler.plan(0)
    w2, c2 = time.perf_counter(), time.process_time()
    stats = plan.stats
    retained = plan_bytes(plan)
    del sampler, plan
    gc.collect()
    # 2. memory: the same again under tracemalloc (numpy reports its buffers to it)
    rss0 = _rss_mib()
    tracemalloc.start()
    sampler = PackedBatchSampler(lengths, args.budget, num_replicas=args.ranks, rank="all", seed=0, backend=backend)
    plan = sampler.plan(0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _rss_mib()
    load = os.getloadavg()[0]
    print("| samples | ranks | backend | construct s (cpu) | plan s (cpu) | total wall s | total cpu s | plan retained MiB | peak MiB (tracemalloc) | max RSS growth MiB | bins | fill | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.n:,} | {args.ranks} | {backend} | {w1 - w0:.2f} ({c1 - c0:.2f}) | {w2 - w1:.2f} ({c2 - c1:.2f}) | "
        f"{w2 - w0:.2f} | {c2 - c0:.2f} | {retained / 2**20:.0f} | {peak / 2**20:.0f} | {rss1 - rss0:.0f} | "
        f"{stats.n_bins:,} | {100 * stats.fill:.3f}% | {load:.1f} |"
    )
    print(f"# yardstick: permutation of {args.n:,} took {yard:.2f} cpu s here; plan total = {(c2 - c0) / yard:.1f} permutations")
    print(f"# input lengths array (the caller's): {lengths.nbytes / 2**20:.0f} MiB; sampler keeps {sampler.lengths.nbytes / 2**20:.0f} MiB")
    if args.iterate:
        t3 = time.perf_counter()
        n_bins = sum(1 for _ in PackedBatchSampler(lengths, args.budget, num_replicas=args.ranks, rank=0, seed=0, backend=backend))
        print(f"# iterating rank 0's {n_bins:,} bins (plan included): {time.perf_counter() - t3:.2f} s")


if __name__ == "__main__":
    main()
