"""Training throughput in real (non-pad) tokens per second: packed vs padded, same model, one run.

    python benchmarks/bench_packing_throughput.py            # ~2 min on 2 CPU cores

A tiny random-init Llama (hidden 128, 4 layers, sdpa) trains on lognormal-length samples (median
~300 tokens, capped at the budget) three ways, interleaved over several rounds:

- padded: stock Trainer, random batches of 8 samples padded to the longest (the usual setup);
- packed, rows mode: hf_gradfix packing, one row of <= budget tokens per step, sdpa with position_ids;
- packed, varlen mode: the same rows with cu_seq_lens through the reference varlen attention (on a
  GPU this would be flash_attention_2; the CPU reference is a plain per-sequence loop).

Real tokens/s = tokens that are not padding / wall time of the training steps. Padding waste of the
padded runs is printed too: the packed speed-up should approach 1 / (1 - waste). Ratios only: this
machine is noisy and absolute CPU times mean little.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import hf_gradfix  # noqa: E402
from _common import versions  # noqa: E402

transformers.logging.set_verbosity_error()


def lengths(n: int, seed: int, budget: int, sigma: float) -> list[int]:
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(300), sigma=sigma, size=n)
    return [int(min(max(x, 8), budget)) for x in raw]


class Rows(torch.utils.data.Dataset):
    def __init__(self, lens, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.items = [{"input_ids": torch.randint(4, vocab, (n,), generator=g).tolist()} for n in lens]
        for item in self.items:
            item["labels"] = list(item["input_ids"])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(features):
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for r, f in enumerate(features):
        n = len(f["input_ids"])
        ids[r, :n] = torch.tensor(f["input_ids"])
        labels[r, :n] = torch.tensor(f["labels"])
        mask[r, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class Meter(transformers.TrainerCallback):
    """Real tokens and wall time of the training steps after the first (warm-up) step."""

    def __init__(self):
        self.tokens = 0
        self.padded = 0
        self.t0 = None
        self.elapsed = 0.0
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self.t0 is not None:
            self.elapsed += now - self.t0
            self.steps += 1
        self.t0 = now


class CountingTrainer(transformers.Trainer):
    meter: Meter

    def training_step(self, model, inputs, *args, **kwargs):
        if self.meter.t0 is not None:  # not the warm-up step
            self.meter.tokens += int((inputs["labels"] != -100).sum()) + int(inputs["labels"].shape[0])
            self.meter.padded += int(inputs["input_ids"].numel())
        return super().training_step(model, inputs, *args, **kwargs)


def model(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   use_cache=False, pad_token_id=0)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def run(kind: str, data: Rows, steps: int, budget: int, batch: int) -> tuple[float, float]:
    meter = Meter()
    args = transformers.TrainingArguments(
        output_dir="/tmp/hgf_bench_pack", max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-4,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_strategy="no",
        remove_unused_columns=False, seed=0, dataloader_num_workers=0,
    )
    if kind != "padded":
        hf_gradfix.patch({"packing": {"enabled": True, "token_budget": budget, "mode": kind}, "log_fixes": False})
    try:
        trainer = CountingTrainer(model=model(0), args=args, train_dataset=data, data_collator=pad_collate, callbacks=[meter])
        trainer.meter = meter
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    waste = 1.0 - meter.tokens / max(meter.padded, 1)
    return meter.tokens / meter.elapsed, waste


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths (1.0: the research case)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    data = Rows(lengths(args.samples, 0, args.budget, args.sigma), 512, 0)
    results: dict[str, list[tuple[float, float]]] = {"padded": [], "rows": [], "varlen": []}
    t0 = time.time()
    for _ in range(args.rounds):
        for kind in results:
            results[kind].append(run(kind, data, args.steps, args.budget, 8))
    base = statistics.median(r[0] for r in results["padded"])
    print(f"{versions('torch', 'transformers')}; tiny Llama (hidden 128, 4 layers), "
          f"lognormal lengths (median 300, sigma {args.sigma}), budget {args.budget}, padded batches of 8; medians of {args.rounds} rounds\n")
    print("| setup | real tokens/s | vs padded | padding waste |")
    print("|---|---:|---:|---:|")
    names = {"padded": "stock Trainer, padded batches of 8", "rows": "hf_gradfix packing, rows (sdpa + position_ids)",
             "varlen": "hf_gradfix packing, varlen (reference varlen attention)"}
    for kind, rows in results.items():
        speed = statistics.median(r[0] for r in rows)
        waste = statistics.median(r[1] for r in rows)
        print(f"| {names[kind]} | {speed:,.0f} | {speed / base:.2f}x | {100 * waste:.1f} % |")
    print(f"\n(command: python {' '.join(sys.argv)}; {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
