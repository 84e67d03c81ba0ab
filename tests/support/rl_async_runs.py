"""Offline runs of TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer`` for ``tests/rl/test_rl_async.py``, and its
2-process gloo worker.

AsyncGRPO normally trains on rollouts a vLLM server generates; its constructor takes the two seams that make it run
without one: ``rollout_worker=`` (:class:`FixedRollouts`, an in-process queue of scored samples built here
deterministically) and ``weight_transfer=`` (:class:`NoWeightTransfer`). Three more things a CPU runner lacks are
replaced for the run only: the tree-attention kernel (TRL fetches FlashAttention 3 from the hub: here
:func:`cpu_varlen_attention`, the same causal varlen contract in plain torch), the peak-FLOPs lookup (CUDA only) and
the model id (a tiny random-init Qwen2 saved to a temporary directory). SGD at lr 0: every window is compared at the
initial weights.

Each sample is one prompt (shared by its group, so TRL's trie packs it once) and a completion whose length is drawn
from a wide spread; the groups alternate between short and long completions, so a window's micro-batches hold very
different token counts (what makes a mean of micro-batch means differ from the window's token mean).

Worker::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/rl_async_runs.py --out DIR --cases ga2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import os
import queue
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402

QWEN2 = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FIRST_CONTENT_ID = 20  # ids of ordinary words in the offline tokenizer's vocabulary (ecosystem.build_tokenizer)


# ----------------------------------------------------------------------------------------------------------------------
# What a CPU runner lacks
# ----------------------------------------------------------------------------------------------------------------------


class _CpuFlashAttention:
    """Stands in for the FlashAttention 3 kernel TRL's tree attention fetches from the hub."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), softcap=None, **_):
        return cpu_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


def cpu_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=True):
    """FlashAttention's varlen contract in plain torch: segment ``s`` of ``q`` (rows ``cu_q[s]:cu_q[s+1]``, heads
    ``(N, H, D)``) attends to rows ``cu_k[s]:cu_k[s+1]`` of ``k`` / ``v`` (grouped-query heads repeated), causal
    aligned at the bottom right (a query row sees the keys up to its own position at the end of its key path)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = []
    for s in range(len(cu_seqlens_q) - 1):
        qs = q[int(cu_seqlens_q[s]) : int(cu_seqlens_q[s + 1])].transpose(0, 1)  # (H, Lq, D)
        ks = k[int(cu_seqlens_k[s]) : int(cu_seqlens_k[s + 1])].transpose(0, 1)
        vs = v[int(cu_seqlens_k[s]) : int(cu_seqlens_k[s + 1])].transpose(0, 1)
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            allowed = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out, dim=0)


@contextlib.contextmanager
def offline_async_grpo():
    """AsyncGRPO's hub kernel and CUDA-only FLOPs lookup replaced for the duration (module attributes, restored)."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    saved = (packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device)
    packing._flash_attn = lambda: _CpuFlashAttention
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        yield
    finally:
        packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device = saved


