"""GaLore with low-rank gradient accumulation: peak memory of one training step, DDP traffic, quality, in one run.

    python benchmarks/bench_lowrank_grads.py               # ~10 min on 2 busy CPU cores; writes benchmarks/results/lowrank_grads.md
    python benchmarks/bench_lowrank_grads.py --preset 0.5b # the issue's size (~0.5B; ~6 GB RAM for AdamW, slow on CPU)
    python benchmarks/bench_lowrank_grads.py --quick --no-write                   # smoke test

Memory.  A random-init Llama (default preset ``125m``: hidden 768, 12 layers, intermediate 2048, vocabulary 32000,
untied, fp32: 134M parameters; smaller than the issue's 0.5-1B because this machine has 2 shared cores and 24 GB
shared by several developers, ``--preset 0.5b`` runs the larger one), micro-batch 1 x 128 tokens, gradient
accumulation 4.  Each arm trains one warm-up step, then one measured step under torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``: every tensor storage, classified as parameter / gradient / optimizer
state / activation / temporary); the figure is the peak of the storage actually allocated during that step:

- ``adamw``                torch.optim.AdamW, GA 4;
- ``galore-torch``         galore-torch 1.0 GaLoreAdamW (README recipe, std side), GA 4;
- ``galore-torch layerwise`` galore-torch's layer-wise recipe (a GaLoreAdamW / AdamW per parameter stepped in a
  post-accumulate-grad hook), GA 1 as it requires (so it processes 1/4 of the tokens per step);
- ``ours full grads``      hf_gradfix GaLoreAdamW, GA 4, full gradients;
- ``ours lowrank fp32``    the same with ``lowrank_grads=True`` (rank-r accumulators, staggered refreshes);
- ``ours lowrank 8-bit``   GaLoreAdamW8bit (bitsandbytes blockwise 8-bit moments) with ``lowrank_grads=True``.

All GaLore arms: rank 128 on the 84 attention/MLP matrices, update_proj_gap 200, scale 0.25; ours with stagger
(refreshes spread over the gap) and ``initial_basis="first_microbatch"`` for the low-rank arms.  Beside each measured
peak: the planner's prediction (``hf_gradfix.plan.estimate`` for the same model, fp32, GA 4, the same optimizer and
``lowrank_grads``; its components without the 10 % fragmentation margin).

DDP traffic.  What one optimizer step all-reduces under DDP, counted from the tensors each arm holds at the step:
plain DDP all-reduces every gradient; with ``lowrank_grads`` DDP all-reduces the unprojected gradients and the
optimizer the rank-r accumulators plus the full gradients of the matrices refreshing at that step (bit for bit what
``tests/optim/test_optim_distributed.py`` all-reduces in its 2-process run, where the bytes are measured with a DDP comm
hook and the optimizer's counter).

Quality.  A tiny Llama (hidden 128, 2 layers, vocabulary 512) on bench_optim.py's synthetic bigram task, GA 4,
``--quality-steps`` steps, ``--seeds`` seeds: validation loss of full-gradient GaLore vs low-rank accumulation
(exact first basis, first-micro-batch first basis, 8-bit).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from _common import HERE, ROOT, cpu_name, on_path, results_path  # noqa: E402

on_path(ROOT, HERE)  # hf_gradfix of this checkout; _ref_loader beside this script

import hf_gradfix.optim as hopt  # noqa: E402

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")

PRESETS = {
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12),
    "0.5b": dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=24, num_attention_heads=20),
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4),
}
MiB = 1024**2
RANK, GAP, SCALE, LR = 128, 200, 0.25, 1e-2
RANKS = {"125m": 128, "0.5b": 256, "tiny": 16}
ARMS = ["adamw", "galore-torch", "galore-torch layerwise", "ours full grads", "ours lowrank fp32", "ours lowrank 8-bit"]


def llama_config(preset: str, vocab: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False,
                                    num_key_value_heads=PRESETS[preset]["num_attention_heads"], **PRESETS[preset])


def galore_targets(model) -> list[torch.Tensor]:
    """galore-torch's README selection: nn.Linear modules whose name contains 'attn' or 'mlp'."""
    return [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ("attn" in n or "mlp" in n)]


def readme_groups(model):
    ids = {id(p) for p in galore_targets(model)}
    return [{"params": [p for p in model.parameters() if id(p) not in ids]},
            {"params": galore_targets(model), "rank": RANK, "update_proj_gap": GAP, "scale": SCALE, "proj_type": "std"}]


