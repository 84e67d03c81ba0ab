"""Low-rank optimizers side by side: state bytes, optimizer-step time, refresh cost and loss, in one run.

    python benchmarks/bench_optim.py                       # ~7 min on 2 busy CPU cores; writes benchmarks/results/optim.md
    python benchmarks/bench_optim.py --batch 8 --seq 128   # the research digest's batch (8 x 128 tokens; ~4x as long)
    python benchmarks/bench_optim.py --steps 40 --seeds 1 --no-write      # smoke test (~1 min)
    python benchmarks/bench_optim.py --arms adamw,galore-torch,apollo,apollo-torch   # pick arms (apollo-torch: opt-in)

A tiny random-init Llama (default hidden 256, 4 layers, intermediate 688, vocabulary 2000, untied, fp32:
4.19M parameters, the digest's model) trains on a synthetic, learnable token stream with each arm:

- ``adamw``         torch.optim.AdamW (foreach), lr 1e-3 (the digest's best AdamW lr);
- ``galore-torch``  galore-torch 1.0 GaLoreAdamW, proj_type std, rank, gap, scale 0.25, lr 1e-2;
- ``svd``           hf_gradfix GaLoreAdamW, proj_method="svd" (same rank/gap/scale/lr);
- ``randomized``    hf_gradfix GaLoreAdamW, proj_method="randomized";
- ``apollo``        hf_gradfix ApolloAdamW, rank = hidden/4, channel-wise scale, scale 1, lr 1e-2;
- ``apollo-mini``   hf_gradfix apollo_mini (rank 1, tensor-wise, scale 128), lr 1e-2;
- ``apollo-torch``  apollo-torch 1.0.3 APOLLOAdamW with the ``apollo`` settings (opt-in, not in the default set).

Every low-rank arm projects the same 28 matrices (attention and MLP ``nn.Linear`` weights; embeddings, norms and
the output head stay plain AdamW). Weight decay 0 everywhere; each optimizer keeps its own eps (torch and
hf_gradfix 1e-8, galore-torch / apollo-torch 1e-6). Linear warm-up (20 steps, or steps/10) then cosine to 10 %.

Data: a fixed random first-order Markov (bigram) source over the vocabulary: every token has ``--successors``
possible next tokens drawn from a Zipf(1.1) distribution, with Dirichlet(0.5) transition probabilities, so the
stream has a Zipfian unigram distribution and an entropy rate far below log(vocab). One long stream is cut into
``--seq``-token rows; the last 5 % of the rows are the held-out validation split. The table also shows the
source's own cross-entropy on that split (the floor) and the unigram cross-entropy (what a model with no context
reaches).

Protocol: per seed, all arms start from the same initial weights and see the same batches; they advance in
lockstep (step i of every arm, in a rotating order, before step i+1), so slow phases of a shared machine hit all
arms alike. ``opt.step()`` is timed alone (perf_counter, CPU, synchronous), separately from forward/backward.
Refresh steps are the steps where the bases are recomputed: step 0 and every ``--gap`` steps (APOLLO draws a new
random seed there, which costs nothing). State bytes count every distinct tensor storage the optimizer holds
(``hf_gradfix.optim.state_bytes``, which also walks into the projector objects galore-torch / apollo-torch keep in
``optimizer.state``; the breakdown below classifies each storage by where it sits). 1 torch thread.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import hf_gradfix.optim as hopt  # noqa: E402
from _common import quoted_command, results_path, versions  # noqa: E402

transformers.logging.set_verbosity_error()

TARGETS = ["self_attn", "mlp"]  # module-name patterns: the 4 attention + 3 MLP projections of every layer
DEFAULT_ARMS = ("adamw", "galore-torch", "svd", "randomized", "apollo", "apollo-mini")
ALL_ARMS = DEFAULT_ARMS + ("apollo-torch",)


# ---------------------------------------------------------------------------------------------- data


def markov_source(vocab: int, successors: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(next tokens (V, K), transition probabilities (V, K)) of a fixed random bigram source."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
    zipf /= zipf.sum()
    perm = rng.permutation(vocab)  # frequent tokens are not simply the low ids
    nxt = np.empty((vocab, successors), dtype=np.int64)
    for t in range(vocab):
        nxt[t] = perm[rng.choice(vocab, size=successors, replace=False, p=zipf)]
    probs = rng.dirichlet(np.full(successors, 0.5), size=vocab)
    return nxt, probs


def sample_rows(nxt: np.ndarray, probs: np.ndarray, rows: int, length: int, seed: int) -> np.ndarray:
    """``rows`` independent chains of ``length`` tokens (vectorised over chains), burnt in for 32 steps."""
    rng = np.random.default_rng(seed)
    vocab = nxt.shape[0]
    cum = np.cumsum(probs, axis=1)
    cur = rng.integers(0, vocab, size=rows)
    out = np.empty((rows, length), dtype=np.int64)
    for i in range(-32, length):
        u = rng.random(rows)
        k = np.minimum((cum[cur] < u[:, None]).sum(axis=1), nxt.shape[1] - 1)
        cur = nxt[cur, k]
        if i >= 0:
            out[:, i] = cur
    return out


def source_xent(nxt: np.ndarray, probs: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """Cross-entropy (nats/token) of the true source and of the rows' own unigram distribution on ``rows``."""
    prev, cur = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
    match = nxt[prev] == cur[:, None]
    p = (probs[prev] * match).sum(axis=1)
    counts = np.bincount(rows.reshape(-1), minlength=nxt.shape[0]).astype(np.float64)
    uni = counts / counts.sum()
    return float(-np.log(p).mean()), float(-np.log(uni[cur]).mean())


