"""The GPU check at real sizes (issue 53 item 4): one prepared call of about 8 minutes on one H100 / H200.

    bash scripts/gpu_check.sh --real-size          # on the lent machine: this script, bounded, results into $OUT
    python benchmarks/gpu_check_1b.py --quick --device cpu --out /tmp/x.md   # the whole code path on CPU, seconds

Sections (each a row of ``benchmarks/results/gpu-check-1b.md``; a section that raises or outlives its budget is
recorded as such and the rest runs):

1. **throughput**: a Llama-3.2-1B-shaped model (1.24B parameters, 128k vocabulary) in bf16 at seq 4096, lognormal
   document lengths (median 300 tokens, sigma 1): padded batches vs hf_gradfix packing (varlen) vs TRL's
   padding-free collator: real tokens/s, the padding-waste limit 1 / (1 - waste), and useful MFU
   (6 N per real token + 6 L d l^2 per document of l tokens, over the device's bf16 dense peak).
2. **overhead**: the same model, padded batches, GA 8: the median optimizer-step time stock vs ``hf_gradfix.patch()``
   (runs alternated), the overhead ratio.
3. **lean**: ``loss.head: lean`` vs the stock head vs TRL's fused head (Liger's fused linear cross entropy, where
   importable) at 8k and 32k tokens, 128k vocabulary, bf16: time and ``max_memory_allocated`` above the step's start.
4. **syncs**: host syncs per micro-batch and per window, stock vs patched (``HostSyncCounter``: structural, and
   ``torch.cuda.set_sync_debug_mode`` on CUDA), a small Llama under the Trainer at GA 4.
5. **optim**: APOLLO / APOLLO-Mini ``step()`` vs AdamW (``gpu_check.optimizer_cost``, 7B-shaped layers).
6. **hybrid**: the hybrid families' packed row with whatever varlen kernels import (fla / causal-conv1d /
   mamba-ssm: ``cu_seqlens`` / ``seq_idx``), exact vs each document alone (``gpu_check.section_hybrid``).

Then the goals (packed >= 90 % of the limit, overhead <= 1 %, APOLLO <= 1.5x AdamW, lean memory <= 0.25x stock at
8k tokens; the planner's 10 % is ``gpu_check.py --only plan``): each missed goal gets a ``torch.profiler``
summary (``key_averages``, top rows by device time) of the workload that missed it, in the results file. ``--quick``
runs every section and every profile on tiny sizes (goals there are not judged: "quick").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check as G  # noqa: E402  (puts the repository and tests/support on sys.path)

DEFAULT_OUT = HERE / "results" / "gpu-check-1b.md"
SECTIONS = ("throughput", "overhead", "lean", "syncs", "optim", "hybrid")
BUDGETS_S = {"throughput": 170, "overhead": 90, "lean": 60, "syncs": 40, "optim": 50, "hybrid": 30}
PROFILE_BUDGET_S = 40
GOALS = {
    "throughput": "packed >= 90 % of the padding-waste limit at 1B",
    "overhead": "the plugin's overhead <= 1 % of an optimizer step (GA 8)",
    "optim": "APOLLO step <= 1.5x AdamW",
    "lean": "lean head memory <= 0.25x stock at 8k tokens",
    "plan": "planner within 10 % of the allocator (gpu_check.py --only plan; issue 53 item 3)",
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def _sync(device: str) -> None:
    G._sync(device)


def peak_flops(device: str) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def model_config(quick: bool, vocab: int | None = None):
    import transformers

    if not quick:
        cfg = G.llama_1b_config()
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                                       tie_word_embeddings=True, use_cache=False)
    if vocab:
        cfg.vocab_size = vocab
    cfg.pad_token_id = 0
    return cfg


def build(cfg, device: str, attn: str = "sdpa"):
    import transformers

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialized on the device (a 1B init on the host takes a while)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dtype)
    if attn != "sdpa":
        from hf_gradfix.packing.attention import set_attention_implementation

        set_attention_implementation(model, attn)
    return model


def useful_flops(cfg, lens: list[int]) -> float:
    """Forward + backward FLOPs of the real tokens: 6 N per token (N: the parameters) and 6 L d l^2 per document of
    l tokens (causal attention's two matmuls, forward and backward)."""
    d, L, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size
    n = L * per_layer + d * v  # the head (tied: the embedding's lookup is no matmul)
    return 6.0 * n * sum(lens) + 6.0 * L * d * sum(x * x for x in lens)


def _args(device: str, **kw):
    import transformers

    base = dict(output_dir="/tmp/hgf_gpu_check_1b", num_train_epochs=1, per_device_train_batch_size=1,
                learning_rate=1e-6, report_to="none", use_cpu=device == "cpu", save_strategy="no", disable_tqdm=True,
                logging_strategy="no", remove_unused_columns=False, seed=0, dataloader_num_workers=0,
                max_grad_norm=1.0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


class StepTimer:
    """A callback timing every optimizer step (device synchronized at each end)."""

    def __init__(self, device: str) -> None:
        import transformers

        timer = self

        class _CB(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                _sync(device)
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                _sync(device)
                timer.times.append(time.perf_counter() - timer.t0)

        self.times: list[float] = []
        self.t0 = 0.0
        self.callback = _CB()


# ---------------------------------------------------------------------------------------------- 1. throughput
def section_throughput(device: str, quick: bool, model=None) -> dict:
    import transformers

    import bench_packing_throughput as B
    import hf_gradfix

    cfg = model_config(quick)
    budget = 256 if quick else 4096
    lens = B.lengths(12 if quick else 1200, 0, budget, 1.0)
    data = B.Rows(lens, cfg.vocab_size, 0)
    fa_ok, _ = G.flash_attn_status()
    tv_ok, _ = G.torch_varlen_status(device)
    if fa_ok:
        attn = "flash_attention_2"
    elif tv_ok:
        from hf_gradfix.packing.attention import TORCH_VARLEN_ATTENTION, register_torch_varlen_attention

        attn = register_torch_varlen_attention(TORCH_VARLEN_ATTENTION)
    else:
        attn = "sdpa"  # CPU: the reference varlen kernel through hf_gradfix's packing; padding-free arms of TRL skipped
    model = model if model is not None else build(cfg, device, attn)
    batch = 4  # padded: up to 4 x 4096 tokens (128k-vocabulary logits in fp32: ~8 GiB)
    counted = {"padded": 0, "real": 0}

    def padded_collate(features):
        out = B.pad_collate(features)
        counted["padded"] += int(out["input_ids"].numel())
        counted["real"] += int(out["attention_mask"].sum())
        return out

    arms: dict[str, Any] = {}
    collators: dict[str, Any] = {"padded": padded_collate, "packed": padded_collate}
    if attn != "sdpa":
        try:
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            collators["trl-padding-free"] = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
        except Exception as e:
            arms["trl-padding-free"] = dict(skipped=f"{type(e).__name__}: {str(e)[:120]}")
    else:
        arms["trl-padding-free"] = dict(skipped="no varlen kernel on this device")

    def run(arm: str, max_steps: int = -1) -> float:
        if arm == "packed":
            hf_gradfix.patch({"packing": {"enabled": True, "token_budget": budget, "mode": "varlen",
                                          "attention": "keep"}, "log_fixes": False})
        try:
            args = _args(device, max_steps=max_steps, per_device_train_batch_size=batch,
                         bf16=torch.device(device).type == "cuda")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collators[arm])
            _sync(device)
            t0 = time.perf_counter()
            trainer.train()
            _sync(device)
            return time.perf_counter() - t0
        finally:
            hf_gradfix.unpatch()
            G._free(device)

    peak = peak_flops(device)
    flops = useful_flops(cfg, lens)
    for arm in collators:
        run(arm, max_steps=2)  # warm-up: kernels, allocator
        counted.update(padded=0, real=0)
        seconds = run(arm)
        if arm == "padded":
            waste = 1.0 - counted["real"] / max(counted["padded"], 1)
        arms[arm] = dict(seconds=round(seconds, 3), real_tokens_per_s=round(sum(lens) / seconds, 1),
                         mfu=None if peak is None else round(flops / seconds / peak, 4))
    limit = 1.0 / (1.0 - waste)
    for r in arms.values():
        if "real_tokens_per_s" in r:
            r["vs_padded"] = round(r["real_tokens_per_s"] / arms["padded"]["real_tokens_per_s"], 3)
            r["of_limit"] = round(r["vs_padded"] / limit, 3)
    row = dict(attn=attn, documents=len(lens), real_tokens=sum(lens), budget=budget, batch=batch,
               padding_waste=round(waste, 4), limit=round(limit, 3), arms=arms,
               params=sum(p.numel() for p in model.parameters()))
    goal_met = arms["packed"]["of_limit"] >= 0.9
    summary = (f"{attn}, {row['params'] / 1e9:.2f}B params: waste {waste:.1%} -> limit {limit:.2f}x; " +
               ", ".join(f"{a} {v['vs_padded']:.2f}x ({v['of_limit']:.0%} of limit, MFU {_pct(v['mfu'])})"
                         if "vs_padded" in v else f"{a} {v['skipped']}" for a, v in arms.items()))

    def profile():  # two packed steps
        return run("packed", max_steps=2)

    return dict(status="measured", summary=summary, rows=[row], goal="throughput", goal_met=goal_met,
                profile=profile)


def _pct(x):
    return "-" if x is None else f"{x:.1%}"


# ---------------------------------------------------------------------------------------------- 2. overhead
def section_overhead(device: str, quick: bool) -> dict:
    import transformers

    import bench_packing_throughput as B
    import hf_gradfix

    cfg = model_config(quick)
    ga = 8
    model = build(cfg, device)
    lens = B.lengths(ga * 2 * (2 if quick else 6), 1, 64 if quick else 2048, 1.0)
    data = B.Rows(lens, cfg.vocab_size, 1)

    def run(patched: bool, steps: int) -> list[float]:
        if patched:
            hf_gradfix.patch({"log_fixes": False})
        try:
            timer = StepTimer(device)
            args = _args(device, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                         bf16=torch.device(device).type == "cuda")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=B.pad_collate,
                                           callbacks=[timer.callback])
            trainer.train()
            return timer.times[1:]  # the first step: optimizer state, the probe
        finally:
            hf_gradfix.unpatch()

    steps = 2 if quick else 6
    stock, patched = [], []
    for _ in range(1 if quick else 2):  # alternated: drift on the device hits both
        stock += run(False, steps)
        patched += run(True, steps)
    s, p = statistics.median(stock), statistics.median(patched)
    overhead = p / s - 1.0
    row = dict(ga=ga, steps_timed=len(stock), stock_step_ms=round(1e3 * s, 2), patched_step_ms=round(1e3 * p, 2),
               overhead=round(overhead, 4))
    del model
    G._free(device)

    def profile():
        return run(True, 2)

    return dict(status="measured", summary=f"GA {ga}: stock {row['stock_step_ms']} ms, patched "
                f"{row['patched_step_ms']} ms per step: overhead {overhead:+.2%}", rows=[row], goal="overhead",
                goal_met=overhead <= 0.01, profile=profile)


# ---------------------------------------------------------------------------------------------- 3. lean head
def fused_head_cell(device: str, vocab: int, tokens: int, hidden: int) -> dict:
    """TRL's fused head: Liger's fused linear cross entropy (what ``use_liger_kernel`` installs), where importable."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as e:
        return dict(skipped=f"liger_kernel not importable ({type(e).__name__})")
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    loss_fn = LigerFusedLinearCrossEntropyLoss()
    times = []
    start = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        loss_fn(w, h, labels).backward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return dict(fused_ms=round(1e3 * sorted(times)[1], 2),
                fused_peak_bytes=(torch.cuda.max_memory_allocated() - start) if cuda else None,
                note="the head alone (hidden states in, loss out)")


def section_lean(device: str, quick: bool) -> dict:
    cells = [(512, 128, "bf16"), (512, 256, "bf16")] if quick else [(128256, 8192, "bf16"), (128256, 32768, "bf16")]
    hidden = 64 if quick else 2048
    rows = []
    for vocab, tokens, dtype in cells:
        r = G.lean_head_cell(device, vocab, tokens, dtype, hidden=hidden)
        r.update(fused_head_cell(device, vocab, tokens, hidden))
        rows.append(r)
    eight = next((r for r in rows if r["tokens"] == (128 if quick else 8192)), rows[0])
    ratio = eight.get("mem_ratio")
    summary = "; ".join(f"vocab {r['vocab']} x {r['tokens']} tokens: lean {r['lean_ms']} ms vs stock {r['stock_ms']} ms, "
                        f"memory {r.get('mem_ratio', '-')}x, " +
                        (f"fused {r['fused_ms']} ms" if "fused_ms" in r else f"fused: {r['skipped']}") for r in rows)

    def profile():
        return G.lean_head_cell(device, *cells[0], hidden=hidden, repeats=1)

    return dict(status="measured", summary=summary, rows=rows, goal="lean",
                goal_met=None if ratio is None else ratio <= 0.25, profile=profile)


# ---------------------------------------------------------------------------------------------- 4. host syncs
def syncs_per_window(device: str, patched: bool, steps: int, ga: int = 4) -> dict:
    import transformers

    import bench_packing_throughput as B
    import hf_gradfix
    from hf_gradfix.diagnostics.host_syncs import HostSyncCounter

    cfg = model_config(True)
    lens = B.lengths(2 * ga * steps, 2, 64, 1.0)
    data = B.Rows(lens, cfg.vocab_size, 2)
    if patched:
        hf_gradfix.patch({"log_fixes": False})
    try:
        model = build(cfg, device)
        args = _args(device, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                     optim="adamw_torch", logging_strategy="steps", logging_steps=1)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=B.pad_collate)
        with HostSyncCounter(cuda=torch.device(device).type == "cuda") as counter:
            trainer.train()
    finally:
        hf_gradfix.unpatch()
    return dict(structural=counter.total, cuda=counter.count(cuda=True) if counter.cuda else None,
                plugin=counter.count("hf_gradfix"), sites=counter.sites("hf_gradfix"))


def section_syncs(device: str, quick: bool) -> dict:
    ga = 4
    runs = {(p, n): syncs_per_window(device, p, n, ga) for p in (False, True) for n in (1, 2)}
    row: dict[str, Any] = dict(ga=ga)
    for kind in ("structural", "cuda"):
        if runs[(False, 1)][kind] is None:
            continue
        per = {p: runs[(p, 2)][kind] - runs[(p, 1)][kind] for p in (False, True)}
        row[f"{kind}_stock_per_window"] = per[False]
        row[f"{kind}_patched_per_window"] = per[True]
        row[f"{kind}_extra_per_window"] = per[True] - per[False]
        row[f"{kind}_extra_per_micro_batch"] = (per[True] - per[False]) / ga
    row["plugin_sites"] = runs[(True, 2)]["sites"]
    summary = ", ".join(f"{k}: stock {row[f'{k}_stock_per_window']:g} / patched {row[f'{k}_patched_per_window']:g} "
                        f"per window (extra {row[f'{k}_extra_per_window']:+g})"
                        for k in ("structural", "cuda") if f"{k}_stock_per_window" in row)
    return dict(status="measured", summary=summary, rows=[row])


# ---------------------------------------------------------------------------------------------- 5. optim, 6. hybrid
def section_optim(device: str, quick: bool) -> dict:
    kw = dict(hidden=128, intermediate=344, heads=4, vocab=512, seq=64, steps=6, gap=3) if quick else {}
    r = G.optimizer_cost(device, arms=("adamw", "apollo", "apollo-mini"), **kw)
    apollo = r["arms"]["apollo"]["step_vs_adamw"]
    summary = ", ".join(f"{a} {v['step_ms']:.1f} ms ({v['step_vs_adamw']:.2f}x)" for a, v in r["arms"].items())

    def profile():
        return G.optimizer_cost(device, arms=("apollo",), **(kw or {}), **({} if quick else {"steps": 3}))

    return dict(status="measured", summary=summary, rows=[r], goal="optim", goal_met=apollo <= 1.5, profile=profile)


def section_hybrid(device: str, quick: bool) -> dict:
    # a row list of its own: gpu_check's sections append to its running section's list, and a gpu_check run earlier
    # in the same process (its tests call main() in-process) can leave rows of another section in the base one
    G._ROWS.append([])
    try:
        return G.section_hybrid(device, quick)
    finally:
        G._ROWS.pop()


RUNNERS: dict[str, Callable[[str, bool], dict]] = {
    "throughput": section_throughput, "overhead": section_overhead, "lean": section_lean, "syncs": section_syncs,
    "optim": section_optim, "hybrid": section_hybrid,
}


# ---------------------------------------------------------------------------------------------- item 5: profiles
def profile_summary(fn: Callable[[], Any], device: str, rows: int = 15) -> str:
    """``torch.profiler`` around ``fn()``: the ``key_averages`` table, top ``rows`` by device time (CPU time on a
    CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    key = "self_cuda_time_total" if torch.device(device).type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def run(device: str, sections, quick: bool, log=print, total_s: float | None = None,
        on_section: Callable[[dict], None] | None = None) -> dict:
    results: dict[str, Any] = dict(environment=G.environment(device), quick=quick, sections={}, goals={},
                                   profiles={}, started=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    start = time.perf_counter()
    profiles = []
    for name in sections:
        left = None if total_s is None else total_s - (time.perf_counter() - start)
        if left is not None and left < 5:
            results["sections"][name] = dict(status="skipped: no time left", summary="")
            continue
        budget = BUDGETS_S[name] if quick is False else None
        if budget and left is not None:
            budget = min(budget, left)
        t0 = time.perf_counter()
        try:
            with G.time_limit(budget):
                res = RUNNERS[name](device, quick)
        except G.SectionTimeout as e:
            res = dict(status="timeout", summary=str(e))
        except Exception as e:
            res = dict(status="error", summary=f"{type(e).__name__}: {str(e)[:300]}",
                       traceback=traceback.format_exc()[-3000:])
        G._free(device)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        goal, met, prof = res.pop("goal", None), res.pop("goal_met", None), res.pop("profile", None)
        if goal:
            verdict = "quick (not judged)" if quick else ("met" if met else ("missed" if met is False else "not measured"))
            results["goals"][goal] = dict(goal=GOALS[goal], verdict=verdict, section=name)
            if prof is not None and (quick or met is False):
                profiles.append((goal, prof))
        results["sections"][name] = res
        log(f"gpu_check_1b: {name}: {res['status']} ({res['seconds']} s): {res['summary']}")
        if on_section is not None:  # written after every section: a run stopped later keeps what it measured
            on_section(results)
    for goal, fn in profiles:  # item 5: where the time of a missed goal goes (every goal's in --quick)
        left = None if total_s is None else total_s - (time.perf_counter() - start)
        if left is not None and left < 10:
            results["profiles"][goal] = "skipped: no time left"
            continue
        try:
            with G.time_limit(None if quick else min(PROFILE_BUDGET_S, left or PROFILE_BUDGET_S)):
                results["profiles"][goal] = profile_summary(fn, device)
        except BaseException as e:  # SectionTimeout too: the rest is kept
            results["profiles"][goal] = f"profile failed: {type(e).__name__}: {str(e)[:200]}"
        G._free(device)
        if on_section is not None:
            on_section(results)
    results.setdefault("goals", {})["plan"] = dict(goal=GOALS["plan"], verdict="measured by gpu_check.py --only plan",
                                                   section="-")
    return results


def render(results: dict, command: str) -> str:
    env = results["environment"]
    lines = ["# GPU check at real sizes (issue 53 item 4)", "", f"Command: `{command}`", "",
             f"Started {results['started']}; device: {env.get('device_name', env.get('device', '?'))}; "
             f"torch {torch.__version__}; quick: {results['quick']}.", "",
             "| section | status | seconds | summary |", "|---|---|---|---|"]
    for name, r in results["sections"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '-')} | {r['summary']} |")
    lines += ["", "## Goals", "", "| goal | verdict | section |", "|---|---|---|"]
    for g in results["goals"].values():
        lines.append(f"| {g['goal']} | {g['verdict']} | {g['section']} |")
    if results["profiles"]:
        lines += ["", "## Profiles (item 5: where the time goes)", ""]
        for goal, table in results["profiles"].items():
            lines += [f"### {goal}", "", "```", table.rstrip(), "```", ""]
    data = {k: v for k, v in results.items() if k != "profiles"}
    lines += ["", "<details><summary>JSON</summary>", "", "```json", json.dumps(data, indent=1, default=str), "```",
              "", "</details>", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the whole code path in seconds (CPU: tests)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for everything (default 450; quick: none)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check_1b: skipped: no CUDA device (torch.cuda.is_available() is False); nothing written")
        return 0
    sections = SECTIONS if a.only is None else tuple(s for s in a.only.split(",") if s)
    unknown = [s for s in sections if s not in RUNNERS]
    if unknown:
        print(f"gpu_check_1b: --only {','.join(unknown)}: unknown; allowed: {','.join(SECTIONS)}")
        return 2
    total = a.budget_s if a.budget_s is not None else (None if a.quick else 450.0)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)

    def save(results: dict) -> None:
        Path(a.out).write_text(render(results, command))

    results = run(a.device, sections, a.quick, total_s=total, on_section=save)
    save(results)
    print(f"gpu_check_1b: wrote {a.out}")
    return 0 if all(r["status"] in ("measured", "passed") for r in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
