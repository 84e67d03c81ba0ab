"""A user's training script for the sharded launches, as ``hf-gradfix launch --config_file CFG -m hf_gradfix verify --
train_sharded.py ...`` sees it (tests/verify/test_verify.py): a plain ``Trainer`` script with ``hf_gradfix.patch()`` and
``TrainingArguments(use_cpu=True)``, whatever the launch shards (``configs/cpu_ep.yaml``: expert parallelism,
``configs/cpu_pp.yaml``: pipeline stages, ``configs/cpu_nd.yaml``: FSDP2 x tp, ``configs/cpu_cp.yaml``,
``configs/accelerate/cpu_deepspeed.yaml``: ZeRO).

``--model moe``: a tiny random-init Qwen3-MoE (6 experts, top-2, router aux loss 0.5: what expert parallelism
shards); ``--model llama``: a tiny Llama (sdpa attention: what context parallelism needs). Samples of 3-40 tokens,
padded by transformers' own collator (DataCollatorForLanguageModeling with train_user.py's tokenizer built offline),
bs 2, GA 2; the samples sorted by length, so the ranks of a launch hold very different token counts.

``--bug ga_from_step N``: a Trainer subclass whose ``compute_loss`` multiplies the loss by the gradient-accumulation
steps from optimizer step ``N`` on (a normalization bug the run does not show in its logs); steps before ``N`` are
untouched (exact). Prints ``TRAINING FINISHED`` when ``trainer.train()`` returns (verify stops the script before).
"""

from __future__ import annotations

import argparse
import os

import torch
from train_user import build_tokenizer


def build_model(kind: str):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if kind == "moe":
        cfg = T.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, head_dim=16,
                               output_router_logits=True, router_aux_loss_coef=0.5)
        return T.Qwen3MoeForCausalLM(cfg)
    cfg = T.LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    return T.LlamaForCausalLM(cfg)


def samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + int(torch.randint(0, 38, (1,), generator=g))
        ids = torch.randint(3, 97, (length,), generator=g).tolist()
        out.append({"input_ids": ids})
    return sorted(out, key=lambda s: len(s["input_ids"]))  # in order: each rank's shard is very different


def main(argv=None) -> None:
    import transformers as T

    import hf_gradfix

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moe", choices=["moe", "llama"])
    p.add_argument("--bug", default="none", choices=["none", "ga_from_step"])
    p.add_argument("--bug-step", type=int, default=2, help="with --bug ga_from_step: the first optimizer step it acts on")
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--output_dir", required=True)
    a = p.parse_args(argv)

    if os.environ.get("DS_ACCELERATOR") == "cpu":  # configs/accelerate/cpu_deepspeed.yaml (hf-gradfix launch sets it)
        # No shared-memory all-reduce op: DeepSpeed's own fallback when it cannot build one (its collectives go through
        # gloo), as tests/support/deepspeed_worker.py does; saves its first-run g++ build (45 s - 5 min)
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {}
    hf_gradfix.patch()
    model = build_model(a.model)
    args = T.TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=a.ga, max_steps=4,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )

    class Trainer(T.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if a.bug == "ga_from_step" and self.state.global_step + 1 >= a.bug_step:
                if return_outputs:
                    return out[0] * self.args.gradient_accumulation_steps, out[1]
                return out * self.args.gradient_accumulation_steps
            return out

    tok = build_tokenizer()  # train_user.py's: a word-level tokenizer trained offline; pad id 0
    trainer_cls = Trainer if a.bug != "none" else T.Trainer  # pipeline parallelism refuses a compute_loss override
    trainer = trainer_cls(model=model, args=args, train_dataset=samples(32),
                      data_collator=T.DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    print("TRAINING FINISHED")


if __name__ == "__main__":
    main()