# ---------------------------------------------------------------------------------------------- model and arms


def build_model(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(512, args.seq), tie_word_embeddings=False, use_cache=False,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def target_split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(projected, plain) parameters: the 2-D weights of attention/MLP nn.Linear modules vs the rest."""
    sel = hopt.select_targets(list(model.named_parameters()), TARGETS, model=model)
    named = dict(model.named_parameters())
    projected = [named[n] for n in sel.projected]
    plain = [named[n] for n in sel.plain]
    return projected, plain


def lrs(args: argparse.Namespace) -> dict[str, float]:
    low = args.lr_lowrank
    return {"adamw": args.lr_adamw, "galore-torch": low, "svd": low, "randomized": low, "apollo": low,
            "apollo-mini": low, "apollo-torch": low}


def build_optimizer(arm: str, model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    lr = lrs(args)[arm]
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)
    if arm in ("svd", "randomized"):
        opt = hopt.GaLoreAdamW(model, lr=lr, weight_decay=0.0, rank=args.rank, update_proj_gap=args.gap,
                               scale=args.scale, proj_method=arm, targets=TARGETS)
    elif arm == "apollo":
        opt = hopt.ApolloAdamW(model, lr=lr, weight_decay=0.0, rank=args.apollo_rank, update_proj_gap=args.gap,
                               scale=1.0, scale_type="channel", targets=TARGETS)
    elif arm == "apollo-mini":
        opt = hopt.apollo_mini(model, lr=lr, weight_decay=0.0, update_proj_gap=args.gap, targets=TARGETS)
    elif arm == "galore-torch":
        import galore_torch

        projected, plain = target_split(model)
        groups = [{"params": plain},
                  {"params": projected, "rank": args.rank, "update_proj_gap": args.gap, "scale": args.scale,
                   "proj_type": "std"}]
        return galore_torch.GaLoreAdamW(groups, lr=lr, weight_decay=0.0, no_deprecation_warning=True)
    elif arm == "apollo-torch":
        import apollo_torch

        projected, plain = target_split(model)
        groups = [{"params": plain},
                  {"params": projected, "rank": args.apollo_rank, "proj": "random", "scale_type": "channel",
                   "scale": 1.0, "update_proj_gap": args.gap, "proj_type": "std"}]
        return apollo_torch.APOLLOAdamW(groups, lr=lr, weight_decay=0.0)
    else:
        raise ValueError(arm)
    if len(opt.projected_names) != 7 * args.layers:
        raise RuntimeError(f"{arm}: projects {len(opt.projected_names)} matrices, expected {7 * args.layers}")
    return opt


def schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, min(20, steps // 10))

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ---------------------------------------------------------------------------------------------- state bytes


def _tensors_in(value, depth: int = 0):
    """Tensors reachable from one optimizer-state value (projector objects included, one level deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth)
    elif depth == 0 and hasattr(value, "__dict__"):
        for v in vars(value).values():
            yield from _tensors_in(v, depth + 1)


def state_breakdown(opt: torch.optim.Optimizer, projected: set[int]) -> dict[str, int]:
    """Held bytes by kind: distinct storages, so a small view keeping a large SVD factor alive counts in full.

    Keys: total, plain (moments of non-projected params), moments (low-rank moments), basis (P / projection
    matrix storages), basis_needed (what those bases would take as contiguous r x d tensors), other.
    """
    seen: set[tuple[int, int]] = set()
    out = dict(total=0, plain=0, moments=0, basis=0, basis_needed=0, other=0)
    for p, st in opt.state.items():
        for key, value in st.items():
            for t in _tensors_in(value):
                storage = t.untyped_storage()
                ident = (storage.data_ptr(), storage.nbytes())
                if ident in seen:
                    continue
                seen.add(ident)
                nbytes = storage.nbytes()
                out["total"] += nbytes
                if key in ("exp_avg", "exp_avg_sq"):
                    out["moments" if id(p) in projected else "plain"] += nbytes
                elif key in ("proj", "projector") or (not isinstance(value, torch.Tensor)):
                    out["basis"] += nbytes
                    out["basis_needed"] += t.numel() * t.element_size()
                else:
                    out["other"] += nbytes
    return out


# ---------------------------------------------------------------------------------------------- run


def run_seed(args, arms, seed, train, val, log) -> dict[str, dict]:
    base = build_model(args, seed)
    models = {arm: copy.deepcopy(base) for arm in arms}
    opts = {arm: build_optimizer(arm, models[arm], args) for arm in arms}
    scheds = {arm: schedule(opts[arm], args.steps) for arm in arms}
    res = {arm: {"step_s": [], "fb_s": [], "loss": []} for arm in arms}
    rng = np.random.default_rng(10_000 + seed)
    order = list(arms)
    t_start = time.time()
    for i in range(args.steps):
        x = torch.from_numpy(train[rng.integers(0, len(train), size=args.batch)])
        order = order[1:] + order[:1]  # rotate who goes first
        for arm in order:
            model, opt = models[arm], opts[arm]
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            scheds[arm].step()
            opt.zero_grad(set_to_none=True)
            r = res[arm]
            r["fb_s"].append(t1 - t0)
            r["step_s"].append(t2 - t1)
            r["loss"].append(float(loss.detach()))
        if args.progress and (i + 1) % max(1, args.steps // 4) == 0:
            losses = " ".join(f"{a} {res[a]['loss'][-1]:.2f}" for a in arms)
            log(f"  seed {seed} step {i + 1}/{args.steps} ({time.time() - t_start:.0f} s): {losses}")
    for arm in arms:
        model = models[arm]
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for j in range(0, len(val), 16):
                xv = torch.from_numpy(val[j:j + 16])
                out = model(input_ids=xv, labels=xv)
                n = xv.shape[0] * (xv.shape[1] - 1)
                total += float(out.loss) * n
                count += n
        res[arm]["val"] = total / count
        projected = {id(p) for p in target_split(model)[0]}
        res[arm]["bytes"] = state_breakdown(opts[arm], projected)
        res[arm]["state_bytes_api"] = hopt.state_bytes(opts[arm])
        if arm in ("svd", "randomized", "apollo", "apollo-mini"):
            res[arm]["expected_bytes"] = hopt.expected_state_bytes(opts[arm])
    return res


def mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


NAMES = {
    "adamw": "torch AdamW (foreach)",
    "galore-torch": "galore-torch 1.0 GaLoreAdamW (std, SVD)",
    "svd": "**ours** GaLoreAdamW, `proj_method=\"svd\"`",
    "randomized": "**ours** GaLoreAdamW, `proj_method=\"randomized\"`",
    "apollo": "**ours** ApolloAdamW (channel)",
    "apollo-mini": "**ours** `apollo_mini` (rank 1, tensor, scale 128)",
    "apollo-torch": "apollo-torch 1.0.3 APOLLOAdamW (channel)",
}


def rank_label(arm: str, args) -> str:
    if arm == "adamw":
        return "-"
    if arm in ("apollo", "apollo-torch"):
        return str(args.apollo_rank)
    if arm == "apollo-mini":
        return "1"
    return str(args.rank)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key_ratios(summary: dict, args) -> list[str]:
    """One line per headline comparison, for the arms that ran."""
    out = []
    have = summary.keys()

    def mb(arm):
        return summary[arm]["bytes"]["total"] / 1e6

    def val(arm):
        return statistics.mean(summary[arm]["val"])

    if {"adamw", "galore-torch", "svd"} <= have:
        gt = summary["galore-torch"]["bytes"]
        out.append(f"- State: ours GaLore {mb('svd'):.2f} MB = {mb('svd') / mb('adamw'):.3f} of AdamW ({mb('adamw'):.2f} MB) and "
                   f"{mb('svd') / mb('galore-torch'):.3f} of galore-torch ({mb('galore-torch'):.2f} MB held, of which "
                   f"{(gt['basis'] - gt['basis_needed']) / 1e6:.2f} MB are SVD factors kept alive behind the rank-{args.rank} "
                   f"views; {(gt['total'] - gt['basis'] + gt['basis_needed']) / 1e6:.2f} MB without them).")
    if {"adamw", "apollo", "apollo-mini"} <= have:
        out.append(f"- State: ours APOLLO {mb('apollo') / mb('adamw'):.3f} of AdamW, APOLLO-Mini {mb('apollo-mini') / mb('adamw'):.3f} "
                   f"(what remains is plain AdamW on embeddings, output head and norms).")
    if "adamw" in have:
        parts = [f"{a} {summary[a]['step'] / summary['adamw']['step']:.2f}x" for a in have if a != "adamw"]
        out.append("- `step()` (non-refresh median) vs AdamW: " + ", ".join(parts) + "; amortized vs AdamW: "
                   + ", ".join(f"{a} {summary[a]['amortized'] / summary['adamw']['amortized']:.2f}x" for a in have if a != "adamw") + ".")
    if {"svd", "randomized"} <= have:
        r = summary["randomized"]["refresh"] / summary["svd"]["refresh"]
        line = f"- Refresh step: randomized {summary['randomized']['refresh']:.0f} ms vs svd {summary['svd']['refresh']:.0f} ms ({r:.2f}x)"
        if "galore-torch" in have:
            line += f"; galore-torch {summary['galore-torch']['refresh']:.0f} ms"
        out.append(line + ".")
    if "adamw" in have and len(summary["adamw"]["val"]) > 1:
        sd = max(statistics.stdev(summary[a]["val"]) for a in have)
        diffs = ", ".join(f"{a} {val(a) - val('adamw'):+.3f}" for a in have if a != "adamw")
        out.append(f"- Val loss vs AdamW ({val('adamw'):.3f}): {diffs} (largest seed sd {sd:.3f}).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (model init and batch order); loss = mean ± sd")
    parser.add_argument("--batch", type=int, default=4, help="rows per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per row (32 keeps the default run near 7 min)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None, help="default: the digest's 688 at hidden 256 (x 2.6875)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--rank", type=int, default=None, help="GaLore rank (default hidden/4: 64)")
    parser.add_argument("--apollo-rank", type=int, default=None, help="APOLLO rank (default hidden/4)")
    parser.add_argument("--gap", type=int, default=50, help="update_proj_gap of every low-rank arm")
    parser.add_argument("--scale", type=float, default=0.25, help="GaLore scale (alpha)")
    parser.add_argument("--lr-adamw", type=float, default=1e-3)
    parser.add_argument("--lr-lowrank", type=float, default=1e-2)
    parser.add_argument("--successors", type=int, default=4, help="next-token choices per token in the source")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="length of the generated stream")
    parser.add_argument("--val-rows", type=int, default=256, help="rows of the held-out split scored at the end")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {','.join(ALL_ARMS)}")
    parser.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    parser.add_argument("--out", default=results_path("optim.md"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--progress", action="store_true", help="print losses during the run (stderr)")
    args = parser.parse_args()
    args.intermediate = args.intermediate or int(round(args.hidden * 688 / 256))
    args.rank = args.rank or args.hidden // 4
    args.apollo_rank = args.apollo_rank or args.hidden // 4
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ALL_ARMS)}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_all = time.time()
    load0 = os.getloadavg()[0]
    nxt, probs = markov_source(args.vocab, args.successors, seed=1234)
    rows = sample_rows(nxt, probs, max(1, args.tokens // args.seq), args.seq, seed=4321)
    n_val = max(16, len(rows) // 20)
    train, val = rows[:-n_val], rows[-n_val:][: args.val_rows]
    floor, unigram = source_xent(nxt, probs, val)
    log(f"data: {len(train)} train rows, {len(val)} validation rows of {args.seq} tokens; "
        f"val cross-entropy: source {floor:.3f}, unigram {unigram:.3f}, uniform {math.log(args.vocab):.3f}")

    per_seed = []
    for seed in range(args.seeds):
        t0 = time.time()
        per_seed.append(run_seed(args, arms, seed, train, val, log))
        log(f"seed {seed}: {time.time() - t0:.0f} s")
    elapsed = time.time() - t_all
    n_params = sum(p.numel() for p in build_model(args, 0).parameters())

    refresh_idx = set(range(0, args.steps, args.gap))
    summary = {}
    for arm in arms:
        normal = [r[arm]["step_s"][i] for r in per_seed for i in range(args.steps) if i not in refresh_idx]
        refresh = [r[arm]["step_s"][i] for r in per_seed for i in sorted(refresh_idx)]
        summary[arm] = dict(
            step=statistics.median(normal) * 1e3,
            p99=float(np.percentile(normal, 99)) * 1e3,
            refresh=statistics.median(refresh) * 1e3,
            amortized=statistics.mean(statistics.mean(r[arm]["step_s"]) for r in per_seed) * 1e3,
            fb=statistics.median(x for r in per_seed for x in r[arm]["fb_s"]) * 1e3,
            train=[statistics.mean(r[arm]["loss"][-10:]) for r in per_seed],
            val=[r[arm]["val"] for r in per_seed],
            bytes=per_seed[0][arm]["bytes"],
            api=per_seed[0][arm]["state_bytes_api"],
            expected=per_seed[0][arm].get("expected_bytes"),
        )
    ref = summary.get("adamw")
    lr_of = lrs(args)

    lines = []
    lines.append(
        f"{versions('torch', 'transformers')}; {cpu_name()}, "
        f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s), load average {load0:.2f} at start / "
        f"{os.getloadavg()[0]:.2f} at end. Llama hidden {args.hidden}, {args.layers} layers, "
        f"intermediate {args.intermediate}, vocab {args.vocab}, untied, fp32 ({n_params:,} parameters; {7 * args.layers} "
        f"attention/MLP matrices projected). Batch {args.batch} x {args.seq} tokens, {args.steps} steps, {args.seeds} seed(s), "
        f"gap {args.gap}, GaLore rank {args.rank} / scale {args.scale}, APOLLO rank {args.apollo_rank}.")
    lines.append("")
    lines.append("| optimizer | rank | lr | state MB | state vs AdamW | `step()` ms (median) | vs AdamW | refresh step ms | "
                 "amortized ms | train loss (last 10) | val loss |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm in arms:
        s = summary[arm]
        mb = s["bytes"]["total"] / 1e6
        vs = f"{s['bytes']['total'] / ref['bytes']['total']:.3f}" if ref else "-"
        st_vs = f"{s['step'] / ref['step']:.2f}x" if ref else "-"
        refresh = "-" if arm == "adamw" else f"{s['refresh']:.1f}"
        lines.append(
            f"| {NAMES[arm]} | {rank_label(arm, args)} | {lr_of[arm]:g} | {mb:.2f} | {vs} | {s['step']:.2f} | {st_vs} | "
            f"{refresh} | {s['amortized']:.2f} | {mean_sd(s['train'])} | {mean_sd(s['val'])} |")
    lines.append("")
    lines.append(f"Validation split ({len(val)} rows x {args.seq} tokens, held out): the source itself scores {floor:.3f}, "
                 f"the unigram distribution {unigram:.3f}, uniform log(vocab) {math.log(args.vocab):.3f}. "
                 f"Loss: mean ± sd over {args.seeds} seed(s); train loss = mean of the last 10 steps' batch losses.")
    lines.append("")
    lines.append("State in detail (bytes of distinct storages after the run; identical for every seed):")
    lines.append("")
    lines.append("| optimizer | total B | plain AdamW moments | low-rank moments | basis held | basis needed (r x d) | "
                 "`state_bytes()` | `expected_state_bytes()` |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for arm in arms:
        b = summary[arm]["bytes"]
        exp = summary[arm]["expected"]
        exp_s = "-" if exp is None else f"{exp:,}" + (" (equal)" if exp == summary[arm]["api"] else " (DIFFERS)")
        lines.append(f"| {NAMES[arm]} | {b['total']:,} | {b['plain']:,} | {b['moments']:,} | {b['basis']:,} | "
                     f"{b['basis_needed']:,} | {summary[arm]['api']:,} | {exp_s} |")
    lines.append("")
    lines.append("Timing detail: `step()` median excludes refresh steps; p99 of the non-refresh steps and the median "
                 "forward+backward of the same steps, for scale:")
    lines.append("")
    lines.append("| optimizer | `step()` p99 ms | fwd+bwd ms | refresh / normal step |")
    lines.append("|---|---:|---:|---:|")
    for arm in arms:
        s = summary[arm]
        ratio = "-" if arm == "adamw" else f"{s['refresh'] / s['step']:.1f}x"
        lines.append(f"| {NAMES[arm]} | {s['p99']:.2f} | {s['fb']:.1f} | {ratio} |")
    lines.append("")
    lines.append("Key ratios:")
    lines.append("")
    lines.extend(key_ratios(summary, args))
    lines.append("")
    cmd = quoted_command("bench_optim.py", sys.argv[1:])
    lines.append(f"Command: `{cmd}` ({elapsed:.0f} s).")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("# Low-rank optimizers: state, step time, loss (`benchmarks/bench_optim.py`)\n\n" + text + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
