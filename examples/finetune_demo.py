"""hf_gradfix demo: the same fine-tuning run, three ways, on CPU in well under a minute.

    python examples/finetune_demo.py                      # tiny random-init Llama, byte-level tokenizer, no hub
    python examples/finetune_demo.py --steps 60 --seed 1 --out outputs/demo_s1
    python examples/finetune_demo.py --model PATH_OR_HUB_ID --lr 1e-3   # a real causal LM instead

What it shows. One initial model is trained three times on exactly the same optimizer windows
(``--grad-accum`` micro-batches of ``--batch-size`` paragraphs of ``examples/data/corpus.txt`` per
optimizer step, fixed order, no shuffling), all with plain SGD at the same constant learning rate
(default 0.1, 40 steps; about 20 s on 2 CPU cores):

(a) reference: a plain PyTorch loop; per optimizer step ONE forward over the whole global batch
    (grad_accum x batch_size samples, padded) and loss = token-mean cross-entropy over every real
    target of the window (computed here from the logits, with the causal shift);
(b) stock ``transformers.Trainer`` with gradient accumulation and the ``compute_loss`` override from the
    Hugging Face docs/course (``return outputs.loss``). In transformers 5.x such an override is assumed
    to be already scaled for gradient accumulation, so the micro-batch means are summed: the gradient is
    about grad_accum times too large (the Trainer also logs a loss 4x the true one at GA 4) and the
    micro-batches are weighted equally instead of by their token counts. With SGD that is a
    grad_accum-times larger learning rate (AdamW would mostly hide the scale);
(c) the same Trainer subclass, built after ``hf_gradfix.patch()``.

After every optimizer step each run's exact token-mean loss on held-out paragraphs is measured with a
plain PyTorch function (independent of the Trainer's logs), together with the parameter distance
``||theta_run - theta_ref|| / ||theta_ref - theta_0||``. Expected: (c) matches (a) to ~1e-7..1e-6
(fp32 summation order and padding width differ; training dynamics slowly amplify that rounding over
many steps or at large learning rates), (b) is off by tens of percent (or diverges at larger --lr).
Writes ``OUT/loss_curves.png`` and ``OUT/results.json``; exits with status 1 if hf_gradfix deviates
from the reference by more than 1e-4 (relative) in held-out loss.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, SequentialSampler

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "data" / "corpus.txt"
HELDOUT_EVERY = 15  # paragraphs 7, 22, 37, ... are held out (never trained on)
TOLERANCE = 1e-4  # max relative deviation of hf_gradfix from the reference (expected ~1e-6)


# ----------------------------------------------------------------------------------------------------
# Data: one sample per paragraph, byte-level tokenizer (vocab 256 + pad/bos/eos)
# ----------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus pad=256, bos=257, eos=258."""

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, max_len: int) -> list[int]:
        ids = [self.bos_token_id, *text.encode("utf-8")]
        return ids[: max_len - 1] + [self.eos_token_id]


