"""A user's training script, as ``hf-gradfix verify -- python train_user.py ...`` sees it (tests/verify/test_verify.py).

A tokenizer trained offline with ``tokenizers`` on examples/data/corpus.txt, a ``datasets.Dataset`` tokenized
with ``map``, transformers' own collators (they return ``BatchEncoding``) and a tiny random-init model of the
chosen head.  ``--bug`` plants one mistake users make; ``--fixed`` writes the same code correctly:

- ``seq_divide``: a Trainer subclass whose ``compute_loss`` divides the summed loss by the number of sequences;
- ``collator_shift``: a collator that shifts the labels itself (the model shifts them again);
- ``loss_func_mean``: a ``compute_loss_func`` that averages over the micro-batch;
- ``dataset_offset``: a dataset whose ``labels`` column is ``input_ids`` shifted by one;
- ``pad_labels``: a collator that pads the labels with the pad id instead of -100 (the loss trains on padding).

``--bf16``: the same run under the Trainer's bf16 autocast (measure_precision.py).

Prints ``TRAINING FINISHED`` when ``trainer.train()`` returns (verify stops the script before that).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "data" / "corpus.txt"


def build_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                                eos_token="[EOS]", mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]")


def sentences(n: int) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    out = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 3]
    return out[:n]


def build_model(head: str, arch: str, vocab: int, pad: int):
    import transformers as T

    torch.manual_seed(0)
    small = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, num_hidden_layers=2)
    if head == "causal" and arch == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_embd=32, n_head=2, n_layer=2, n_positions=64,
                                              pad_token_id=pad))
    if head in ("causal", "seqcls"):
        cfg = T.LlamaConfig(vocab_size=vocab, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=pad, **small)
        if head == "seqcls":
            cfg.num_labels = 3
            return T.LlamaForSequenceClassification(cfg)
        return T.LlamaForCausalLM(cfg)
    if head in ("mlm", "tokcls"):
        cfg = T.BertConfig(vocab_size=vocab, max_position_embeddings=128, pad_token_id=pad, **small)
        if head == "tokcls":
            cfg.num_labels = 5
            return T.BertForTokenClassification(cfg)
        return T.BertForMaskedLM(cfg)
    if head == "seq2seq":
        cfg = T.T5Config(vocab_size=vocab, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, pad_token_id=pad,
                         decoder_start_token_id=pad, eos_token_id=3)
        return T.T5ForConditionalGeneration(cfg)
    raise SystemExit(f"unknown --head {head}")


def main(argv=None) -> None:
    import datasets
    import transformers as T

    p = argparse.ArgumentParser()
    p.add_argument("--head", default="causal", choices=["causal", "mlm", "seqcls", "tokcls", "seq2seq"])
    p.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--bug", default="none", choices=["none", "seq_divide", "collator_shift", "loss_func_mean", "dataset_offset",
                                                        "pad_labels"])
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--fixed", action="store_true", help="the same code without the mistake")
    p.add_argument("--patch", action="store_true", help="hf_gradfix.patch() before building the trainer")
    p.add_argument("--packing", action="store_true", help="with --patch: hf_gradfix packing")
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16=True: the Trainer runs the forward under bf16 autocast")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--crash", default=None, help="'before': a ValueError before the trainer; N: a RuntimeError in step N")
    p.add_argument("--leave", default=None, choices=["os_exit_before", "catch_and_exit", "exit_in_step"],
                   help="os._exit(0) before the trainer; a bare except around train() then sys.exit(0); sys.exit(0) "
                        "from a callback in step 1")
    a = p.parse_args(argv)
    if a.crash == "before":
        raise ValueError("planted crash before the trainer")
    if a.leave == "os_exit_before":
        import os

        os._exit(0)

    if a.patch:
        import hf_gradfix

        hf_gradfix.patch({"packing": {"enabled": True}} if a.packing else None)
    tok = build_tokenizer()
    model = build_model(a.head, a.arch, len(tok), tok.pad_token_id)
    texts = sentences(48)
    ds = datasets.Dataset.from_dict({"text": texts})
    offset = a.bug == "dataset_offset" and not a.fixed

    def tokenize(batch):
        enc = tok(batch["text"], truncation=True, max_length=40)
        if a.head == "causal" and a.bug in ("dataset_offset", "pad_labels"):
            enc["labels"] = [ids[1:] + [-100] if offset else list(ids) for ids in enc["input_ids"]]
        elif a.head == "seqcls":
            enc["labels"] = [len(ids) % 3 for ids in enc["input_ids"]]
        elif a.head == "tokcls":
            enc["labels"] = [[-100 if i == 0 else t % 5 for i, t in enumerate(ids)] for ids in enc["input_ids"]]
        elif a.head == "seq2seq":
            enc["labels"] = [list(reversed(ids))[: 1 + len(ids) // 2] for ids in enc["input_ids"]]
        return enc

    ds = ds.map(tokenize, batched=True, remove_columns=["text"])

    if a.head == "causal" and a.bug in ("dataset_offset", "pad_labels"):
        pad_labels = a.bug == "pad_labels" and not a.fixed
        collator = T.DataCollatorForSeq2Seq(tok, label_pad_token_id=tok.pad_token_id if pad_labels else -100)
    elif a.head == "causal":
        collator = T.DataCollatorForLanguageModeling(tok, mlm=False)
        if a.bug == "collator_shift" and not a.fixed:
            base = collator

            def collator(features):  # "labels are the next tokens": shifted here, and again inside the model
                batch = base(features)
                batch["labels"] = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1)
                return batch
    elif a.head == "mlm":
        collator = T.DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3)
    elif a.head == "seqcls":
        collator = T.DataCollatorWithPadding(tok)
    elif a.head == "tokcls":
        collator = T.DataCollatorForTokenClassification(tok)
    else:
        collator = T.DataCollatorForSeq2Seq(tok, model=model)

    args = T.TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=a.bs, gradient_accumulation_steps=a.ga, max_steps=6,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0, label_smoothing_factor=a.label_smoothing, bf16=a.bf16,
    )

    trainer_cls = T.Trainer
    kwargs = {}
    if a.bug == "seq_divide":
        class SequenceMeanTrainer(T.Trainer):
            """The loss is summed over tokens, then divided by the number of sequences (or, fixed, by the count)."""

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                labels = inputs.pop("labels")
                outputs = model(**inputs)
                logits = outputs.logits[:, :-1].float()
                total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                        ignore_index=-100, reduction="sum")
                loss = total / num_items_in_batch if a.fixed else total / labels.shape[0]
                return (loss, outputs) if return_outputs else loss

        trainer_cls = SequenceMeanTrainer
    if a.bug == "loss_func_mean":
        def loss_func(outputs, labels, num_items_in_batch=None):
            logits = outputs.logits[:, :-1].float()
            flat = (logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            if a.fixed:
                return F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / num_items_in_batch
            return F.cross_entropy(*flat, ignore_index=-100)  # the mean over this micro-batch

        kwargs["compute_loss_func"] = loss_func
    callbacks = []
    if a.crash is not None:
        crash_step = int(a.crash)

        class Crash(T.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step + 1 == crash_step:
                    raise RuntimeError(f"planted crash in step {crash_step}")

        callbacks.append(Crash())
    if a.leave == "exit_in_step":
        class Leave(T.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                sys.exit(0)

        callbacks.append(Leave())
    trainer = trainer_cls(model=model, args=args, train_dataset=ds, data_collator=collator, processing_class=tok,
                          callbacks=callbacks, **kwargs)
    if a.leave == "catch_and_exit":
        try:
            trainer.train()
        except BaseException:  # noqa: BLE001 - what some scripts do: swallow everything, then leave quietly
            pass
        sys.exit(0)
    trainer.train()
    print("TRAINING FINISHED")


if __name__ == "__main__":
    main(sys.argv[1:])
