"""Conformance on the ecosystem's own paths: real tokenizers (built offline), every transformers data collator that
produces training labels, the default-collator path, TRL's ``SFTTrainer`` in its common configurations, and
``datasets`` objects (map-style, ``set_format("torch")``, streaming), through ``patch()`` and ``GradFixCallback``.

Every case records the batches the Trainer actually drew (``BatchEncoding`` from transformers' collators) and compares
each optimizer step's accumulated gradient and logged loss with an independent ground truth computed on exactly those
batches (``tests/support/ecosystem.py``). The same case also runs stock: the plugin must be exact (gradient <= 1e-5 relative)
and never worse than stock. ``STOCK_WRONG`` pins which cases stock transformers gets wrong, so a change on either side
is noticed.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import ecosystem as E
import harness as H

GRAD_TOL = 1e-5
MAJOR = int(transformers.__version__.split(".")[0])
LOSS_TOL = 1e-6 if MAJOR >= 5 else 1e-4  # transformers 4.x rounds logged losses to 4 decimals
N_SAMPLES = 8  # batch 2 x GA 2 -> 2 optimizer steps


def _model(arch):
    try:
        return H.build_model(arch, seed=0)
    except RuntimeError as err:
        pytest.skip(str(err))


def _tokenized(tok, texts, **map_kw):
    import datasets

    ds = datasets.Dataset.from_dict({"text": texts})
    return ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"], **map_kw)


# ----------------------------------------------------------------------------------------------------------------------
# transformers' collators (each builder returns (make_trainer, task))
# ----------------------------------------------------------------------------------------------------------------------


def causal_lm(padding_side="right", arch="llama", fmt=None, iterable=False):
    def build():
        from transformers import DataCollatorForLanguageModeling, Trainer

        tok = E.build_tokenizer(padding_side)
        ds = _tokenized(tok, E.sentences(N_SAMPLES, seed=1))
        eval_ds = _tokenized(tok, E.sentences(7, seed=2))
        if fmt == "torch":
            # rows of different lengths: set_format gives 1-D tensors per row, which the collator pads
            ds.set_format("torch")
            eval_ds.set_format("torch")
        extra = {}
        if iterable:
            ds, eval_ds = ds.to_iterable_dataset(), eval_ds.to_iterable_dataset()
            extra = dict(max_steps=N_SAMPLES // 4)

        def make(out):
            return Trainer(
                model=_model(arch),
                args=E.training_args(out, **extra),
                train_dataset=ds,
                eval_dataset=eval_ds,
                data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                processing_class=tok,
            )

        return make, "causal"

    return build


def masked_lm(arch="bert_mlm"):
    def build():
        from transformers import DataCollatorForLanguageModeling, Trainer

        tok = E.build_tokenizer(style="bert")
        ds = _tokenized(tok, E.sentences(N_SAMPLES, seed=3))
        eval_ds = _tokenized(tok, E.sentences(7, seed=4))

        def make(out):
            torch.manual_seed(0)  # the collator draws the masks from the global generator
            return Trainer(
                model=_model(arch),
                args=E.training_args(out),
                train_dataset=ds,
                eval_dataset=eval_ds,
                data_collator=DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3),
                processing_class=tok,
            )

        return make, "mlm"

    return build


def default_collator_seqcls():
    """Tokenizer given as processing_class, no data_collator: the Trainer builds DataCollatorWithPadding."""

    def build():
        import datasets
        from transformers import Trainer

        tok = E.build_tokenizer(style="bert")
        texts = E.sentences(N_SAMPLES, seed=5)
        ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 3 for i in range(len(texts))]})
        ds = ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        eval_texts = E.sentences(7, seed=6)
        eval_ds = datasets.Dataset.from_dict({"text": eval_texts, "label": [i % 3 for i in range(7)]})
        eval_ds = eval_ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])

        def make(out):
            return Trainer(model=_model("bert_seqcls"), args=E.training_args(out), train_dataset=ds,
                           eval_dataset=eval_ds, processing_class=tok)

        return make, "seqcls"

    return build


def token_classification():
    def build():
        import datasets
        from transformers import DataCollatorForTokenClassification, Trainer

        tok = E.build_tokenizer(style="bert")

        def with_tags(batch):
            enc = tok(batch["text"])
            # a tag per word, -100 on the special tokens ([CLS], [SEP]) as the token-classification recipe does
            enc["labels"] = [[-100] + [(len(w) + i) % 5 for i, w in enumerate(t.split())] + [-100] for t in batch["text"]]
            return enc

        ds = datasets.Dataset.from_dict({"text": E.sentences(N_SAMPLES, seed=7)}).map(
            with_tags, batched=True, remove_columns=["text"])
        eval_ds = datasets.Dataset.from_dict({"text": E.sentences(7, seed=8)}).map(
            with_tags, batched=True, remove_columns=["text"])

        def make(out):
            return Trainer(model=_model("bert_tokcls"), args=E.training_args(out), train_dataset=ds,
                           eval_dataset=eval_ds, data_collator=DataCollatorForTokenClassification(tok),
                           processing_class=tok)

        return make, "tokcls"

    return build


def seq2seq(arch="t5", collator_gets_model=True):
    def build():
        import datasets
        from transformers import DataCollatorForSeq2Seq, Trainer

        tok = E.build_tokenizer()

        def encode(batch):
            enc = tok(batch["src"])
            enc["labels"] = tok(batch["tgt"])["input_ids"]
            return enc

        def data(n, seed):
            return datasets.Dataset.from_dict(
                {"src": E.sentences(n, seed=seed), "tgt": E.sentences(n, seed=seed + 50, lo=1, hi=12)}
            ).map(encode, batched=True, remove_columns=["src", "tgt"])

        ds, eval_ds = data(N_SAMPLES, 9), data(7, 10)

        def make(out):
            model = _model(arch)
            coll = DataCollatorForSeq2Seq(tok, model=model if collator_gets_model else None)
            return Trainer(model=model, args=E.training_args(out), train_dataset=ds, eval_dataset=eval_ds,
                           data_collator=coll, processing_class=tok)

        return make, "seq2seq"

    return build


def flattening():
    """transformers' padding-free collator: one row of concatenated sequences with restarted position_ids."""

    def build():
        from transformers import DataCollatorWithFlattening, Trainer

        tok = E.build_tokenizer()
        ds = _tokenized(tok, E.sentences(N_SAMPLES, seed=11))
        ds = ds.map(lambda r: {"labels": r["input_ids"]})

        def make(out):
            return Trainer(model=_model("llama"), args=E.training_args(out), train_dataset=ds,
                           data_collator=DataCollatorWithFlattening(), processing_class=tok)

        return make, "causal"

    return build