def build(arm: str, model):
    """(optimizer or None, gradient-accumulation steps, planner settings or None)."""
    from _ref_loader import galore_ref  # noqa: E402

    ours = dict(lr=LR, rank=RANK, update_proj_gap=GAP, scale=SCALE, weight_decay=0.0, targets=["attn", "mlp"],
                proj_method="randomized", stagger=True)
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0), 4, dict(optimizer="adamw")
    if arm == "galore-torch":
        return galore_ref().AdamW(readme_groups(model), lr=LR, no_deprecation_warning=True), 4, \
            dict(optimizer="galore_adamw", proj_side="std")
    if arm == "galore-torch layerwise":
        opts = {}
        targets = {id(p) for p in galore_targets(model)}
        for p in model.parameters():
            if id(p) in targets:
                opts[p] = galore_ref().AdamW([{"params": [p], "rank": RANK, "update_proj_gap": GAP, "scale": SCALE,
                                                "proj_type": "std"}], lr=LR, no_deprecation_warning=True)
            else:
                opts[p] = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0)

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return None, 1, None
    if arm == "ours full grads":
        return hopt.GaLoreAdamW(model, **ours), 4, dict(optimizer="galore_adamw")
    if arm == "ours lowrank fp32":
        return hopt.GaLoreAdamW(model, lowrank_grads=True, initial_basis="first_microbatch", **ours), 4, \
            dict(optimizer="galore_adamw", lowrank_grads=True)
    if arm == "ours lowrank 8-bit":
        return hopt.GaLoreAdamW8bit(model, lowrank_grads=True, initial_basis="first_microbatch", **ours), 4, \
            dict(optimizer="galore_adamw8bit", lowrank_grads=True)
    raise ValueError(arm)


def one_step(model, opt, ga, ids, tracker=None, traffic=None):
    for k in range(ga):
        if tracker is not None:
            tracker.reset_mod_stats()  # MemTracker counts per module call; GA calls the model ga times
        model(input_ids=ids[k:k + 1], labels=ids[k:k + 1]).loss.backward()
    if traffic is not None:
        acc = getattr(opt, "_lowrank_acc", {})
        plans = getattr(opt, "_plans", {})
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        if getattr(opt, "lowrank_grads", False):  # DDP reduces the unprojected grads, the optimizer accumulators + refreshing grads
            traffic["ddp"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                 if p.grad is not None and p not in plans)
            traffic["optimizer"] = sum(a.numel() * a.element_size() for a in acc.values()) + \
                sum(p.grad.numel() * p.grad.element_size() for p in plans if p.grad is not None)
        else:
            traffic["ddp"], traffic["optimizer"] = grads, 0
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def measure(arm: str, preset: str, seq: int, vocab: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(preset, vocab))
    opt, ga, plan_kw = build(arm, model)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (4, seq), generator=g) for _ in range(3)]
    t0 = time.perf_counter()
    one_step(model, opt, ga, ids[0])  # warm-up: state allocated, first bases
    one_step(model, opt, ga, ids[1])  # a second step: the first staggered refreshes are past
    traffic: dict = {}
    tracker = MemTracker()
    tracker.track_external(model, *([opt] if opt is not None else []))
    with tracker:
        one_step(model, opt, ga, ids[2], tracker, traffic)
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out = {"arm": arm, "ga": ga, "peak": snap["Total"], "seconds": time.perf_counter() - t0,
           "by": {str(getattr(k, "value", k)): v for k, v in snap.items()}, "traffic": traffic}
    if plan_kw is not None:
        from hf_gradfix.parallel import ParallelDims
        from hf_gradfix.plan import Settings, estimate

        s = Settings(seq_len=seq, micro_batch=1, grad_accum=ga, dtype="fp32", rank=RANK, targets=["attn", "mlp"],
                     update_proj_gap=GAP, **plan_kw)
        p = estimate(llama_config(preset, vocab), ParallelDims(1), s)
        out["planned"] = p.peak - p.components["fragmentation"]
    return out


# ------------------------------------------------------------------------------------------------------ quality


