"""The lean loss head (``loss.head: lean``) beside the stock head and TRL's fused head: peak memory of one training
step (forward, loss, backward) and its time, at several vocabularies and tokens per micro-batch, in one run; and the
Trainer's first and second optimizer steps (``--trainer``), where the first window's loss probes run.

    python benchmarks/bench_lean_head.py                       # the CPU grid (~15 min on 2 cores), markdown table
    python benchmarks/bench_lean_head.py --vocab 32000 --tokens 2048 --repeats 1    # one cell
    python benchmarks/bench_lean_head.py --trainer             # the Trainer's steps 1 and 2 (~3 min on 2 cores)
    python benchmarks/bench_lean_head.py --out benchmarks/results/lean_head.md
    python benchmarks/bench_lean_head.py --formula             # the planner's count at 4,096 x 32,000 (see below)

Each (vocabulary, tokens, head) cell runs in its own process (the peak of one process is not reset by another's
frees): a tiny Llama (hidden 64, 2 layers, fp32) whose LM head is the vocabulary's; the step is
``model(input_ids, labels).loss.backward()`` for the stock head, the same call through the plugin's lean path
(``hf_gradfix.integration.lean_head.run_model``, what the Trainer runs with ``loss.head: lean``) and TRL's
``add_fused_lm_head(...)`` + ``fused_lm_head=True`` where TRL is importable. Peak memory: the process's resident set
high-water mark during the step (``/proc/self/status`` VmHWM after resetting it through ``/proc/self/clear_refs``)
above the resident set before it: the real allocations, the C++ kernels' own buffers included (torch's MemTracker
sees only tensors that pass the dispatcher, not the chunked kernel's internal chunks). On a GPU, the GPU check
records ``torch.cuda.max_memory_allocated`` instead. Time: the median of ``--repeats`` steps after one warm-up.
A stock cell whose logits alone (tokens x vocabulary x 4 bytes, twice with their gradient) would not fit in
``--max-gib`` is not run, and says so. Also checked in every cell: the lean loss and gradient equal the stock ones
(relative error of the head's weight gradient), so a fast wrong head cannot appear in the table.

``--trainer``: the same model trained by ``transformers.Trainer`` for two optimizer steps (one row of ``tokens`` per
step, no accumulation, SGD): the plain Trainer (stock) against hf_gradfix with ``loss.head: lean`` (``patch()``).
Each step's peak is the resident high-water mark from ``on_step_begin`` to ``on_step_end`` above the resident set at
``on_step_begin``; step 1 holds the first window's loss probes (five no-grad forwards, through the lean head since
issue 50: before, through the stock head, step 1 peaked at 0.66x stock). Checked: the two runs' logged losses agree.

``--formula``: the planner's count of the lean head (``hf_gradfix.plan.lean_head``) against the measured peak of the
head alone (``tests/support/plan_lean_head_probe.py``, the comparison of tests/plan/test_plan_lean_head.py) at the
large shapes, 4,096 tokens x hidden 256 x vocabulary 32,000 in fp32 and bf16 autocast: the test's own shapes run in
seconds, these took over 300 s in bf16 on a loaded 2-core CPU (issue 54). Measured there: fp32 in 160 s (formula
error 0.001, control 4.8); bf16 autocast not done in 1,800 s at nice 10 under a load average of 8-9 (a CPU without
native bf16 matmul: run it where bf16 is native, or alone). Exit code 1 if the formula misses by more than 10 %, the
control (the other path's formula) does not, or a shape does not finish in ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, md_row  # noqa: E402

GRID = [(32000, 2048), (32000, 8192), (32000, 32768), (128256, 2048), (128256, 8192), (151936, 2048),
        (151936, 8192)]
TRAINER_GRID = [(32000, 2048), (32000, 8192), (128256, 2048)]
TRAINER_SECTION = "## The Trainer's first and second steps"
HIDDEN = 64


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _cell(vocab: int, tokens: int, head: str, repeats: int) -> dict:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens,
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()
    ids = torch.randint(4, vocab, (1, tokens))
    labels = ids.clone()
    labels[:, : tokens // 4] = -100  # a prompt
    n = torch.tensor(float((labels[:, 1:] != -100).sum()))
    call = {"input_ids": ids, "labels": labels, "num_items_in_batch": n}
    if head == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)

        def step():
            return model(input_ids=ids, labels=labels, num_items_in_batch=n, fused_lm_head=True).loss
    elif head == "lean":
        from hf_gradfix.integration.lean_head import LeanHead, run_model

        plan = LeanHead()

        def step():
            return run_model(plan, model, call, lambda: model(**call), True).loss
    else:
        def step():
            return model(**call).loss

    def once():
        model.zero_grad(set_to_none=True)
        loss = step()
        loss.backward()
        return float(loss)

    once()  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    t0 = time.perf_counter()
    loss = once()
    first = time.perf_counter() - t0
    peak = _rss_kib("VmHWM") - before
    times = [first]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    grad = model.lm_head.weight.grad.double()
    # a strided sample of the head's weight gradient: enough to compare the heads, small enough to print
    return dict(loss=loss, peak_mib=peak / 1024, seconds=statistics.median(times),
                grad_sample=grad.flatten()[:: max(1, grad.numel() // 4096)].tolist())


def _trainer_cell(vocab: int, tokens: int, head: str, steps: int = 2) -> dict:
    """Two optimizer steps of ``transformers.Trainer`` (stock) or of hf_gradfix's with ``loss.head: lean``: each
    step's resident peak above its start, its time, its logged loss; the lean head's call counts."""
    import tempfile

    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens,
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").float()
    rows = []
    for _ in range(steps):
        ids = torch.randint(4, vocab, (tokens,))
        labels = ids.clone()
        labels[: tokens // 4] = -100  # a prompt
        rows.append({"input_ids": ids, "labels": labels})
    measured: list[dict] = []

    class Steps(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.before = _rss_kib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            measured.append({"peak_mib": (_rss_kib("VmHWM") - self.before) / 1024,
                             "seconds": time.perf_counter() - self.t0})

    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(
            output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=steps,
            optim="sgd", learning_rate=1e-3, max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
            remove_unused_columns=False)
        if head == "lean":
            import hf_gradfix

            hf_gradfix.patch({"loss": {"head": "lean"}, "log_fixes": False})
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows, callbacks=[Steps()],
                             data_collator=lambda batch: {k: torch.stack([b[k] for b in batch]) for k in batch[0]})
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lean = None
    if head == "lean":
        from hf_gradfix.integration.state import state_of

        lean = state_of(trainer).lean
    return dict(steps=measured, losses=losses,
                lean=None if lean is None else dict(calls=lean.calls, probe_calls=getattr(lean, "probe_calls", 0),
                                                    stock_calls=lean.stock_calls))


def _run_cell(vocab, tokens, head, repeats, timeout) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    flag = "--trainer-cell" if repeats is None else "--cell"
    proc = subprocess.run([sys.executable, __file__, flag, f"{vocab},{tokens},{head},{repeats}"],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _formula_table(args) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from plan_lean_head_probe import BENCH_SHAPES, formula_errors

    lines = ["| tokens | hidden | vocab | mode | path | measured peak MiB | formula error | control error | s |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    ok = True
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for tokens, hidden, vocab, mode in BENCH_SHAPES:
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "plan_lean_head_probe.py"),
                                   str(tokens), str(hidden), str(vocab), mode], capture_output=True, text=True,
                                  env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            lines.append(md_row([tokens, hidden, vocab, mode, "-", f"not done in --timeout {args.timeout:.0f} s", "-",
                                 "-", f"{time.perf_counter() - started:.0f}"]))
            print(lines[-1], file=sys.stderr, flush=True)
            ok = False
            continue
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            lines.append(md_row([tokens, hidden, vocab, mode, "error", (proc.stderr.strip().splitlines() or ["?"])[-1][:80],
                                 "-", "-", f"{seconds:.0f}"]))
            ok = False
            continue
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        e = formula_errors(tokens, hidden, vocab, mode, got)
        ok = ok and e["err"] <= 0.10 < e["control_err"]
        lines.append(md_row([tokens, hidden, vocab, mode, e["path"], f"{got['peak'] / 2**20:.1f}", f"{e['err']:.3f}",
                             f"{e['control_err']:.2f}", f"{seconds:.0f}"]))
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", help="vocabularies (default: the grid)")
    parser.add_argument("--tokens", type=int, nargs="*", help="tokens per micro-batch (default: the grid)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-gib", type=float, default=12.0, help="skip a stock cell whose logits would not fit")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trainer", action="store_true",
                        help="the Trainer's first and second steps, stock vs lean (written into --out's own section)")
    parser.add_argument("--formula", action="store_true",
                        help="the planner's lean-head count against the measured peak at 4,096 x 32,000")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--trainer-cell", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        vocab, tokens, head, repeats = args.cell.split(",")
        print(json.dumps(_cell(int(vocab), int(tokens), head, int(repeats))))
        return 0
    if args.trainer_cell:
        vocab, tokens, head, _ = args.trainer_cell.split(",")
        print(json.dumps(_trainer_cell(int(vocab), int(tokens), head)))
        return 0
    if args.trainer:
        return _trainer_table(args)
    if args.formula:
        return _formula_table(args)

    import torch

    try:
        import trl  # noqa: F401

        heads = ["stock", "lean", "trl"]
    except ImportError:
        heads = ["stock", "lean"]
    grid = [(v, t) for v, t in GRID if (not args.vocab or v in args.vocab) and (not args.tokens or t in args.tokens)]
    if args.vocab and args.tokens:
        grid = [(v, t) for v in args.vocab for t in args.tokens]
    rows = []
    for vocab, tokens in grid:
        cells = {}
        for head in heads:
            logits_gib = 2 * tokens * vocab * 4 / 2**30
            if head != "lean" and logits_gib > args.max_gib:
                cells[head] = {"error": f"not run: its logits and their gradient need {logits_gib:.1f} GiB"}
                continue
            cells[head] = _run_cell(vocab, tokens, head, args.repeats, args.timeout)
            print(f"vocab {vocab} tokens {tokens} {head}: {cells[head].get('error') or 'ok'}", file=sys.stderr,
                  flush=True)
        rows.append((vocab, tokens, cells))

    def cmp(a, b):
        if "error" in a or "error" in b:
            return None
        ga, gb = torch.tensor(a["grad_sample"]), torch.tensor(b["grad_sample"])
        return max(abs(a["loss"] - b["loss"]) / abs(b["loss"]), float((ga - gb).norm() / gb.norm()))

    lines = [
        f"Peak memory of one training step above the resident set before it (MiB), its time (s), and the ratios to "
        f"the stock head; tiny Llama (hidden {HIDDEN}, 2 layers, fp32, CPU, torch {torch.__version__}, "
        f"{os.environ.get('OMP_NUM_THREADS', '2')} threads); `python benchmarks/bench_lean_head.py`.",
        "",
        "| vocab | tokens | stock MiB | lean MiB | lean/stock mem | lean/stock time | " +
        ("TRL fused MiB | TRL/stock mem | TRL/stock time | " if "trl" in heads else "") + "lean vs stock error |",
        "|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if "trl" in heads else "") + "---:|",
    ]
    for vocab, tokens, cells in rows:
        s, lean_cell = cells["stock"], cells["lean"]

        def mib(c):
            return c["error"] if "error" in c else f"{c['peak_mib']:.0f}"

        def ratio(c, key):
            if "error" in c or "error" in s:
                return "-"
            return f"{c[key] / s[key]:.2f}"

        err = cmp(lean_cell, s)
        row = [f"{vocab:,}", f"{tokens:,}", mib(s), mib(lean_cell), ratio(lean_cell, "peak_mib"),
               ratio(lean_cell, "seconds")]
        if "trl" in heads:
            t = cells["trl"]
            row += [mib(t), ratio(t, "peak_mib"), ratio(t, "seconds")]
        row.append("-" if err is None else f"{err:.1e}")
        lines.append(md_row(row))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text("# The lean loss head: memory and time beside the stock head and TRL's fused head\n\n"
                            + text)
    return 0


def _trainer_table(args) -> int:
    import torch

    grid = [(v, t) for v, t in TRAINER_GRID if (not args.vocab or v in args.vocab) and (not args.tokens or t in args.tokens)]
    if args.vocab and args.tokens:
        grid = [(v, t) for v in args.vocab for t in args.tokens]
    lines = [
        TRAINER_SECTION, "",
        "`transformers.Trainer`, two optimizer steps of one row each (no accumulation, SGD), the plain Trainer (stock) "
        "against hf_gradfix with `loss.head: lean`: each step's peak resident memory above its start (MiB; from "
        "`on_step_begin` to `on_step_end`, so step 1 includes the first window's loss probes) and its time; tiny Llama "
        f"(hidden {HIDDEN}, 2 layers, fp32, CPU, torch {torch.__version__}, {os.environ.get('OMP_NUM_THREADS', '2')} "
        "threads); `python benchmarks/bench_lean_head.py --trainer`.",
        "",
        "| vocab | tokens | stock step 1 | lean step 1 | lean/stock step 1 | stock step 2 | lean step 2 | "
        "lean/stock step 2 | lean/stock time (1, 2) | lean calls (probes) | logged loss lean vs stock |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for vocab, tokens in grid:
        cells = {head: _run_cell(vocab, tokens, head, None, args.timeout) for head in ("stock", "lean")}
        print(f"trainer vocab {vocab} tokens {tokens}: " + ", ".join(c.get("error", "ok") for c in cells.values()),
              file=sys.stderr, flush=True)
        s, le = cells["stock"], cells["lean"]
        if "error" in s or "error" in le:
            lines.append(f"| {vocab:,} | {tokens:,} | " + " | ".join([s.get("error", "")[:60], le.get("error", "")[:60]]
                                                                     + ["-"] * 9) + " |")
            continue
        mem = [(s["steps"][k]["peak_mib"], le["steps"][k]["peak_mib"]) for k in range(2)]
        times = "/".join(f"{le['steps'][k]['seconds'] / s['steps'][k]['seconds']:.2f}" for k in range(2))
        err = max(abs(a - b) / abs(b) for a, b in zip(le["losses"], s["losses"]))
        lines.append(f"| {vocab:,} | {tokens:,} | {mem[0][0]:.0f} | {mem[0][1]:.0f} | {mem[0][1] / mem[0][0]:.2f} | "
                     f"{mem[1][0]:.0f} | {mem[1][1]:.0f} | {mem[1][1] / mem[1][0]:.2f} | {times} | "
                     f"{le['lean']['calls']} ({le['lean']['probe_calls']}) | {err:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        old = args.out.read_text() if args.out.exists() else ""
        head = old.split("\n" + TRAINER_SECTION)[0].rstrip("\n")
        args.out.write_text((head + "\n\n" if head else "") + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