def default_data_collator_padded():
    """Features padded to max_length by the tokenizer, labels -100 on padding: transformers' default_data_collator."""

    def build():
        from transformers import Trainer, default_data_collator

        tok = E.build_tokenizer()

        def encode(batch):
            enc = tok(batch["text"], padding="max_length", max_length=32)
            enc["labels"] = [[t if m else -100 for t, m in zip(ids, mask)]
                             for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
            return enc

        import datasets

        ds = datasets.Dataset.from_dict({"text": E.sentences(N_SAMPLES, seed=12)}).map(
            encode, batched=True, remove_columns=["text"])

        def make(out):
            return Trainer(model=_model("llama"), args=E.training_args(out), train_dataset=ds,
                           data_collator=default_data_collator, processing_class=tok)

        return make, "causal"

    return build


# ----------------------------------------------------------------------------------------------------------------------
# TRL's SFTTrainer
# ----------------------------------------------------------------------------------------------------------------------


def sft(kind="text", **config):
    def build():
        import datasets

        trl = pytest.importorskip("trl")
        tok = E.build_tokenizer()
        texts = E.sentences(N_SAMPLES, seed=13)
        eval_ds = None
        if kind == "text":
            ds = datasets.Dataset.from_dict({"text": texts})
            eval_ds = datasets.Dataset.from_dict({"text": E.sentences(7, seed=17)})
        elif kind == "prompt_completion":
            comps = E.sentences(N_SAMPLES, seed=14, lo=1, hi=10)
            ds = datasets.Dataset.from_dict({"prompt": texts, "completion": [" " + c for c in comps]})
        elif kind == "messages":
            comps = E.sentences(N_SAMPLES, seed=15, lo=1, hi=10)
            ds = datasets.Dataset.from_dict({"messages": [
                [{"role": "user", "content": t}, {"role": "assistant", "content": c}] for t, c in zip(texts, comps)
            ]})
        else:
            raise ValueError(kind)
        args_kw = dict(max_length=None, dataset_num_proc=None, bf16=False)  # SFTConfig defaults to bf16 autocast
        args_kw.update(config)

        def make(out):
            return trl.SFTTrainer(
                model=_model("llama"),
                args=E.training_args(out, args_cls=trl.SFTConfig, **args_kw),
                train_dataset=ds,
                eval_dataset=eval_ds,
                processing_class=tok,
            )

        return make, "causal"

    return build


# ----------------------------------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------------------------------

CASES = {
    "clm_right_padding": causal_lm("right"),
    "clm_left_padding": causal_lm("left"),
    "clm_gpt2": causal_lm("right", arch="gpt2"),
    "clm_datasets_torch_format": causal_lm("right", fmt="torch"),
    "clm_iterable_dataset": causal_lm("right", iterable=True),
    "mlm_bert": masked_lm("bert_mlm"),
    "mlm_roberta": masked_lm("roberta_mlm"),
    "seqcls_default_collator": default_collator_seqcls(),
    "tokcls": token_classification(),
    "seq2seq_t5": seq2seq("t5"),
    "seq2seq_bart_model_shifts": seq2seq("bart", collator_gets_model=False),
    "flattening": flattening(),
    "default_data_collator": default_data_collator_padded(),
    "trl_sft_text": sft("text"),
    "trl_sft_padding_free": sft("text", padding_free=True),
    "trl_sft_completion_only": sft("prompt_completion", completion_only_loss=True),
    "trl_sft_assistant_only": sft("messages", assistant_only_loss=True),
    "trl_sft_packing": sft("text", packing=True, max_length=48),
}
#: cases with an eval set: eval_loss is checked against the exact token mean over the whole eval set
WITH_EVAL = {"clm_right_padding", "clm_left_padding", "clm_iterable_dataset", "mlm_bert", "seqcls_default_collator",
             "tokcls", "seq2seq_t5", "trl_sft_text"}


def _check(result, what):
    assert result.steps >= 1, f"{what}: no optimizer step recorded"
    for k, err in enumerate(result.grad_errors):
        assert err <= GRAD_TOL, f"{what} step {k}: gradient rel err {err:.3e} > {GRAD_TOL:g}"
    assert len(result.loss_errors) == result.steps, f"{what}: logged losses {result.loss_errors}"
    for k, err in enumerate(result.loss_errors):
        assert err <= LOSS_TOL, f"{what} step {k}: logged loss rel err {err:.3e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_ecosystem_case_exact_and_never_worse_than_stock(name):
    if name.startswith("trl") and MAJOR < 5:
        pytest.skip("TRL 1.x requires transformers 5")
    make, task = CASES[name]()
    evaluate = name in WITH_EVAL
    stock = E.run_case(make, task, mode="stock", evaluate=evaluate)
    patched = E.run_case(make, task, mode="patch", evaluate=evaluate)
    print(f"{name}: batches {sorted(patched.batch_types)}; stock grad err {stock.worst:.2e}, "
          f"hf_gradfix {patched.worst:.2e}; eval err stock {stock.eval_error} hf_gradfix {patched.eval_error}")
    _check(patched, f"{name} (patch)")
    # never worse than stock, step by step (both are exact to rounding where stock is right)
    for k, (ours, theirs) in enumerate(zip(patched.grad_errors, stock.grad_errors)):
        assert ours <= max(theirs, GRAD_TOL), f"{name} step {k}: hf_gradfix {ours:.2e} worse than stock {theirs:.2e}"
    if evaluate:
        assert patched.eval_error <= 1e-6, f"{name}: eval_loss rel err {patched.eval_error:.3e}"
        # every other eval metric (e.g. TRL's entropy and token accuracy) is exactly stock's: the probe leaves no trace
        others = {k: v for k, v in stock.eval_metrics.items() if k != "eval_loss" and "runtime" not in k and "per_second" not in k}
        assert others and {k: patched.eval_metrics.get(k) for k in others} == others


@pytest.mark.parametrize("name", ["clm_right_padding", "mlm_bert", "seq2seq_t5", "trl_sft_completion_only"])
def test_ecosystem_case_through_callback(name):
    if name.startswith("trl") and MAJOR < 5:
        pytest.skip("TRL 1.x requires transformers 5")
    make, task = CASES[name]()
    _check(E.run_case(make, task, mode="callback"), f"{name} (GradFixCallback)")


def test_collators_return_batch_encoding():
    """The reason this file exists: transformers' collators hand the Trainer a BatchEncoding, not a dict."""
    make, task = CASES["clm_right_padding"]()
    result = E.run_case(make, task, mode="patch")
    assert result.batch_types == {"BatchEncoding"}


@pytest.mark.parametrize("how", ["model_loss", "loss_from_mean"])
def test_token_window_with_transformers_collator(how):
    """A hand-written accelerate loop over a DataLoader with transformers' own collator (BatchEncoding batches) and a
    datasets.Dataset: TokenWindow's accumulated gradient equals the ground truth on the batches the loop drew."""
    from accelerate import Accelerator
    from transformers import DataCollatorForLanguageModeling

    from hf_gradfix import TokenWindow

    tok = E.build_tokenizer()
    ds = _tokenized(tok, E.sentences(N_SAMPLES, seed=16))
    recorder = E.BatchRecorder(DataCollatorForLanguageModeling(tok, mlm=False))
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=recorder)
    model = H.build_model("llama", seed=0)
    accelerator = Accelerator(cpu=True)
    model, loader = accelerator.prepare(model, loader)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    got = []
    for window in TokenWindow(accelerator, loader, grad_accum_steps=2, model=model):
        for batch, micro in window:
            assert type(batch).__name__ == "BatchEncoding"
            if how == "model_loss":
                out = model(**batch, num_items_in_batch=micro.num_items_in_batch)
                accelerator.backward(micro.model_loss(out.loss))
            else:
                accelerator.backward(micro.loss_from_mean(model(**batch).loss))
        got.append(({n: p.grad.clone() for n, p in model.named_parameters()}, window.loss))
        model.zero_grad(set_to_none=True)
    model.load_state_dict(initial)
    assert len(got) == 2
    for k, (grads, loss) in enumerate(got):
        gt_loss, gt, _ = E.window_ground_truth(model, recorder.batches[2 * k : 2 * k + 2], "causal")
        assert H.rel_err(grads, gt) <= 1e-5
        assert abs(loss - gt_loss) <= 1e-6 * gt_loss