class HFTokenizerAdapter:
    """A ``transformers`` tokenizer with the same ``encode`` contract (bos if the tokenizer adds one, eos appended)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        if tokenizer.pad_token_id is None:
            # Many causal LMs ship without a pad token. Padding positions are masked by attention_mask and their
            # labels are -100 (built from lengths, never from `ids == pad`), so reusing eos is safe here.
            if tokenizer.eos_token is not None:
                tokenizer.pad_token = tokenizer.eos_token
            else:
                tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str, max_len: int) -> list[int]:
        ids = self.tok(text, add_special_tokens=True)["input_ids"]
        if self.eos_token_id is not None:
            ids = ids[: max_len - 1]
            if not ids or ids[-1] != self.eos_token_id:
                ids = ids + [self.eos_token_id]
        return ids[:max_len]


def read_paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


class ListDataset(Dataset):
    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


class Collator:
    """Right-pads a list of ``{"input_ids": [...]}``; labels = input_ids with -100 on padding."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = pad_token_id

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n] = torch.tensor(s["input_ids"], dtype=torch.long)
            mask[row, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------

_DROPOUT_KEYS = (
    "attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "summary_first_dropout", "classifier_dropout",
    "activation_dropout", "embed_dropout", "residual_dropout",
)  # fmt: skip


def build_model_and_tokenizer(args):
    """(model, tokenizer adapter) with dropout off, so the three runs can be compared exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model is None:
        tok = ByteTokenizer()
        config = LlamaConfig(
            vocab_size=tok.vocab_size,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            use_cache=False,
        )
        return LlamaForCausalLM(config).float(), tok

    tok = HFTokenizerAdapter(AutoTokenizer.from_pretrained(args.model))
    config = AutoConfig.from_pretrained(args.model)
    for key in _DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    config.use_cache = False
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=torch.float32)
    for module in model.modules():  # belt and braces: modules that read p from elsewhere
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if len(tok.tok) > model.get_input_embeddings().num_embeddings:  # a pad token was added
        model.resize_token_embeddings(len(tok.tok))
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, tok


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def causal_ce_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over every real target of ``batch`` (computed from logits), and the count."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss_sum, int(targets.ne(-100).sum())


@torch.no_grad()
def heldout_loss(model, samples: list[dict], collate: Collator, chunk: int = 8) -> float:
    """Exact token-mean loss over all held-out paragraphs (plain PyTorch, float64 accumulation)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(samples), chunk):
        loss_sum, n = causal_ce_sum(model, collate(samples[i : i + chunk]))
        total += float(loss_sum.double())
        count += n
    model.train(was_training)
    return total / count


class Recorder:
    """Held-out loss and parameter snapshots after every optimizer step (and before the first)."""

    def __init__(self, heldout, collate, snapshot_steps) -> None:
        self.heldout, self.collate, self.snapshot_steps = heldout, collate, snapshot_steps
        self.losses: list[float] = []
        self.params: dict[int, torch.Tensor] = {}

    def record(self, model, step: int) -> None:
        self.losses.append(heldout_loss(model, self.heldout, self.collate))
        if step in self.snapshot_steps:
            self.params[step] = flat_params(model)


# ----------------------------------------------------------------------------------------------------
# (a) reference, (b)/(c) Trainer
# ----------------------------------------------------------------------------------------------------


def run_reference(model, windows, collate, args, rec: Recorder) -> list[float]:
    """One forward per optimizer step over the whole global batch; loss = token mean over the window."""
    model.to("cuda" if torch.cuda.is_available() else "cpu")  # the device the Trainer uses
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    model.train()
    rec.record(model, 0)
    train_losses = []
    for step, window in enumerate(windows, start=1):
        loss_sum, count = causal_ce_sum(model, collate(window))
        loss = loss_sum / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        train_losses.append(loss.item())
        rec.record(model, step)
    return train_losses


def run_trainer(model, train_samples, collate, args, rec: Recorder, out_dir: Path) -> list[float]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class TutorialTrainer(Trainer):
        """The custom-loss pattern of the Hugging Face docs/course."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            loss = outputs.loss
            return (loss, outputs) if return_outputs else loss

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # fixed order: the same windows as the reference

    class Measure(TrainerCallback):
        def __init__(self) -> None:
            self.logged: list[float] = []

        def on_train_begin(self, targs, state, control, model=None, **kwargs):
            rec.record(model, 0)

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            rec.record(model, state.global_step)  # after the optimizer step, before any logging

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logged.append(float(logs["loss"]))

    targs = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,  # no clipping: the scale error must show
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=args.seed,
    )
    measure = Measure()
    trainer = TutorialTrainer(
        model=model, args=targs, train_dataset=ListDataset(train_samples), data_collator=collate, callbacks=[measure]
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts would drown the table
    trainer.train()
    return measure.logged


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def distances(rec: Recorder, ref: Recorder, theta0: torch.Tensor) -> list[float | None]:
    out: list[float | None] = []
    for step in range(len(ref.losses)):
        if step == 0 or step not in ref.params or step not in rec.params:
            out.append(None)
            continue
        moved = float((ref.params[step].double() - theta0.double()).norm())
        out.append(float((rec.params[step].double() - ref.params[step].double()).norm()) / moved)
    return out


def max_rel(curve: list[float], ref: list[float]) -> float:
    """Max relative difference; inf if the run produced NaN/inf (diverged)."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(curve, ref)]
    return max(diffs) if all(math.isfinite(d) for d in diffs) else math.inf


