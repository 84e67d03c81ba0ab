"""Packing fill and speed, side by side, in one run (issue 3, item 8; research digest section 1.10).

Case: lognormal sample lengths, median 300 tokens, sigma 1.0, rounded and clipped to [8, 4096];
token budget 4096 per packed row; 100k and 1M samples (seed 0): 48.58 M / 487.3 M tokens.

    . .venv/bin/activate
    python benchmarks/bench_packing.py                  # ~1.5-3 min on 2 CPU cores; prints a markdown table
    python benchmarks/bench_packing.py --sizes 100000   # quicker
    python benchmarks/bench_packing.py --skip-trl       # without TRL / datasets

Methods:

- ours: ``hf_gradfix.packing.binpack.pack`` (global Best-Fit-Decreasing), numba kernel and the
  numpy fallback (identical output); and ``PackedBatchSampler.plan`` for 8 ranks (shuffle, pack,
  balance: the bins a Trainer would see per epoch).
- TRL ``trl.data_utils.pack_dataset(ds, 4096, strategy="bfd")`` end to end on an in-memory Arrow
  ``datasets.Dataset`` with one ``input_ids`` column (uint8 zeros, the real lengths). TRL packs each
  1000-example ``map`` batch on its own, which is where its fill goes.
- axolotl-style multipack: OUR RE-IMPLEMENTATION, written to mirror axolotl's ``MultipackBatchSampler``
  (``utils/samplers/multipack.py``: ``pack_parallel`` / ``pack_group``): shuffled order (its sampler
  is a RandomSampler), groups of ``sample_packing_group_size`` = 100 000, First-Fit in the given order
  (despite the "FFD" name nothing is sorted) with at most ``sample_packing_bin_size`` = 200 samples
  per bin, one process; numba linear scan like axolotl's (a segment-tree First-Fit with the same
  result when numba is missing). Not axolotl's code; axolotl itself is not installed.
- plain padding: random batches of 8, each padded to its longest sample; and transformers'
  ``group_by_length`` (``trainer_pt_utils.get_length_grouped_indices``, mega-batches of 50 x 8).
  Fill = real tokens / padded tokens.
- ``DataCollatorWithFlattening`` (random batches of 8 flattened into one row): there is no padding,
  so its "fill" is 100 %, but the row length is whatever 8 random samples add up to. The comparable
  number under a token budget is the memory you must provision for the longest step: utilization
  = mean tokens per step / max tokens per step (and the share of steps above the 4096 budget the
  packers respect). Its "time" is building the random batches; the collator itself is timed per
  batch on 200 real batches.

Times are wall-clock seconds on this machine (best of ``--repeat`` for the fast methods); numba
compile/load time is reported separately. Ratios are vs ours (numba): time = theirs / ours,
waste = their wasted share / ours.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
import warnings

import numpy as np

from _common import ROOT, best_time, cpu_name, on_path, versions  # noqa: E402

on_path(ROOT)

from hf_gradfix.packing import binpack  # noqa: E402
from hf_gradfix.packing.sampler import PackedBatchSampler  # noqa: E402

BUDGET = 4096


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).lognormal(np.log(300), 1.0, n)
    return np.clip(np.rint(x), 8, BUDGET).astype(np.int64)


def timed(fn, repeat: int = 1):
    return best_time(fn, repeat, before=gc.collect)  # no earlier garbage collected inside a timing


# ------------------------------------------------------------------------------------------------
# axolotl-style First-Fit (our re-implementation, see the module docstring)
# ------------------------------------------------------------------------------------------------


def _ff_group_linear(lengths, capacity, bin_size, out_bin):
    """axolotl ``pack_group``: First-Fit in the given order, <= bin_size samples per bin."""
    n = lengths.shape[0]
    free = np.empty(n, dtype=np.int64)
    count = np.empty(n, dtype=np.int64)
    nbins = 0
    for j in range(n):
        size = lengths[j]
        placed = -1
        for b in range(nbins):
            if free[b] >= size and count[b] < bin_size:
                placed = b
                break
        if placed < 0:
            placed = nbins
            free[placed] = capacity
            count[placed] = 0
            nbins += 1
        free[placed] -= size
        count[placed] += 1
        out_bin[j] = placed
    return nbins


def _ff_group_tree(lengths, capacity, bin_size, out_bin):
    """Same result as _ff_group_linear (leftmost bin with room) via a max segment tree over bins."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size *= 2
    tree = [0] * (2 * size)
    count = [0] * n
    nbins = 0
    for j, L in enumerate(lengths.tolist()):
        if tree[1] >= L:
            i = 1
            while i < size:
                i = 2 * i if tree[2 * i] >= L else 2 * i + 1
            b = i - size
        else:
            b = nbins
            nbins += 1
            tree[size + b] = capacity
        out_bin[j] = b
        count[b] += 1
        v = tree[size + b] - L if count[b] < bin_size else 0
        i = size + b
        tree[i] = v
        i //= 2
        while i:
            a, c = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a >= c else c
            i //= 2
    return nbins


_FF_KERNEL = None


