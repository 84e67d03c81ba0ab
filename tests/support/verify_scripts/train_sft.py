"""A user's TRL SFT script, as ``hf-gradfix verify -- python train_sft.py ...`` sees it (tests/verify/test_verify.py).

``SFTConfig`` keeps TRL's defaults (``bf16=True``: the Trainer runs the model under bf16 autocast; gradient
checkpointing on); only the sizes are small, and ``use_cpu=True`` (transformers refuses bf16 on a machine
without a GPU otherwise).  A tokenizer trained offline (train_user.build_tokenizer), a
``datasets.Dataset`` of text and a tiny random-init Llama in fp32.

- ``--patch``: ``hf_gradfix.patch()`` before building the trainer;
- ``--bug mean``: a ``compute_loss`` override returning the model's per-micro-batch mean (the docs' override): with
  GA 4 the means are summed over the window;
- ``--bf16 0``: the same script in fp32.

Prints ``TRAINING FINISHED`` when ``trainer.train()`` returns (verify stops the script before that).
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> None:
    import datasets
    import transformers as T
    import trl

    from train_user import build_tokenizer, sentences

    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--patch", action="store_true")
    p.add_argument("--bug", default="none", choices=["none", "mean"])
    p.add_argument("--bf16", type=int, default=None, help="leave unset for SFTConfig's default (True)")
    p.add_argument("--ga", type=int, default=4)
    a = p.parse_args(argv)
    if a.patch:
        import hf_gradfix

        hf_gradfix.patch()
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                             pad_token_id=tok.pad_token_id))
    ds = datasets.Dataset.from_dict({"text": sentences(48)})
    extra = {} if a.bf16 is None else {"bf16": bool(a.bf16)}
    cfg = trl.SFTConfig(output_dir=a.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=a.ga, max_steps=4,
                        max_length=40, report_to="none", use_cpu=True, **extra)
    trainer_cls = trl.SFTTrainer
    if a.bug == "mean":
        class MeanTrainer(trl.SFTTrainer):
            """The override from the transformers docs: the model's loss, a mean over this micro-batch."""

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                outputs = model(**inputs)
                return (outputs.loss, outputs) if return_outputs else outputs.loss

        trainer_cls = MeanTrainer
    trainer = trainer_cls(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.train()
    print("TRAINING FINISHED")


if __name__ == "__main__":
    main(sys.argv[1:])