def first_nonfinite(curve: list[float]) -> int | None:
    return next((s for s, v in enumerate(curve) if not math.isfinite(v)), None)


def jsonable(obj):
    """results.json stays strict JSON: NaN/inf become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def plot(path: Path, res: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = res["steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    summary = {k: ("inf (diverged)" if v is None else f"{v:.1e}") for k, v in res["summary"].items()
               if k.endswith("_rel_diff")}  # fmt: skip
    nan = float("nan")
    curves = {k: [nan if v is None else v for v in res["heldout_loss"][k]] for k in res["heldout_loss"]}
    ax1.plot(steps, curves["reference"], "-", color="black", lw=5, alpha=0.35,
             label="reference: plain PyTorch, one forward over the global batch", zorder=1)
    ax1.plot(steps, curves["stock"], "-s", color="tab:red", ms=3.5, lw=1.6, zorder=2,
             label=f"stock Trainer, tutorial compute_loss: max rel. diff {summary['stock_max_rel_diff']}")
    ax1.plot(steps, curves["hf_gradfix"], "--o", color="tab:blue", ms=3, lw=1.4, zorder=3,
             label=f"same Trainer after hf_gradfix.patch(): max rel. diff {summary['hf_gradfix_max_rel_diff']}")
    # Keep the reference readable when the stock run blows up (NaN or huge values are left off the chart).
    ok_vals = [v for k in ("reference", "hf_gradfix") for v in curves[k] if math.isfinite(v)]
    lo, hi = min(ok_vals), max(ok_vals)
    ax1.set_ylim(lo - 0.08 * (hi - lo), hi + 0.12 * (hi - lo))
    off = [s for s, v in zip(steps, curves["stock"]) if not math.isfinite(v) or v > hi + 0.12 * (hi - lo)]
    if off:
        ax1.annotate(f"stock Trainer off the chart (or NaN) from step {off[0]}", xy=(0.5, 0.97), xycoords="axes fraction",
                     ha="center", va="top", color="tab:red", fontsize=9)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("held-out loss (exact token mean, nats)")
    ax1.set_title("Held-out loss after each optimizer step")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="upper right" if not off else "center right")

    for key, color, marker, label in (
        ("stock", "tab:red", "s", "stock Trainer"),
        ("hf_gradfix", "tab:blue", "o", "Trainer + hf_gradfix"),
    ):
        pts = [(s, d) for s, d in zip(steps, res["param_distance"][key]) if d is not None and math.isfinite(d) and d > 0]
        if pts:
            ax2.semilogy(*zip(*pts), f"-{marker}", color=color, ms=3.5, label=label)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel(r"$\|\theta_{run}-\theta_{ref}\| \,/\, \|\theta_{ref}-\theta_0\|$")
    ax2.set_title("Parameter distance to the reference run (log scale)")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8.5)
    model = args.model or "tiny random-init Llama (hidden 64, 2 layers), byte tokenizer"
    fig.suptitle(
        f"{model}: SGD lr={args.lr:g}, batch {args.batch_size} x grad-accum {args.grad_accum}, same windows, same init",
        fontsize=10.5,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub id or local path of a causal LM (default: tiny random-init Llama)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--grad-accum", type=int, default=4, help="gradient accumulation steps (default 4)")
    p.add_argument("--batch-size", type=int, default=2, help="per-device micro-batch size (default 2)")
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.1 for the tiny model, 1e-3 with --model)")
    p.add_argument("--max-len", type=int, default=256, help="truncate samples to this many tokens (default 256)")
    p.add_argument("--out", default="outputs/demo", help="output folder (default outputs/demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1 for the tiny model: as fast, and immune to oversubscribed cores; "
                   "torch's default with --model)")  # fmt: skip
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 0.1 if args.model is None else 1e-3
    if args.threads is None and args.model is None:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import transformers

    import hf_gradfix

    transformers.logging.set_verbosity_error()

    # Data: paragraphs -> samples; held-out paragraphs are never trained on; the training stream cycles
    # through the rest in file order, so every optimizer window is known in advance.
    base_model, tok = build_model_and_tokenizer(args)
    paragraphs = read_paragraphs(CORPUS)
    heldout = [{"input_ids": tok.encode(t, args.max_len)} for i, t in enumerate(paragraphs) if i % HELDOUT_EVERY == 7]
    pool = [{"input_ids": tok.encode(t, args.max_len)} for i, t in enumerate(paragraphs) if i % HELDOUT_EVERY != 7]
    per_step = args.batch_size * args.grad_accum
    train_samples = [pool[i % len(pool)] for i in range(args.steps * per_step)]
    windows = [train_samples[s * per_step : (s + 1) * per_step] for s in range(args.steps)]
    collate = Collator(tok.pad_token_id)
    lengths = [len(s["input_ids"]) for s in pool]
    targets = [sum(len(s["input_ids"]) - 1 for s in w) for w in windows]
    print(
        f"data: {len(paragraphs)} paragraphs from {CORPUS.name}: {len(pool)} for training ({min(lengths)}-{max(lengths)} "
        f"tokens each), {len(heldout)} held out; {args.steps} optimizer steps x {args.grad_accum} micro-batches x "
        f"{args.batch_size} samples; {min(targets)}-{max(targets)} targets per window"
    )

    # Parameter snapshots for the distance panel: every step for small models, fewer for big --model runs
    # (about 1 GB of fp32 snapshots per run at most).
    numel = sum(p.numel() for p in base_model.parameters())
    every = max(1, math.ceil((args.steps + 1) * numel * 4 / 1e9))
    snapshot_steps = set(range(0, args.steps + 1, every)) | {args.steps}
    theta0 = flat_params(base_model)

    def fresh_model():
        gc.collect()  # drop the previous run's model/optimizer before copying a new one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return copy.deepcopy(base_model)  # base_model itself is never trained: the same initial weights

    recs, logged, times = {}, {}, {}
    print(f"model: {type(base_model).__name__}, {numel / 1e6:.3f}M parameters; SGD lr={args.lr:g}")

    t = time.perf_counter()
    recs["reference"] = Recorder(heldout, collate, snapshot_steps)
    ref_train = run_reference(fresh_model(), windows, collate, args, recs["reference"])
    times["reference"] = time.perf_counter() - t
    print(f"(a) reference loop: {times['reference']:.1f} s")

    t = time.perf_counter()
    recs["stock"] = Recorder(heldout, collate, snapshot_steps)
    logged["stock"] = run_trainer(fresh_model(), train_samples, collate, args, recs["stock"], out / "trainer_stock")
    times["stock"] = time.perf_counter() - t
    print(f"(b) stock Trainer: {times['stock']:.1f} s")

    t = time.perf_counter()
    hf_gradfix.patch()
    try:
        recs["hf_gradfix"] = Recorder(heldout, collate, snapshot_steps)
        logged["hf_gradfix"] = run_trainer(
            fresh_model(), train_samples, collate, args, recs["hf_gradfix"], out / "trainer_hf_gradfix"
        )
    finally:
        hf_gradfix.unpatch()
    times["hf_gradfix"] = time.perf_counter() - t
    print(f"(c) Trainer + hf_gradfix: {times['hf_gradfix']:.1f} s")

    ref = recs["reference"].losses
    for name in ("stock", "hf_gradfix"):
        if len(recs[name].losses) != len(ref):
            print(f"ERROR: {name} recorded {len(recs[name].losses) - 1} optimizer steps, expected {args.steps}")
            return 2
    dist = {k: distances(recs[k], recs["reference"], theta0) for k in ("stock", "hf_gradfix")}
    rel = {k: max_rel(recs[k].losses, ref) for k in ("stock", "hf_gradfix")}
    dmax = {k: max((d if math.isfinite(d) else math.inf for d in dist[k] if d is not None), default=math.nan) for k in dist}

    print()
    print("held-out loss (exact token mean, nats) after each optimizer step; dist = ||theta - theta_ref|| / ||theta_ref - theta_0||")
    header = f"{'step':>4}  {'reference':>10}  {'stock Trainer':>13}  {'hf_gradfix':>10}  {'dist stock':>10}  {'dist hf_gradfix':>15}"
    print(header)
    print("-" * len(header))
    for s in range(args.steps + 1):
        print(
            f"{s:>4}  {ref[s]:>10.6f}  {recs['stock'].losses[s]:>13.6f}  {recs['hf_gradfix'].losses[s]:>10.6f}  "
            f"{fmt(dist['stock'][s], '.2e'):>10}  {fmt(dist['hf_gradfix'][s], '.2e'):>15}"
        )
    print()
    ok = math.isfinite(rel["hf_gradfix"]) and rel["hf_gradfix"] <= TOLERANCE
    print(
        f"hf_gradfix vs reference: max relative held-out loss difference {rel['hf_gradfix']:.2e}, "
        f"max parameter distance {dmax['hf_gradfix']:.2e}  -> {'MATCHES' if ok else 'DEVIATES'} (tolerance {TOLERANCE:g})"
    )
    stock_off = rel["stock"] > 100 * max(rel["hf_gradfix"], 1e-6)
    nan_step = first_nonfinite(recs["stock"].losses)
    print(
        f"stock Trainer vs reference: max relative held-out loss difference {rel['stock']:.2e}, "
        f"max parameter distance {dmax['stock']:.2e}  -> "
        + ("STOCK TRANSFORMERS DEVIATES from the reference" if stock_off else "no clear deviation (unexpected)")
        + (f" (diverged: NaN/inf from step {nan_step})" if nan_step is not None else "")
    )
    if logged["stock"] and logged["hf_gradfix"]:
        print(
            f"Trainer-logged training loss at step 1: stock {logged['stock'][0]:.4f} ({logged['stock'][0] / ref_train[0]:.2f}x "
            f"the true window token mean {ref_train[0]:.4f}), hf_gradfix {logged['hf_gradfix'][0]:.4f}"
        )
    total = time.perf_counter() - t_start

    res = {
        "config": {
            "model": args.model or "tiny LlamaForCausalLM (hidden 64, 2 layers, byte tokenizer, random init)",
            "parameters": numel,
            "steps": args.steps,
            "grad_accum": args.grad_accum,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "optimizer": "SGD (constant lr, no clipping)",
            "max_len": args.max_len,
            "seed": args.seed,
            "heldout_paragraphs": len(heldout),
            "targets_per_window": targets,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "hf_gradfix": hf_gradfix.__version__,
        },
        "steps": list(range(args.steps + 1)),
        "heldout_loss": {k: recs[k].losses for k in ("reference", "stock", "hf_gradfix")},
        "param_distance": dist,
        "train_loss": {"reference_window_token_mean": ref_train, "stock_trainer_logged": logged["stock"],
                       "hf_gradfix_trainer_logged": logged["hf_gradfix"]},
        "summary": {
            "hf_gradfix_max_rel_diff": rel["hf_gradfix"],
            "stock_max_rel_diff": rel["stock"],
            "hf_gradfix_max_param_distance": dmax["hf_gradfix"],
            "stock_max_param_distance": dmax["stock"],
            "tolerance": TOLERANCE,
            "hf_gradfix_matches": ok,
            "stock_deviates": stock_off,
        },
        "runtime_s": {**times, "total": total},
    }  # fmt: skip
    res = jsonable(res)
    (out / "results.json").write_text(json.dumps(res, indent=1, allow_nan=False))
    plot(out / "loss_curves.png", res, args)
    print(f"wrote {out / 'loss_curves.png'} and {out / 'results.json'}; total runtime {total:.1f} s")
    if not ok:
        print(f"FAIL: hf_gradfix deviates from the reference by {rel['hf_gradfix']:.2e} > {TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