def quality(steps: int, seeds: int, log, only: list[str] = ()) -> dict[str, list[float]]:
    from bench_optim import markov_source, sample_rows, schedule

    vocab, seq = 512, 64
    nxt, probs = markov_source(vocab, 16, 0)
    rows = sample_rows(nxt, probs, 1200, seq, 1)
    train, val = rows[:1100], rows[1100:]
    kw = dict(lr=LR, rank=16, update_proj_gap=50, scale=SCALE, weight_decay=0.0, proj_method="svd", stagger=True)
    arms = {
        "full grads": lambda m: hopt.GaLoreAdamW(m, **kw),
        "lowrank (exact first basis)": lambda m: hopt.GaLoreAdamW(m, lowrank_grads=True, **kw),
        "lowrank (first-micro-batch basis)": lambda m: hopt.GaLoreAdamW(m, lowrank_grads=True,
                                                                        initial_basis="first_microbatch", **kw),
        "lowrank 8-bit": lambda m: hopt.GaLoreAdamW8bit(m, lowrank_grads=True, initial_basis="first_microbatch",
                                                        min_8bit_size=0, **kw),
    }
    if only:
        arms = {a: f for a, f in arms.items() if a in only}
    res: dict[str, list[float]] = {a: [] for a in arms}
    for seed in range(seeds):
        torch.manual_seed(seed)
        base = transformers.LlamaForCausalLM(llama_config("tiny", vocab))
        for arm, make in arms.items():
            model = copy.deepcopy(base)
            opt = make(model)
            sched = schedule(opt, steps)
            gen = torch.Generator().manual_seed(100 + seed)
            for _ in range(steps):
                idx = torch.randint(0, len(train), (16,), generator=gen)
                x = torch.from_numpy(train[idx.numpy()])
                for k in range(4):
                    (model(input_ids=x[4 * k:4 * k + 4], labels=x[4 * k:4 * k + 4]).loss / 4).backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                xv = torch.from_numpy(val)
                res[arm].append(float(model(input_ids=xv, labels=xv).loss))
            log(f"  quality seed {seed} {arm}: val {res[arm][-1]:.4f}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="125m", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--quality-steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, 20 quality steps, 1 seed")
    ap.add_argument("--skip-memory", action="store_true", help="only the quality run")
    ap.add_argument("--quality-arms", default="", help="comma-separated subset of the quality arms (default: all)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=results_path("lowrank_grads.md"))
    args = ap.parse_args()
    if args.quick:
        args.preset, args.vocab, args.quality_steps, args.seeds = "tiny", 2000, 20, 1
    torch.set_num_threads(1)
    global RANK
    RANK = RANKS[args.preset]
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.time()
    n = sum(p.numel() for p in transformers.LlamaForCausalLM(llama_config(args.preset, args.vocab)).parameters())
    log(f"# Low-rank gradient accumulation: memory, DDP traffic, quality\n")
    log(f"`python benchmarks/bench_lowrank_grads.py {' '.join(sys.argv[1:])}` on {cpu_name()}, "
        f"torch {torch.__version__}, 1 thread, {time.strftime('%Y-%m-%d')}\n")
    log(f"## Peak memory of one training step (CPU, torch MemTracker)\n")
    log(f"Llama preset `{args.preset}`: {n / 1e6:.1f}M parameters, fp32, micro-batch 1 x {args.seq} tokens, GaLore rank "
        f"{RANK} on attention/MLP matrices.\n")
    results = []
    for arm in ([] if args.skip_memory else [a for a in args.arms.split(",") if a]):
        r = measure(arm, args.preset, args.seq, args.vocab)
        results.append(r)
        print(f"  {arm}: peak {r['peak'] / MiB:.1f} MiB ({r['seconds']:.0f} s)", flush=True)
    ref = next((r["peak"] for r in results if r["arm"] == "adamw"), results[0]["peak"] if results else 1)
    if results:
        log("| arm | GA | peak MiB | vs AdamW | gradients MiB | optimizer state MiB | activations+temp MiB | planner MiB | measured / planner |")
        log("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        by = r["by"]
        planned = r.get("planned")
        log(f"| {r['arm']} | {r['ga']} | {r['peak'] / MiB:.1f} | {r['peak'] / ref:.3f} | {by.get('Gradient', 0) / MiB:.1f} | "
            f"{by.get('Optstate', 0) / MiB:.1f} | {(by.get('Activation', 0) + by.get('Temp', 0)) / MiB:.1f} | "
            + (f"{planned / MiB:.1f} | {r['peak'] / planned:.3f} |" if planned else "- | - |"))
    if results:
        log("\nColumns other than the peak are the categories at the moment of the peak (MemTracker's classification; the "
        "low-rank accumulators are created inside backward hooks and land in 'Temp'). The planner column is its "
        "closed-form sum without the 10 % fragmentation margin (a bound: every component live at once).\n")
    tr = {r["arm"]: r["traffic"] for r in results if r["traffic"]}
    if "ours full grads" in tr and "ours lowrank fp32" in tr:
        full = tr["ours full grads"]["ddp"]
        low = tr["ours lowrank fp32"]
        log("## Bytes all-reduced per optimizer step under DDP\n")
        log("| arm | DDP buckets MiB | optimizer (accumulators + refreshing) MiB | total MiB | vs plain DDP |")
        log("|---|---|---|---|---|")
        log(f"| plain DDP (full gradients) | {full / MiB:.2f} | 0 | {full / MiB:.2f} | 1.000 |")
        tot = low["ddp"] + low["optimizer"]
        log(f"| lowrank_grads | {low['ddp'] / MiB:.2f} | {low['optimizer'] / MiB:.2f} | {tot / MiB:.2f} | {tot / full:.3f} |\n")
    log(f"## Quality: validation loss, tiny Llama, synthetic bigram task, GA 4, {args.quality_steps} steps, "
        f"{args.seeds} seed(s)\n")
    q = quality(args.quality_steps, args.seeds, lambda m: print(m, flush=True),
                [a for a in args.quality_arms.split(",") if a])
    log("| arm | val loss per seed | mean | minus full grads (mean) |")
    log("|---|---|---|---|")
    base = statistics.mean(q["full grads"])
    for arm, vals in q.items():
        log(f"| {arm} | {' '.join(f'{v:.4f}' for v in vals)} | {statistics.mean(vals):.4f} | "
            f"{statistics.mean(vals) - base:+.4f} |")
    spread = (max(q["full grads"]) - min(q["full grads"])) if len(q["full grads"]) > 1 else float("nan")
    log(f"\nSeed spread (max - min) of full-gradient GaLore: {spread:.4f}.\n")
    log(f"Total time {time.time() - t0:.0f} s.")
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