def axolotl_style_pack(lengths: np.ndarray, seed: int = 0, group_size: int = 100_000, bin_size: int = 200):
    global _FF_KERNEL
    if _FF_KERNEL is None:
        try:
            import numba

            _FF_KERNEL = numba.njit(cache=True)(_ff_group_linear)
        except ImportError:
            _FF_KERNEL = _ff_group_tree
    order = np.random.default_rng(seed).permutation(lengths.size)
    bins_tokens = []
    for start in range(0, order.size, group_size):
        part = lengths[order[start : start + group_size]]
        out = np.empty(part.size, dtype=np.int64)
        nb = _FF_KERNEL(part, BUDGET, bin_size, out)
        bins_tokens.append(np.bincount(out, weights=part, minlength=nb).astype(np.int64))
    return np.concatenate(bins_tokens)


# ------------------------------------------------------------------------------------------------
# the other methods
# ------------------------------------------------------------------------------------------------


def trl_pack(lengths: np.ndarray):
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets.table import InMemoryTable
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    values = pa.array(np.zeros(int(lengths.sum()), dtype=np.uint8))
    ds = datasets.Dataset(InMemoryTable(pa.table({"input_ids": pa.LargeListArray.from_arrays(pa.array(offsets), values)})))
    del values
    dt, out = timed(lambda: pack_dataset(ds, BUDGET, strategy="bfd"))
    seq = out.with_format("arrow")["seq_lengths"]
    row_tokens = pc.list_value_length(out.with_format("arrow")["input_ids"]).to_numpy().astype(np.int64)
    assert int(pc.sum(pc.list_flatten(seq)).as_py()) == int(lengths.sum()) == int(row_tokens.sum())
    return dt, row_tokens


