"""MoE router-loss conventions on a training run: what ``global`` costs, how far ``previous`` and ``micro`` are from it.

    python benchmarks/bench_moe.py                 # ~3 min on 2 busy CPU cores; writes benchmarks/results/moe.md
    python benchmarks/bench_moe.py --rounds 5      # tighter medians

Workload: Qwen3-MoE, hidden 128, 4 layers (every layer sparse), 8 experts top-2, vocabulary 259, router loss
coefficient 0.01 (Qwen3-MoE's default is 0.001; larger makes the conventions' difference visible in the gradient),
samples of 16-256 random tokens (lognormal) padded per micro-batch of 4, gradient accumulation 4, fp32, CPU, one torch
thread. Every arm is ``hf_gradfix.patch({"loss": {"aux_loss": ARM}})`` on copies of the same weights and data, and
trains the same windows with learning rate 0 (SGD), so the gradients of every arm are taken at the same weights on
the same batches.

Reported per arm: median optimizer-step time over the rounds (arms interleaved per round, so a shared machine's drift
hits all), its ratio to ``micro``; the **direct cost**: seconds per step spent inside the routing pre-pass
(``global``) or the ``RouterHealthCallback``'s reduction (``micro+health``), over the ``micro`` step time (the stable
number on a shared machine); the relative gradient distance of each arm from ``global`` (the exact window loss) per
step, median and max.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import tempfile
import time

import torch

from _common import cpu_name, results_path, versions

ARMS = ("micro", "global", "previous", "as_is")


def build_model(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    moe_intermediate = getattr(args, "moe_intermediate", None) or args.hidden // 2  # bench_ep.py sets it
    cfg = Qwen3MoeConfig(vocab_size=259, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         moe_intermediate_size=moe_intermediate, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=args.experts,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=True,
                         router_aux_loss_coef=args.coef, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


def make_data(args):
    g = torch.Generator().manual_seed(1)
    lengths = torch.exp(torch.randn(args.samples, generator=g) * 0.8 + 4.3).clamp(16, 256).long().tolist()
    return [{"input_ids": torch.randint(4, 259, (n,), generator=g).tolist()} for n in lengths]


def collate(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, : len(s["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Recorder:
    """Step end times and the accumulated gradient at every optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        rec = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                rec.stamps = [time.perf_counter()]

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                rec.grads.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()
                                            if p.grad is not None]))

            def on_step_end(self, args, state, control, **kwargs):
                rec.stamps.append(time.perf_counter())

        self.callback = _CB()
        self.stamps: list[float] = []
        self.grads: list[torch.Tensor] = []


class DirectTimer:
    """Seconds spent inside the routing pre-pass and the health callback's reduction (their own code): the stable
    number on a shared machine, where step-time medians drift."""

    def __init__(self):
        import hf_gradfix.integration.moe as moe

        self.seconds = 0.0
        self._moe = moe
        self._saved = (moe._prepass, moe.RouterHealthCallback._values)

        def timed(fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0
            return wrapper

        moe._prepass = timed(moe._prepass)
        moe.RouterHealthCallback._values = staticmethod(timed(self._saved[1]))

    def close(self):
        self._moe._prepass, values = self._saved[0], self._saved[1]
        self._moe.RouterHealthCallback._values = staticmethod(values)


def train(arm, base, data, args, health=False):
    import transformers

    import hf_gradfix
    from hf_gradfix.integration.moe import RouterHealthCallback

    rec = Recorder()
    out = tempfile.mkdtemp(prefix="hgf_bench_moe_")
    targs = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.ga, max_steps=args.steps,
        learning_rate=0.0, optim="sgd", max_grad_norm=0.0, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=1, remove_unused_columns=False, dataloader_num_workers=0, seed=0)
    hf_gradfix.patch({"loss": {"aux_loss": arm}, "log_fixes": False})
    try:
        callbacks = [RouterHealthCallback()] if health else []
        trainer = transformers.Trainer(model=copy.deepcopy(base), args=targs, train_dataset=data, data_collator=collate,
                                       callbacks=callbacks + [rec.callback])
        direct = DirectTimer()
        try:
            trainer.train()
        finally:
            direct.close()
    finally:
        hf_gradfix.unpatch()
    steps = [b - a for a, b in zip(rec.stamps[1:], rec.stamps[2:])]  # the first step includes the probe
    return steps, rec.grads, direct.seconds / max(1, len(rec.stamps) - 1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--coef", type=float, default=0.01)
    p.add_argument("--out", default=results_path("moe.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    base, data = build_model(args), make_data(args)
    times = {a: [] for a in ARMS + ("micro+health",)}
    direct = {a: [] for a in ARMS + ("micro+health",)}
    grads = {}
    for r in range(args.rounds):
        order = list(ARMS) + ["micro+health"]
        order = order[r % len(order):] + order[: r % len(order)]
        for arm in order:
            steps, g, own = train(arm.split("+")[0], base, data, args, health=arm.endswith("health"))
            times[arm].append(statistics.median(steps))
            direct[arm].append(own)
            grads.setdefault(arm, g)
    exact = grads["global"]
    lines = [f"# MoE router-loss conventions: cost and distance from the window loss", "",
             f"`python {' '.join(shlex.quote(a) for a in ['benchmarks/bench_moe.py'] + (argv or sys.argv[1:]))}` "
             f"({time.strftime('%Y-%m-%d')}, {cpu_name()}, {versions('torch', 'transformers')}, "
             f"1 thread): Qwen3-MoE hidden {args.hidden}, {args.layers} layers, "
             f"{args.experts} experts top-2, coef {args.coef}, batch {args.batch}, GA {args.ga}, {args.steps} steps x "
             f"{args.rounds} rounds, lr 0 (every arm's gradients at the same weights on the same batches).", "",
             "| arm | step s (median) | vs micro | own code s/step (pre-pass, health) | own code / micro step | "
             "gradient distance from global: median | max |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base_t = statistics.median(times["micro"])
    for arm in ARMS + ("micro+health",):
        t = statistics.median(times[arm])
        own = statistics.median(direct[arm])
        d = [rel(g, e) for g, e in zip(grads[arm], exact)]
        lines.append(f"| {arm} | {t:.3f} | {t / base_t:.3f} | {own:.4f} | {own / base_t:.3f} | "
                     f"{statistics.median(d):.2e} | {max(d):.2e} |")
    lines += ["", "`global` runs one extra no-grad forward per micro-batch (the routing pre-pass); `previous` is the "
              "previous window's frequencies (its first window is `micro`); `as_is` is stock transformers (the router "
              "term x GA). `micro+health` adds `RouterHealthCallback` (logging every step).", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