class NoWeightTransfer:
    """WeightTransferProtocol that sends nothing (no inference server; the rollouts below do not depend on weights)."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


class FixedRollouts:
    """RolloutWorkerProtocol over a fixed, already scored list of ``RolloutSample`` (an in-process ``queue.Queue``).
    Samples are stamped with the live policy version as they are taken, so none is ever dropped as stale."""

    def __init__(self, samples):
        self.version = 0
        worker = self

        class _Stamped(queue.Queue):
            def get(self, *args, **kwargs):
                sample = super().get(*args, **kwargs)
                sample.model_version = worker.version
                return sample

        self.rollout_buffer = _Stamped()
        for sample in samples:
            self.rollout_buffer.put_nowait(sample)
        self.metrics_queue = queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        self.version = model_version

    def check_health(self, stale_after_s):
        if self.rollout_buffer.qsize() == 0:
            raise RuntimeError("FixedRollouts: out of samples (the test asked for more steps than it built)")


def build_samples(n_groups: int, num_generations: int, *, seed: int = 0, short=(1, 4), long=(12, 24)):
    """Scored rollout samples, group by group: a shared prompt of 2-5 words; completions short in even groups, long in
    odd ones (each length drawn from its range); the old log-probabilities a generator would report (about
    ``-ln 97`` with noise, so some ratios leave the clip range); group-normalized rewards (longer is better)."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(FIRST_CONTENT_ID, QWEN2["vocab_size"]) for _ in range(rng.randint(2, 5))]
        lo, hi = short if g % 2 == 0 else long
        lengths = [rng.randint(lo, hi) for _ in range(num_generations)]
        rewards = np.array(lengths, dtype=np.float64) + np.array([rng.random() for _ in lengths])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        for length, advantage in zip(lengths, advantages):
            completion = [rng.randrange(FIRST_CONTENT_ID, QWEN2["vocab_size"]) for _ in range(length)]
            ids = np.array(prompt + completion, dtype=np.int64)
            mask = np.array([0] * len(prompt) + [1] * length, dtype=np.int64)
            old = np.array([-math.log(QWEN2["vocab_size"]) + rng.gauss(0.0, 0.15) for _ in ids], dtype=np.float32)
            samples.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask,
                                         old_log_probs=old * mask, advantage=float(advantage), model_version=0,
                                         group_id=g, metrics={}))
    return samples


# ----------------------------------------------------------------------------------------------------------------------
# A recorded run
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class AsyncRun:
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per optimizer step, after accumulation
    # per micro-batch (main process): one list of samples per rank row, as the collator packed them
    rows: list[list[list[dict]]] = field(default_factory=list)
    # per micro-batch (this rank): the packed tensors compute_loss was given
    inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    logged: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    infos: list[str] = field(default_factory=list)
    initial: Any = None  # the policy at its initial weights, an ordinary model (eager attention, logits)
    epsilon: tuple[float, float] = (0.2, 0.2)
    temperature: float = 1.0
    ga: int = 1


class _Keep(logging.Handler):
    def __init__(self, run):
        super().__init__(logging.INFO)
        self.run = run

    def emit(self, record):
        (self.run.warnings if record.levelno >= logging.WARNING else self.run.infos).append(record.getMessage())


