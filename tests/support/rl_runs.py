"""Runs of TRL's policy-gradient trainers for the RL tests (``tests/rl/test_rl.py``, ``tests/support/rl_worker.py``): a tiny Qwen2
policy built offline, the offline word-level tokenizer, a deterministic reward, ``use_vllm=False``, SGD at lr 0 (the
weights never move: every window is compared at the initial weights), and a record of what the trainer trained on.

Completion lengths differ a lot within and across micro-batches (and ranks): generation adds a bias of 3 to the EOS
logit (``generation_kwargs={"sequence_bias": ...}``, a generation-only logits processor; the training forward is the
model's own), so completions end after 1 to ``max_completion_length`` tokens.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

import ecosystem as E
import rl_reference as R

QWEN2 = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def reward_length(completions, **kwargs):
    """Deterministic: longer completions score higher (advantages of both signs within every group)."""
    return [float(len(c.split())) for c in completions]


@dataclass
class RLRun:
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per optimizer step, after accumulation
    micro_batches: list[dict[str, Any]] = field(default_factory=list)  # what the loss function was given, in order
    logged: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    initial: Any = None  # the model at its initial weights
    trainer: Any = None
    ga: int = 1


class _Keep(logging.Handler):
    def __init__(self, into):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record):
        self.into.append(record.getMessage())


def run_rl(kind: str = "grpo", *, mode: str = "patch", loss_type: str = "dapo", ga: int = 2, spg: int | None = None,
           steps: int = 2, per_device: int = 4, num_generations: int = 4, max_completion_length: int = 10,
           n_prompts: int = 16, extra: dict | None = None, prompt_seed: int = 1, output_dir: str | None = None,
           resume_from: str | None = None, patch_config: dict | None = None, model=None) -> RLRun:
    """Train ``kind`` ("grpo" / "rloo") stock or under ``hf_gradfix.patch()`` and record it."""
    import datasets
    import transformers
    import trl

    import hf_gradfix

    tok = E.build_tokenizer("left")
    if model is None:
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2))
    run = RLRun(initial=copy.deepcopy(model), ga=ga)
    ds = datasets.Dataset.from_dict({"prompt": E.sentences(n_prompts, seed=prompt_seed, lo=2, hi=6)})
    common = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="hgf_rl_"), per_device_train_batch_size=per_device,
        num_generations=num_generations, max_completion_length=max_completion_length, gradient_accumulation_steps=ga,
        max_steps=steps, report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1,
        learning_rate=0.0, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant", beta=0.0,
        generation_kwargs={"sequence_bias": {(QWEN2["eos_token_id"],): 3.0}}, disable_tqdm=True, seed=0, data_seed=0,
    )
    if spg is not None:
        common["steps_per_generation"] = spg
    if kind == "grpo":
        common["loss_type"] = loss_type
        config_cls, trainer_cls = trl.GRPOConfig, trl.GRPOTrainer
    else:
        config_cls, trainer_cls = trl.RLOOConfig, trl.RLOOTrainer
    common.update(extra or {})
    args = config_cls(**common)

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **k):
            run.grads.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                              for n, p in trainer.model.named_parameters() if p.requires_grad})

    logger = logging.getLogger("hf_gradfix")
    handler = _Keep(run.warnings)
    logger.addHandler(handler)
    try:
        if mode == "patch":
            hf_gradfix.patch({"log_fixes": False, **(patch_config or {})})
        try:
            trainer = trainer_cls(model=model, reward_funcs=reward_length, args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[Grads()])
        finally:
            hf_gradfix.unpatch()
        original = trainer._compute_loss

        def recording(model_arg, inputs):
            if model_arg.training:
                run.micro_batches.append({k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                          for k, v in inputs.items()})
            return original(model_arg, inputs)

        trainer._compute_loss = recording
        trainer.train(resume_from_checkpoint=resume_from)
    finally:
        logger.removeHandler(handler)
    run.trainer = trainer
    # after a resume, the log history starts with the checkpoint's entries: keep this run's own steps
    first_step = int(str(resume_from).rstrip("/").rsplit("-", 1)[-1]) if resume_from else 0
    run.logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h and h.get("step", 0) > first_step]
    run.config = R.trl_config(trainer)
    return run


def windows(run: RLRun, ranks: list[RLRun] | None = None) -> list[list[dict]]:
    """The micro-batches of each optimizer window, of every rank (``ranks``: every rank's run, rank order)."""
    runs = ranks or [run]
    out = []
    for k in range(len(run.grads)):
        out.append([mb for r in runs for mb in r.micro_batches[k * r.ga : (k + 1) * r.ga]])
    return out
