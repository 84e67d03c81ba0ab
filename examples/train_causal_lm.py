"""An ordinary fine-tuning script: a causal LM, a ``datasets`` pipeline, transformers' collator and ``Trainer``.

    python examples/train_causal_lm.py                          # trains 40 steps, saves to outputs/causal_lm
    python examples/train_causal_lm.py --loss tutorial          # with the compute_loss override from the docs
    python examples/train_causal_lm.py --hf-gradfix             # hf_gradfix.patch() first

Check it without changing a line (the script runs as usual, is stopped after the checked steps):

    hf-gradfix verify -- python examples/train_causal_lm.py --loss tutorial
    hf-gradfix verify --steps 3 --json -- python examples/train_causal_lm.py --loss tutorial --hf-gradfix

Runs offline on a CPU in seconds: the tokenizer is trained here with ``tokenizers`` on
``examples/data/corpus.txt`` and the model is a random-init Llama (``--model`` takes a local directory or hub id).
``--loss tutorial`` is the ``compute_loss`` override of the transformers docs and course
(``return outputs.loss``): with gradient accumulation each micro-batch's mean is summed, so the gradient is
about ``grad_accum`` times too large and micro-batches are weighted equally instead of by their tokens.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import datasets
import torch
import transformers

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class TutorialTrainer(transformers.Trainer):
    """The override from the docs: the model's own (micro-batch mean) loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(),
                            trainers.WordLevelTrainer(vocab_size=1000, special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                bos_token="[BOS]", eos_token="[EOS]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss", choices=["model", "tutorial"], default="model")
    p.add_argument("--hf-gradfix", action="store_true", help="hf_gradfix.patch() before building the trainer")
    p.add_argument("--model", default=None, help="a local directory or hub id (default: a tiny random-init Llama)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--out", default="outputs/causal_lm")
    a = p.parse_args()
    if a.hf_gradfix:
        import hf_gradfix

        hf_gradfix.patch()

    if a.model:
        tok = transformers.AutoTokenizer.from_pretrained(a.model)
        tok.pad_token = tok.pad_token or tok.eos_token
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    else:
        tok = build_tokenizer()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))

    text = CORPUS.read_text(encoding="utf-8")
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 3]
    ds = datasets.Dataset.from_dict({"text": sentences})
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=64), batched=True, remove_columns=["text"])

    args = transformers.TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
        max_steps=a.steps, learning_rate=1e-3, logging_steps=10, save_strategy="no", report_to="none", seed=0,
    )
    trainer_cls = TutorialTrainer if a.loss == "tutorial" else transformers.Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=ds, processing_class=tok,
                          data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    trainer.save_model(a.out)


if __name__ == "__main__":
    main()