def run_async(*, mode: str = "patch", ga: int = 2, steps: int = 2, per_device: int = 4, num_generations: int = 4,
              token_budget: int = 0, seed: int = 0, patch_config: dict | None = None,
              trainer_cls=None, moe: bool = False) -> AsyncRun:
    """Train AsyncGRPO ``steps`` optimizer steps, stock (``mode="stock"``), under ``hf_gradfix.patch()``
    (``"patch"``) or with ``GradFixCallback`` (``"callback"``), and record it. ``moe``: a tiny Qwen3-MoE policy with
    its router aux loss (coefficient 0.01)."""
    import datasets
    import safetensors.torch
    import transformers
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

    import ecosystem as E
    import hf_gradfix

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = AsyncRun(ga=ga)
    model_dir = tempfile.mkdtemp(prefix="hgf_async_model_")
    torch.manual_seed(0)
    if moe:
        # Qwen3-MoE: TRL 1.16's FLOPs count reads num_local_experts, which Qwen2-MoE's config lacks
        policy_cls = transformers.Qwen3MoeForCausalLM
        policy = policy_cls(transformers.Qwen3MoeConfig(**QWEN2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, output_router_logits=True,
                                                         router_aux_loss_coef=0.01))
    else:
        policy_cls = transformers.Qwen2ForCausalLM
        policy = policy_cls(transformers.Qwen2Config(**QWEN2))
    # written by hand: save_pretrained writes on rank 0 only once a process group exists (a second case of the worker)
    policy.config.architectures = [type(policy).__name__]
    policy.config.save_pretrained(model_dir)
    safetensors.torch.save_file({k: v.contiguous() for k, v in policy.state_dict().items()},
                                os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    samples_needed = per_device * world * ga * (steps + 2)  # + what the loader prefetches past the last step
    samples = build_samples(math.ceil(samples_needed / num_generations) + 1, num_generations, seed=seed)
    args = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="hgf_async_"), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ga, max_steps=steps, num_generations=num_generations, token_budget=token_budget,
        max_staleness=10**6, learning_rate=0.0, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant",
        use_cpu=True, bf16=False, dtype="float32", report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, weight_sync_steps=1,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["w"] * 8})

    original_collate = async_grpo_trainer.DataCollatorForRollout.torch_call

    def recording_collate(self, examples):
        (rows,) = examples
        run.rows.append([[{k: copy.deepcopy(s[k]) for k in ("input_ids", "completion_mask", "old_log_probs",
                                                              "advantage", "group_id")} for s in row.samples]
                         for row in rows])
        return original_collate(self, examples)

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **k):
            run.grads.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                              for n, p in trainer.model.named_parameters() if p.requires_grad})

    logger = logging.getLogger("hf_gradfix")
    handler = _Keep(run)
    logger.addHandler(handler)
    callbacks = [Grads()]
    if mode == "callback":
        callbacks.append(hf_gradfix.GradFixCallback({"log_fixes": True, **(patch_config or {})}))
    async_grpo_trainer.DataCollatorForRollout.torch_call = recording_collate
    try:
        with offline_async_grpo():
            if mode == "patch":
                hf_gradfix.patch({"log_fixes": True, **(patch_config or {})})
            try:
                trainer = (trainer_cls or AsyncGRPOTrainer)(model=model_dir, args=args, train_dataset=prompts,
                                           processing_class=E.build_tokenizer("left"), callbacks=callbacks,
                                           rollout_worker=FixedRollouts(samples), weight_transfer=NoWeightTransfer())
            finally:
                if mode == "patch":
                    hf_gradfix.unpatch()
            # the weights the trainer loaded (lr 0: they never move), as a plain model: eager attention, no fused head
            run.initial = policy_cls.from_pretrained(model_dir, attn_implementation="eager")
            run.epsilon = (trainer.epsilon_low, trainer.epsilon_high)
            run.temperature = float(trainer.temperature)
            original_compute = trainer.compute_loss

            def recording_compute(model_arg, inputs, *a, **k):
                if model_arg.training:
                    run.inputs.append({key: v.detach().clone() for key, v in inputs.items() if torch.is_tensor(v)})
                return original_compute(model_arg, inputs, *a, **k)

            trainer.compute_loss = recording_compute
            trainer.train()
    finally:
        async_grpo_trainer.DataCollatorForRollout.torch_call = original_collate
        logger.removeHandler(handler)
    run.logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return run


# ----------------------------------------------------------------------------------------------------------------------
# 2-process worker
# ----------------------------------------------------------------------------------------------------------------------

CASES = {
    "ga2": dict(ga=2, per_device=2),
    "ga2_stock": dict(ga=2, per_device=2, mode="stock"),
}


def main() -> None:
    import multiproc
    import hf_gradfix

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    ns = parser.parse_args()
    out, rank = Path(ns.out), int(os.environ["RANK"])

    def run_one(name: str) -> None:
        run = run_async(**CASES[name])
        torch.save({"grads": run.grads, "rows": run.rows, "inputs": run.inputs, "logged": run.logged,
                    "warnings": run.warnings, "initial": run.initial, "epsilon": run.epsilon,
                    "temperature": run.temperature, "ga": run.ga}, out / name / f"rank{rank}.pt")

    multiproc.run_cases(ns.cases.split(","), out, rank, run_one, cleanup=lambda name: hf_gradfix.unpatch())


if __name__ == "__main__":
    main()