def padding_batches(lengths: np.ndarray, seed: int, group_by_length: bool):
    import torch

    def make():
        if group_by_length:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            g = torch.Generator().manual_seed(seed)
            idx = np.asarray(get_length_grouped_indices(lengths.tolist(), 8, generator=g), dtype=np.int64)
        else:
            idx = np.random.default_rng(seed).permutation(lengths.size)
        return idx

    dt, idx = timed(make)
    L = lengths[idx]
    full = (L.size // 8) * 8
    maxes = L[:full].reshape(-1, 8).max(axis=1)
    padded = int(maxes.sum()) * 8
    if full < L.size:
        padded += int(L[full:].max()) * (L.size - full)
    return dt, int(L.sum()) / padded, math.ceil(L.size / 8)


def flattening_stats(lengths: np.ndarray, seed: int):
    dt, idx = timed(lambda: np.random.default_rng(seed).permutation(lengths.size))
    L = lengths[idx]
    full = (L.size // 8) * 8
    T = L[:full].reshape(-1, 8).sum(axis=1)
    return dt, T


def flattening_collate_time(lengths: np.ndarray, seed: int, n_batches: int = 200) -> float:
    from transformers import DataCollatorWithFlattening

    coll = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    idx = np.random.default_rng(seed).permutation(lengths.size)[: 8 * n_batches]
    feats = [{"input_ids": [1] * int(lengths[i]), "labels": [1] * int(lengths[i])} for i in idx]
    batches = [feats[k : k + 8] for k in range(0, len(feats), 8)]
    t0 = time.perf_counter()
    for b in batches:
        out = coll(b)
        assert "attention_mask" not in out and out["input_ids"].shape[0] == 1
    return (time.perf_counter() - t0) / len(batches)


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="best of N for the fast methods")
    ap.add_argument("--ranks", type=int, default=8, help="num_replicas for the sampler row")
    ap.add_argument("--skip-trl", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()

    has_numba = binpack.numba_available()
    t0 = time.perf_counter()
    binpack.pack([3, 2, 1], 4)  # load (or compile) the numba kernel once
    numba_load = time.perf_counter() - t0
    import torch

    versions_line = versions("numpy", "torch", "transformers")
    try:
        import trl

        versions_line += f", trl {trl.__version__}"
    except ImportError:
        pass
    if has_numba:
        import numba

        versions_line += f", numba {numba.__version__}"
    print(f"# Packing benchmark: lognormal lengths (median 300, sigma 1, clipped [8, 4096]), budget {BUDGET}")
    print(f"{cpu_name()}, {os.cpu_count()} CPU(s); {versions_line}")
    print(f"numba kernel load/compile: {numba_load:.2f} s (once per process, excluded below)\n" if has_numba else "numba: not installed\n")

    results: dict[str, dict[int, dict]] = {}

    def add(name, n, *, rows, fill, seconds, note=""):
        results.setdefault(name, {})[n] = dict(rows=rows, fill=fill, seconds=seconds, note=note)
        print(f"  {name:<48} n={n:>8}: rows {rows:>8}  fill {100 * fill:8.3f} %  {seconds:8.3f} s  {note}", flush=True)

    flat_notes = {}
    for n in args.sizes:
        L = lognormal_lengths(n, args.seed)
        print(f"n = {n}: {int(L.sum())} tokens, lower bound {math.ceil(L.sum() / BUDGET)} rows", flush=True)
        if has_numba:
            dt, p = timed(lambda: binpack.pack(L, BUDGET, backend="numba"), args.repeat)
            add("ours: pack, BFD, numba", n, rows=len(p), fill=p.stats().fill, seconds=dt)
        dt, p = timed(lambda: binpack.pack(L, BUDGET, backend="numpy"), args.repeat)
        add("ours: pack, BFD, numpy fallback (no numba)", n, rows=len(p), fill=p.stats().fill, seconds=dt)
        del p

        def plan():
            s = PackedBatchSampler(L, BUDGET, num_replicas=args.ranks, rank=0, seed=args.seed)
            return s.plan()

        dt, pl = timed(plan, args.repeat)
        add(
            f"ours: PackedBatchSampler epoch plan, {args.ranks} ranks",
            n,
            rows=len(pl.bins),
            fill=pl.stats.fill,
            seconds=dt,
            note=f"({pl.steps}/rank, +{pl.added_bins} bins, rank spread {pl.rank_token_spread} tok)",
        )
        del pl
        if not args.skip_trl:
            dt, rt = trl_pack(L)
            add(
                'TRL pack_dataset(strategy="bfd")',
                n,
                rows=rt.size,
                fill=rt.sum() / (rt.size * BUDGET),
                seconds=dt,
                note=f"({int(np.count_nonzero(2 * rt < BUDGET))} rows < 50 % full)",
            )
            gc.collect()
        dt, bt = timed(lambda: axolotl_style_pack(L, args.seed), 1)
        add(
            "axolotl-style First-Fit (re-impl., groups 100k)",
            n,
            rows=bt.size,
            fill=bt.sum() / (bt.size * BUDGET),
            seconds=dt,
            note="numba" if has_numba else "(segment tree, no numba)",
        )
        dt, fill, rows = padding_batches(L, args.seed, group_by_length=False)
        add("padding, random batches of 8", n, rows=rows, fill=fill, seconds=dt, note="rows = batches")
        dt, fill, rows = padding_batches(L, args.seed, group_by_length=True)
        add("padding, group_by_length (8, megabatch 50x8)", n, rows=rows, fill=fill, seconds=dt, note="rows = batches")
        dt, T = flattening_stats(L, args.seed)
        util = T.mean() / T.max()
        add(
            "DataCollatorWithFlattening, random batches of 8",
            n,
            rows=T.size,
            fill=util,
            seconds=dt,
            note="fill column = mean/max tokens per step",
        )
        flat_notes[n] = (
            f"tokens/step mean {T.mean():.0f}, p5 {np.percentile(T, 5):.0f}, p95 {np.percentile(T, 95):.0f}, "
            f"max {T.max()}, CV {T.std() / T.mean():.2f}; {100 * np.mean(T > BUDGET):.1f} % of steps exceed {BUDGET}"
        )
        print("   ", flat_notes[n], flush=True)
        gc.collect()

    collate_ms = None
    try:
        collate_ms = 1000 * flattening_collate_time(lognormal_lengths(10_000, args.seed), args.seed)
    except Exception as exc:  # pragma: no cover
        print(f"(collator timing skipped: {exc!r})")

    # ---------------------------------------------------------------- table
    ref_name = "ours: pack, BFD, numba" if has_numba else "ours: pack, BFD, numpy fallback (no numba)"
    sizes = args.sizes

    def lbl(n):
        return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n // 1000}k"

    head = "| method |" + "".join(f" {lbl(n)}: rows | fill % | time s | waste x ours | time x ours |" for n in sizes)
    sep = "|---|" + "---:|---:|---:|---:|---:|" * len(sizes)
    print("\n" + head + "\n" + sep)
    for name, per in results.items():
        cells = []
        for n in sizes:
            r = per.get(n)
            ref = results[ref_name][n]
            if r is None:
                cells.append(" - | - | - | - | - |")
                continue
            waste, ref_waste = 1 - r["fill"], 1 - ref["fill"]
            wr = "1" if name == ref_name else (f"{waste / ref_waste:,.0f}" if ref_waste > 0 else "-")
            tr = "1" if name == ref_name else f"{r['seconds'] / ref['seconds']:.1f}"
            fill = f"{100 * r['fill']:.3f}"
            if name.startswith("DataCollatorWithFlattening"):
                fill = f"100 (no pad); {100 * r['fill']:.1f} of peak"
            cells.append(f" {r['rows']} | {fill} | {r['seconds']:.3f} | {wr} | {tr} |")
        print(f"| {name} |" + "".join(cells))
    print()
    for n in sizes:
        print(f"- DataCollatorWithFlattening at {lbl(n)}: {flat_notes[n]}.")
    if collate_ms is not None:
        print(f"- DataCollatorWithFlattening(return_flash_attn_kwargs=True) collate time: {collate_ms:.2f} ms per batch of 8.")
    print(
        "- Padding rows are batches of 8 padded to their longest sample; 'fill' = real / padded tokens. "
        "Flattening has no padding; its fill column is mean / peak tokens per step (memory provisioned for the peak)."
    )
    print(f"- total benchmark wall time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
