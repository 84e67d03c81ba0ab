"""A user's TRL SFT script with TRL's packing (``SFTConfig(packing=True)``: BFD rows with a ``seq_lengths`` column),
as ``hf-gradfix verify -- python train_sft_packing.py ...`` sees it (tests/packing/test_packing_already_packed.py).

fp32, a tokenizer trained offline (train_user.build_tokenizer), 40 sentences, a tiny random-init LFM2 (``--arch
lfm2``, a short convolution) or Llama; GA 2, rows of at most 64 tokens.

- ``--plugin``: ``hf_gradfix.patch()`` with ``packing.enabled`` (budget 64) on top of TRL's packing;
- ``--bug merged``: the plugin's collator reads no document boundaries in a sample (TRL's rows trained as one
  document each: what hf_gradfix did before issue 50).

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
    p.add_argument("--arch", default="lfm2", choices=["lfm2", "llama"])
    p.add_argument("--plugin", action="store_true")
    p.add_argument("--bug", default="none", choices=["none", "merged"])
    a = p.parse_args(argv)
    if a.bug == "merged":
        from hf_gradfix.packing import collator

        collator.document_lengths = lambda sample, n, where="sample": [n]
    if a.plugin:
        import hf_gradfix

        hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}})
    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=tok.pad_token_id, max_position_embeddings=256)
    torch.manual_seed(0)
    if a.arch == "lfm2":
        model = T.Lfm2ForCausalLM(T.Lfm2Config(**common, layer_types=["conv", "full_attention"]))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    ds = datasets.Dataset.from_dict({"text": sentences(40)})
    cfg = trl.SFTConfig(output_dir=a.output_dir, packing=True, max_length=64, per_device_train_batch_size=1,
                        gradient_accumulation_steps=2, max_steps=4, report_to="none", use_cpu=True, bf16=False)
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.train()
    print("TRAINING FINISHED")


if __name__ == "__main__":
    main(sys.argv[1:])
