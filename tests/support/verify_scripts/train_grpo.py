"""A user's TRL GRPO script, as ``hf-gradfix verify -- python train_grpo.py ...`` sees it (tests/verify/test_verify.py).

Everything is built offline: a word-level tokenizer (``tokenizers``, the pattern of docs/rl.md), a tiny random-init
Qwen2 policy in fp32, a ``datasets.Dataset`` of prompts, a deterministic reward that prefers longer completions
(advantages of both signs in every group) and ``use_vllm=False``. Generation adds 3 to the EOS logit
(``generation_kwargs={"sequence_bias": ...}``, a generation-only logits processor), so completions end after 1 to
``max_completion_length`` tokens: micro-batches with very different token counts.

- ``--patch``: ``hf_gradfix.patch()`` before building the trainer; ``--trainer rloo``: TRL's ``RLOOTrainer``;
- ``--loss_type`` (default ``dapo``), ``--ga`` (2), ``--spg`` (``steps_per_generation``, default 2 x GA);
- ``--beta``: the KL term against a reference model (0: none); ``--entropy_coef``: TRL's entropy bonus;
- ``--lr``: AdamW's learning rate (default 1e-3: the second window of a generation batch trains at moved weights,
  its importance ratios differ from 1);
- ``--bf16``: leave unset for ``GRPOConfig``'s default (True: bf16 autocast), ``--bf16 0`` for fp32 (the tests).

Prints ``TRAINING FINISHED`` when ``trainer.train()`` returns (verify stops the script before that).
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

WORDS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"] + [f"w{i}" for i in range(60)]


def build_tokenizer():
    import tokenizers
    import transformers

    core = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]",
                                                eos_token="[EOS]", unk_token="[UNK]", padding_side="left")


def reward_length(completions, **kwargs):
    """Deterministic: longer completions score higher."""
    return [float(len(c.split())) for c in completions]


def main(argv=None) -> None:
    import datasets
    import transformers as T
    import trl

    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--patch", action="store_true")
    p.add_argument("--trainer", default="grpo", choices=["grpo", "rloo"])
    p.add_argument("--loss_type", default="dapo")
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--spg", type=int, default=None, help="steps_per_generation (default: 2 x GA)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--entropy_coef", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", type=int, default=None, help="leave unset for GRPOConfig's default (True)")
    a = p.parse_args(argv)
    if a.patch:
        import hf_gradfix

        hf_gradfix.patch()
    tok = build_tokenizer()
    torch.manual_seed(0)
    policy = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2))
    rng = random.Random(1)
    prompts = [" ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randint(2, 6))) for _ in range(16)]
    ds = datasets.Dataset.from_dict({"prompt": prompts})
    extra = {} if a.bf16 is None else {"bf16": bool(a.bf16)}
    if a.entropy_coef:
        extra["entropy_coef"] = a.entropy_coef
    if a.trainer == "grpo":
        extra["loss_type"] = a.loss_type
    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if a.trainer == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    cfg = config_cls(
        output_dir=a.output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        gradient_accumulation_steps=a.ga, steps_per_generation=a.spg or 2 * a.ga, max_steps=4, beta=a.beta,
        learning_rate=a.lr, use_vllm=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        generation_kwargs={"sequence_bias": {(tok.eos_token_id,): 3.0}}, **extra)
    model = policy
    if a.beta:  # TRL loads its reference model from the policy's path: save the random-init policy first
        model = f"{a.output_dir}/policy"
        policy.save_pretrained(model)
        tok.save_pretrained(model)
    trainer = trainer_cls(model=model, reward_funcs=reward_length, args=cfg, train_dataset=ds,
                              processing_class=tok)
    trainer.train()
    print("TRAINING FINISHED")


if __name__ == "__main__":
    main(sys.argv[1:])
