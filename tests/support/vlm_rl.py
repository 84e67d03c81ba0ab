"""A TRL ``GRPOTrainer`` run with a tiny vision-language policy (tests/support/vlm.py's Qwen2.5-VL or LLaVA and its
real processor), offline: prompts with 1-3 images of different sizes (TRL 1.16 hands a text-only sample of a vision dataset to the processor as None), a deterministic reward, SGD at lr 0 (the
weights never move), the gradient of every optimizer step recorded. For ``tests/rl/test_rl_multimodal.py``."""

from __future__ import annotations

import logging
import tempfile

import torch

import vlm as V


def reward_length(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def run_vlm_grpo(family: str = "qwen2_5_vl", *, patch_config: dict | None = None, steps: int = 1, n_prompts: int = 4):
    """One GRPO run; returns (trainer, [grads per optimizer step], warnings)."""
    import datasets
    import trl

    import hf_gradfix

    processor = V.build_processor(family)
    processor.tokenizer.padding_side = "left"
    model = V.build_vlm(family, seed=0)
    samples = V.make_samples(family, n=n_prompts, seed=3, kind="prompt_completion", counts=(1, 2, 1, 3))
    ds = datasets.Dataset.from_list([{"prompt": s["prompt"], "images": s["images"]} for s in samples])
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="hgf_vlm_rl_"), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, gradient_accumulation_steps=1, max_steps=steps, report_to=[], use_cpu=True,
        save_strategy="no", bf16=False, logging_steps=1, learning_rate=0.0, optim="sgd", max_grad_norm=0.0,
        lr_scheduler_type="constant", beta=0.0, disable_tqdm=True, seed=0, data_seed=0, loss_type="dapo",
        gradient_checkpointing=False)
    grads, warnings = [], []

    import transformers

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, a, s, c, **k):
            grads.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                          for n, p in trainer.model.named_parameters() if p.requires_grad})

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logger, handler = logging.getLogger("hf_gradfix"), Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        hf_gradfix.patch({"log_fixes": False, **(patch_config or {})})
        try:
            trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=ds,
                                      processing_class=processor, callbacks=[Grads()])
        finally:
            hf_gradfix.unpatch()
        trainer.train()
    finally:
        logger.removeHandler(handler)
    return trainer, grads, warnings
