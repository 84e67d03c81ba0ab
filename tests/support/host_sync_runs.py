"""Host syncs of a training run, stock vs ``hf_gradfix.patch()``: the runs ``benchmarks/bench_host_syncs.py`` reports
and ``tests/diagnostics/test_host_syncs.py`` bounds.

Each path trains a tiny model twice as long in a second run; the steady-state syncs per optimizer window are the
difference of the two runs' counts over the difference of their windows (what happens once per run, the probe,
the first optimizer-state allocation, the last log, cancels out). The plugin's extra syncs per window are patched
minus stock on the same data.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch

import ecosystem as E
import harness as H
import hf_gradfix
from hf_gradfix.diagnostics.host_syncs import HostSyncCounter

GA = 4


@dataclass
class SyncRun:
    total: int
    windows: int
    micro_batches: int
    by_owner: dict = field(default_factory=dict)
    plugin_sites: dict = field(default_factory=dict)


def _counted(train: Callable[[], object]) -> SyncRun:
    with HostSyncCounter() as counter:
        trainer = train()
    windows = int(trainer.state.global_step)
    return SyncRun(counter.total, windows, windows * GA, counter.by_owner(), counter.sites("hf_gradfix"))


@contextlib.contextmanager
def _patched(patched: bool, config: dict | None = None):
    if patched:
        hf_gradfix.patch({"log_fixes": False, **(config or {})})
    try:
        yield
    finally:
        if patched:
            hf_gradfix.unpatch()


def plain(patched: bool, steps: int) -> SyncRun:
    """A causal LM (tiny Llama) under the plain Trainer: GA 4, AdamW, clipping, logging every step."""
    import datasets
    from transformers import DataCollatorForLanguageModeling, Trainer

    tok = E.build_tokenizer()
    ds = datasets.Dataset.from_dict({"text": E.sentences(8 * GA * steps, seed=1)})
    ds = ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    with _patched(patched):
        model = H.build_model("llama", seed=0)
        args = E.training_args(tempfile.mkdtemp(prefix="hgf_syncs_"), per_device_train_batch_size=2,
                               gradient_accumulation_steps=GA, max_steps=steps, learning_rate=0.1, max_grad_norm=1.0,
                               optim="adamw_torch", logging_steps=1, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))

        def train():
            trainer.train()
            return trainer

        return _counted(train)


def packing(patched: bool, steps: int) -> SyncRun:
    """hf_gradfix's packing (PackedCollator, varlen) against the stock Trainer on the same samples padded."""
    import transformers

    samples = H.make_samples("causal", n=6 * GA * steps, seed=2)
    config = {"packing": {"enabled": True, "token_budget": 64}}
    with _patched(patched, config):
        model = H.build_model("llama", seed=0)
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="hgf_syncs_"), optim="adamw_torch", learning_rate=0.1,
            max_grad_norm=1.0, gradient_accumulation_steps=GA, per_device_train_batch_size=1 if patched else 2,
            max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
            seed=3, remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=H.TokenDataset(samples) if patched else H.ListDataset(samples),
                                       data_collator=None if patched else H.RecordingCollator("causal", H.pad_id_of(model)))

        def train():
            trainer.train()
            return trainer

        return _counted(train)


def moe(patched: bool, steps: int) -> SyncRun:
    """A tiny Mixtral (router loss, ``aux_loss: global``) under the plain Trainer."""
    import transformers

    samples = H.make_samples("causal", n=2 * GA * steps, seed=1)
    with _patched(patched, {"loss": {"aux_loss": "global"}}):
        model = H.build_moe("mixtral")
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="hgf_syncs_"), optim="adamw_torch", learning_rate=0.1,
            max_grad_norm=1.0, gradient_accumulation_steps=GA, per_device_train_batch_size=2, max_steps=steps,
            logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=3,
            remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=H.ListDataset(samples),
                                       data_collator=H.RecordingCollator("causal", H.pad_id_of(model)))

        def train():
            trainer.train()
            return trainer

        return _counted(train)


def rl(patched: bool, steps: int) -> SyncRun:
    """TRL's GRPOTrainer (tiny Qwen2, generation included: both runs generate the same way)."""
    import rl_runs

    holder = {}

    def train():
        holder["run"] = rl_runs.run_rl("grpo", mode="patch" if patched else "stock", ga=GA, steps=steps,
                                       per_device=4, num_generations=4, n_prompts=4 * GA * steps)
        return holder["run"].trainer

    return _counted(train)


PATHS: dict[str, Callable[[bool, int], SyncRun]] = {"plain": plain, "packing": packing, "moe": moe, "rl": rl}


@dataclass
class PathSyncs:
    path: str
    stock_per_window: float
    patched_per_window: float
    extra_per_window: float
    plugin_per_window: float  # syncs the innermost non-torch frame of which is hf_gradfix's
    plugin_sites: dict  # the longer patched run's hf_gradfix sites and counts
    runs: dict


def measure(path: str, short: int = 2, long: int = 4) -> PathSyncs:
    """Steady-state syncs per optimizer window of ``path``, stock and patched (see the module docstring)."""
    run = PATHS[path]
    runs = {(p, n): run(p, n) for p in (False, True) for n in (short, long)}
    for (p, n), r in runs.items():
        if r.windows != n:
            raise RuntimeError(f"host_sync_runs.{path}: the {'patched' if p else 'stock'} run trained {r.windows} "
                               f"windows, not {n}")

    def per_window(p: bool, owner: str | None = None) -> float:
        a, b = runs[(p, short)], runs[(p, long)]
        if owner is None:
            return (b.total - a.total) / (long - short)
        return (b.by_owner.get(owner, 0) - a.by_owner.get(owner, 0)) / (long - short)

    stock, patched = per_window(False), per_window(True)
    return PathSyncs(path, stock, patched, patched - stock, per_window(True, "hf_gradfix"),
                     runs[(True, long)].plugin_sites, {f"{'patched' if p else 'stock'}-{n}": r
                                                       for (p, n), r in runs.items()})


def per_micro_batch(value: float) -> float:
    return value / GA


__all__ = ["GA", "PATHS", "PathSyncs", "SyncRun", "measure", "per_micro_batch", "torch"]
