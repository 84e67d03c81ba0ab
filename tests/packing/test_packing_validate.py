"""Bad rows are caught before training, in one pass, with one line naming the dataset index, the column and the fix.

Each case plants one bad row at a known dataset index in otherwise good data, as a ``datasets.Dataset`` (the Arrow,
vectorized path) and as a plain list of dicts (the row-by-row path); both must name the same index and column. Through
the Trainer, a dataset tokenized by a real (offline-built) tokenizer fails in ``train()`` before the first step.
"""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
import transformers

import harness as H
import hf_gradfix
from hf_gradfix.packing.validate import PackedDataError, validate_packing_dataset

VOCAB = 50


def _good(n=20, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(2, 12))
        ids = rng.integers(4, VOCAB, k).tolist()
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:], "attention_mask": [1] * k})
    return rows


def _as(kind, rows):
    if kind == "list":
        return rows
    return datasets.Dataset.from_list(rows)


def _with(rows, i, **changes):
    rows = [dict(r) for r in rows]
    rows[i].update(changes)
    return rows


CASES = {
    "labels_length": (lambda r: _with(r, 7, labels=r[7]["labels"][:-1]), "labels", r"has \d+ entries but input_ids has \d+.*Fix: labels must be unshifted"),
    "padding_mask": (lambda r: _with(r, 11, attention_mask=[1] * (len(r[11]["input_ids"]) - 1) + [0]), "attention_mask", r"has a 0 at token \d+ \(padding\)\. Fix: packed samples must be unpadded"),
    "token_out_of_vocab": (lambda r: _with(r, 3, input_ids=r[3]["input_ids"][:-1] + [VOCAB + 5]), "input_ids", rf"token id {VOCAB + 5} is outside the vocabulary \[0, {VOCAB}\)\. Fix: tokenize with the model's own tokenizer"),
    "negative_token": (lambda r: _with(r, 5, input_ids=[-1] + r[5]["input_ids"][1:]), "input_ids", r"token id -1 is outside the vocabulary"),
    "label_out_of_vocab": (lambda r: _with(r, 9, labels=r[9]["labels"][:-1] + [VOCAB]), "labels", rf"label id {VOCAB} at token \d+ is neither -100 nor in the vocabulary"),
    "empty": (lambda r: _with(r, 13, input_ids=[], labels=[], attention_mask=[]), "input_ids", r"is empty \(0 tokens\)\. Fix: drop empty samples"),
    "over_budget": (lambda r: _with(r, 15, input_ids=list(range(4, 40)), labels=list(range(4, 40)), attention_mask=[1] * 36), "input_ids", r"has 36 tokens, more than packing.token_budget=32"),
}


@pytest.mark.parametrize("kind", ["arrow", "list"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_row_is_named_by_its_dataset_index_and_column(case, kind):
    make, column, pattern = CASES[case]
    rows = make(_good())
    index = next(i for i, (a, b) in enumerate(zip(rows, _good())) if a != b)
    with pytest.raises(PackedDataError) as e:
        validate_packing_dataset(_as(kind, rows), vocab_size=VOCAB, token_budget=32)
    msg = str(e.value)
    assert msg.startswith(f"train dataset index {index}, column '{column}': "), msg
    assert "\n" not in msg
    import re

    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("kind", ["arrow", "list"])
def test_non_integer_and_2d_ids_are_refused(kind):
    rows = _good()
    floats = _with(rows, 4, input_ids=[float(x) + 0.5 for x in rows[4]["input_ids"]])
    if kind == "arrow":  # Arrow columns have one type: the whole column is float
        floats = [dict(r, input_ids=[float(x) for x in r["input_ids"]]) for r in rows]
    with pytest.raises(PackedDataError, match=r"column 'input_ids': holds (float64|double) values, not integer ids\. Fix: store integer token ids"):
        validate_packing_dataset(_as(kind, floats))
    nested = [dict(r, input_ids=[r["input_ids"]]) for r in rows] if kind == "arrow" else _with(rows, 6, input_ids=[rows[6]["input_ids"]])
    with pytest.raises(PackedDataError, match=r"index (0|6), column 'input_ids': (is 2-D|has shape).*Fix: store one unpadded sample per row"):
        validate_packing_dataset(_as(kind, nested))


def test_arrow_and_list_paths_agree_on_good_data():
    rows = _good(200, seed=3)
    a = validate_packing_dataset(_as("arrow", rows), vocab_size=VOCAB)
    b = validate_packing_dataset(rows, vocab_size=VOCAB)
    assert a.lengths.tolist() == b.lengths.tolist() == [len(r["input_ids"]) for r in rows]
    expected = sum(sum(1 for x in r["labels"][1:] if x != -100) for r in rows)
    assert a.n_targets == b.n_targets == expected
    # a shuffled / selected dataset is read through its index mapping: dataset index i is the i-th row
    order = list(np.random.default_rng(0).permutation(200))
    c = validate_packing_dataset(datasets.Dataset.from_list(rows).select(order), vocab_size=VOCAB)
    assert c.lengths.tolist() == [len(rows[i]["input_ids"]) for i in order]


def test_length_column_must_match():
    rows = [dict(r, length=len(r["input_ids"])) for r in _good()]
    rows[8]["length"] += 1
    with pytest.raises(PackedDataError, match=r"^train dataset index 8, column 'length': says \d+ tokens but input_ids has"):
        validate_packing_dataset(_as("arrow", rows))


def _already_packed(rows, how):
    """Rows of two samples each, back to back, with their boundaries as TRL's pack_dataset (seq_lengths) or as a
    dataset packed offline (restarted position_ids) gives them."""
    out = []
    for a, b in zip(rows[::2], rows[1::2]):
        n, m = len(a["input_ids"]), len(b["input_ids"])
        row = {"input_ids": a["input_ids"] + b["input_ids"], "labels": a["labels"] + b["labels"]}
        row.update(seq_lengths=[n, m]) if how == "seq_lengths" else row.update(position_ids=list(range(n)) + list(range(m)))
        out.append(row)
    return out


@pytest.mark.parametrize("kind", ["arrow", "list"])
@pytest.mark.parametrize("how", ["seq_lengths", "position_ids"])
def test_already_packed_samples_count_every_document_and_bad_boundaries_are_one_line(kind, how):
    """Issue 50 item 1: samples that already hold several documents (TRL's seq_lengths, restarted position_ids): each
    document's first label is no target (the collator masks it, as it trains the documents apart), the documents are
    counted, and boundaries that do not fit the sample are one line naming the index and the column."""
    rows = _good(20, seed=1)
    packed = _already_packed(rows, how)
    check = validate_packing_dataset(_as(kind, packed), vocab_size=VOCAB)
    assert check.n_documents == 20 and check.n_samples == 10
    assert check.n_targets == sum(sum(1 for x in r["labels"][1:] if x != -100) for r in rows)
    bad = [dict(r) for r in packed]
    if how == "seq_lengths":
        bad[6]["seq_lengths"] = [bad[6]["seq_lengths"][0], bad[6]["seq_lengths"][1] + 1]
        pattern = r"^train dataset index 6, column 'seq_lengths': .*(adds up|sum) to \d+ tokens but input_ids has \d+.*Fix: give the length of every document"
    else:
        bad[6]["position_ids"] = bad[6]["position_ids"][:-1]
        pattern = r"^train dataset index 6, column 'position_ids': .*entries but input_ids ha(s|ve) \d+.*Fix: give one position per token"
    with pytest.raises(PackedDataError, match=pattern) as e:
        validate_packing_dataset(_as(kind, bad), vocab_size=VOCAB)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["arrow", "list"])
def test_a_dataset_without_any_target_warns(kind):
    rows = [dict(r, labels=[-100] + [-100] * (len(r["input_ids"]) - 1)) for r in _good()]
    rows[2]["labels"] = [5] + [-100] * (len(rows[2]["input_ids"]) - 1)  # a first-token label is never a target
    with pytest.warns(UserWarning, match="none of its 20 samples has a single target"):
        check = validate_packing_dataset(_as(kind, rows))
    assert check.n_targets == 0 and check.samples_without_targets == 20


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(H.VOCAB)}, unk_token="3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")


def _train_on(dataset, model):
    args = transformers.TrainingArguments(
        output_dir="/tmp/hgf_validate", optim="sgd", learning_rate=0.1, per_device_train_batch_size=1,
        max_steps=3, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=3,
    )
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}})
    try:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    return trainer


def test_the_trainer_refuses_a_bad_row_before_the_first_step():
    tok = _tokenizer()
    g = np.random.default_rng(0)
    texts = [" ".join(str(int(x)) for x in g.integers(4, H.VOCAB, int(g.integers(3, 20)))) for _ in range(24)]
    ds = datasets.Dataset.from_dict({"text": texts})
    # row 17 was tokenized with padding: its attention_mask has zeros (a common mistake)
    ds = ds.map(lambda s, i: tok(s["text"], padding="max_length" if i == 17 else False, max_length=24), with_indices=True,
                remove_columns=["text"])
    ds = ds.map(lambda s: {"labels": s["input_ids"]})
    model = H.build_model("llama", attn_implementation="sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PackedDataError, match=r"^train dataset index 17, column 'attention_mask': has a 0 at token \d+ \(padding\)"):
        _train_on(ds, model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing trained
    # the fixed dataset trains
    fixed = ds.map(lambda s: {k: [x for x, m in zip(s[k], s["attention_mask"]) if m] for k in ("input_ids", "labels", "attention_mask")})
    assert _train_on(fixed, model).state.global_step == 3


def test_the_trainer_refuses_ids_outside_the_model_vocabulary():
    model = H.build_model("llama", attn_implementation="sdpa")
    vocab = model.get_input_embeddings().num_embeddings
    rows = [{"input_ids": list(range(4, 4 + k)), "labels": list(range(4, 4 + k))} for k in (5, 9, 3, 7)]
    rows[2]["input_ids"] = [4, vocab, 5]
    with pytest.raises(PackedDataError, match=rf"^train dataset index 2, column 'input_ids': token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        _train_on(datasets.Dataset.from_list(rows), model)


def test_a_bad_row_of_a_shuffled_dataset_is_named_by_its_dataset_index():
    rows = _with(_good(300, seed=4), 123, attention_mask=[0] + [1] * (len(_good(300, seed=4)[123]["input_ids"]) - 1))
    ds = datasets.Dataset.from_list(rows).shuffle(seed=1)  # an index mapping: dataset index != storage row
    where = [i for i in range(len(ds)) if 0 in ds[i]["attention_mask"]]
    assert where and where[0] != 123
    with pytest.raises(PackedDataError, match=rf"^train dataset index {where[0]}, column 'attention_mask': has a 0 at token 0"):
        validate_packing_dataset(ds)
