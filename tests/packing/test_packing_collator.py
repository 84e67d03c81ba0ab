"""PackedCollator and check_packed_batch: exact tensors, dtypes, boundaries, rows-mode padding, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_gradfix.packing.collator import PackedBatchError, PackedCollator, check_packed_batch

LENGTHS = [4, 8, 5, 11, 1]


def _samples(lengths=LENGTHS, start=10):
    out, tok = [], start
    for n in lengths:
        out.append({"input_ids": list(range(tok, tok + n))})
        tok += n
    return out


# ------------------------------------------------------------------------------------------ varlen mode
def test_varlen_golden_tensors_and_dtypes():
    batch = PackedCollator()(_samples())
    T = sum(LENGTHS)
    assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert "attention_mask" not in batch
    ids = torch.arange(10, 10 + T).unsqueeze(0)
    assert torch.equal(batch["input_ids"], ids)
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    expected_pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    assert torch.equal(batch["position_ids"], expected_pos)
    cu = torch.tensor([0, 4, 12, 17, 28, 29], dtype=torch.int32)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert batch[key].dtype == torch.int32
        assert torch.equal(batch[key], cu)
    assert batch["max_length_q"] == batch["max_length_k"] == 11
    assert type(batch["max_length_q"]) is int and type(batch["max_length_k"]) is int
    # labels: input_ids with -100 at every sequence start
    expected_labels = ids.clone()
    expected_labels[0, cu[:-1].long()] = -100
    assert torch.equal(batch["labels"], expected_labels)
    # the number of targets after the model's shift is sum(len - 1)
    assert int((batch["labels"][0, 1:] != -100).sum()) == sum(n - 1 for n in LENGTHS)
    check_packed_batch(batch)


def test_user_label_masking_is_kept_on_top_of_boundaries():
    samples = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},  # prompt masked by the user
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, -100, 7])},
        {"input_ids": np.array([8, 9]), "labels": (8, 9)},
    ]
    batch = PackedCollator()(samples)
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, -100, -100, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    check_packed_batch(batch)


def test_inputs_are_not_modified():
    labels = torch.tensor([5, 6, 7])
    PackedCollator()([{"input_ids": torch.tensor([5, 6, 7]), "labels": labels}])
    assert labels.tolist() == [5, 6, 7]


def test_varlen_pad_to_multiple_of_adds_one_pad_sequence():
    batch = PackedCollator(pad_to_multiple_of=8, pad_token_id=99)(_samples([3, 2]))
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 99, 99, 99]]
    assert batch["labels"].tolist() == [[-100, 11, 12, -100, 14, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert batch["max_length_q"] == 3
    check_packed_batch(batch)
    # already a multiple: no pad segment
    assert PackedCollator(pad_to_multiple_of=5)(_samples([3, 2]))["cu_seq_lens_q"].tolist() == [0, 3, 5]


def test_position_ids_start_and_seq_idx():
    batch = PackedCollator(position_ids_start=2, return_seq_idx=True)(_samples([2, 3]))
    assert batch["position_ids"].tolist() == [[2, 3, 2, 3, 4]]
    assert batch["seq_idx"].tolist() == [[0, 0, 1, 1, 1]] and batch["seq_idx"].dtype == torch.int32
    check_packed_batch(batch)


def test_several_bins_in_varlen_mode_flatten_into_one_row():
    batch = PackedCollator(max_tokens=6)([_samples([2, 3]), _samples([6], start=50)])
    assert batch["input_ids"].shape == (1, 11)
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5, 11]
    check_packed_batch(batch)


def test_works_as_dataloader_collate_fn_with_a_bin_sampler():
    data = _samples([3, 4, 2, 6, 1])
    loader = torch.utils.data.DataLoader(data, batch_sampler=[[0, 1, 2], [3, 4]], collate_fn=PackedCollator(max_tokens=9))
    batches = list(loader)
    assert [b["cu_seq_lens_q"].tolist() for b in batches] == [[0, 3, 7, 9], [0, 6, 7]]
    for b in batches:
        check_packed_batch(b)


# ------------------------------------------------------------------------------------------ rows mode
def test_rows_mode_pads_each_row_as_its_own_restarted_segment():
    bins = [_samples([3, 4]), _samples([2], start=40), _samples([5, 1, 1], start=60)]
    batch = PackedCollator(mode="rows", pad_token_id=0)(bins)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (3, 7)
    assert batch["input_ids"].tolist() == [
        [10, 11, 12, 13, 14, 15, 16],
        [40, 41, 0, 0, 0, 0, 0],
        [60, 61, 62, 63, 64, 65, 66],
    ]
    assert batch["labels"].tolist() == [
        [-100, 11, 12, -100, 14, 15, 16],
        [-100, 41, -100, -100, -100, -100, -100],
        [-100, 61, 62, 63, 64, -100, -100],
    ]
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 2, 3],
        [0, 1, 0, 1, 2, 3, 4],
        [0, 1, 2, 3, 4, 0, 0],
    ]
    check_packed_batch(batch)


def test_rows_mode_padding_is_a_separate_segment_for_transformers_packed_detection():
    from transformers.masking_utils import find_packed_sequence_indices

    batch = PackedCollator(mode="rows")([_samples([3, 2]), _samples([1], start=40), _samples([4], start=50)])
    seg = find_packed_sequence_indices(batch["position_ids"])
    assert seg is not None
    # row 0: two sequences, no padding; row 1: one token + a 4-token pad segment; row 2: one sequence + 1 pad
    assert seg.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    # A pad region continuing the positions would have merged with the last sequence (no boundary):
    continued = batch["position_ids"].clone()
    continued[2, 4] = 4
    assert find_packed_sequence_indices(continued)[2].tolist() == [0, 0, 0, 0, 0]


def test_rows_mode_one_bin_and_pad_to_multiple():
    batch = PackedCollator(mode="rows", pad_to_multiple_of=4, pad_token_id=7)(_samples([2, 3]))
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 7, 7, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    check_packed_batch(batch)


# ------------------------------------------------------------------------------------------ input errors
@pytest.mark.parametrize(
    "samples, match",
    [
        ([{"input_ids": [1, 2]}, {"input_ids": []}], "sample 1: empty sample"),
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], "labels have 2 entries but input_ids have 3"),
        ([{"labels": [1, 2]}], "no 'input_ids' key"),
        ([{"input_ids": [[1, 2]]}], "expected a 1-D sequence"),
        ([{"input_ids": [1.0, 2.0]}], "expected integer token ids"),
        ([{"input_ids": [1, 2], "attention_mask": [1, 0]}], "must be unpadded"),
        ([], "empty batch"),
        ({"input_ids": [1]}, "got a single dict"),
        ([[{"input_ids": [1]}], []], "bin 1 is empty"),
        ([{"input_ids": [1]}, [{"input_ids": [2]}]], "got a mixture"),
    ],
)
def test_bad_input_raises_clear_errors(samples, match):
    with pytest.raises(PackedBatchError, match=match):
        PackedCollator()(samples)


def test_bin_over_budget_raises():
    with pytest.raises(PackedBatchError, match=r"bin 0 holds 9 tokens, over the token budget max_tokens=8 \(sample lengths \[4, 5\]\)"):
        PackedCollator(max_tokens=8)(_samples([4, 5]))
    with pytest.raises(PackedBatchError, match="bin 1 holds 9 tokens"):
        PackedCollator(mode="rows", max_tokens=8)([_samples([4]), _samples([4, 5])])
    PackedCollator(max_tokens=9)(_samples([4, 5]))  # exactly at the budget is fine


@pytest.mark.parametrize(
    "kwargs", [{"mode": "flat"}, {"max_tokens": 0}, {"pad_to_multiple_of": 0}, {"position_ids_start": -1}]
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        PackedCollator(**kwargs)


# ------------------------------------------------------------------------------------------ validator
def _good():
    return PackedCollator()(_samples([3, 4, 2]))


def _with(**changes):
    batch = dict(_good())
    batch.update(changes)
    return batch


def _cu(*values, dtype=torch.int32):
    cu = torch.tensor(values, dtype=dtype)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone()}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _with(attention_mask=torch.ones(1, 9, dtype=torch.long)), "has an attention_mask"),
        (lambda: _with(use_cache=True), "use_cache=True"),
        (lambda: _with(past_key_values=object()), "past_key_values"),
        (lambda: {k: v for k, v in _good().items() if k != "position_ids"}, "no position_ids"),
        (lambda: _with(position_ids=torch.arange(9)), "must have the shape of input_ids"),
        (lambda: _with(**_cu(1, 3, 7, 9)), "must start at 0"),
        (lambda: _with(**_cu(0, 3, 7, 8)), "must end at the number of tokens T=9"),
        (lambda: _with(**_cu(0, 3, 3, 9)), "strictly increasing"),
        (lambda: _with(**_cu(0, 3, 7, 9, dtype=torch.int64)), "must be int32"),
        (lambda: _with(cu_seq_lens_k=torch.tensor([0, 3, 9], dtype=torch.int32)), "differ"),
        (lambda: {k: v for k, v in _good().items() if k != "cu_seq_lens_k"}, "only one of"),
        (lambda: _with(max_length_q=torch.tensor(4)), "must be a Python int"),
        (lambda: _with(max_length_k=3), "max_length_k=3 but the longest sequence"),
        (lambda: {k: v for k, v in _good().items() if k != "max_length_q"}, "no max_length_q"),
        (
            lambda: _with(position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])),
            "do not restart exactly at the cu_seq_lens boundaries",
        ),
        (
            lambda: _with(labels=torch.tensor([[-100, 1, 2, 3, 4, 5, 6, -100, 8]])),
            "labels must be -100 at every sequence start \\(row 0, token 3",
        ),
        (lambda: _with(labels=torch.zeros(1, 8, dtype=torch.long)), "labels must be a tensor of the shape"),
        (lambda: _with(input_ids=torch.zeros(9, dtype=torch.long)), "input_ids must be 2-D"),
    ],
)
def test_validator_errors(make, match):
    with pytest.raises(PackedBatchError, match=match):
        check_packed_batch(make())


def test_validator_rejects_cu_seq_lens_with_batch_size_two():
    rows = PackedCollator(mode="rows")([_samples([3, 2]), _samples([4], start=40)])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(PackedBatchError, match="cu_seq_lens with batch size 2"):
        check_packed_batch(dict(rows, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3))


def test_validator_rows_mode_boundaries_from_position_ids():
    rows = PackedCollator(mode="rows")([_samples([3, 2]), _samples([4], start=40)])
    check_packed_batch(rows)
    bad = dict(rows, labels=rows["labels"].clone())
    bad["labels"][1, 0] = 40
    with pytest.raises(PackedBatchError, match=r"\(row 1, token 0 has label 40\)"):
        check_packed_batch(bad)
    # a batch without labels only gets the structural checks
    check_packed_batch({k: v for k, v in rows.items() if k != "labels"})


@pytest.mark.parametrize("kwargs, samples, needle", [
    ({}, [{"input_ids": [5, -3, 7]}], "sample 0: input_ids[1] = -3: a token id must be >= 0"),
    ({}, [{"input_ids": [5, 6, 7], "labels": [5, -5, 7]}], "sample 0: labels[1] = -5: a label is a token id >= 0 or the ignore index -100"),
    ({"max_tokens": True}, None, "max_tokens must be a positive int or None, got True"),
    ({"pad_token_id": "0"}, None, "pad_token_id must be an int, got '0'"),
    ({"pad_token_id": -1}, None, "pad_token_id must be a token id >= 0, got -1"),
    ({"position_ids_start": True}, None, "position_ids_start must be a non-negative int, got True"),
])
def test_library_arguments_are_checked_like_the_yaml(kwargs, samples, needle):
    """Issue 38: the collator refused neither a negative id nor a label of -5 (cross-entropy fails on it, or an
    embedding indexes from the end) nor max_tokens=True; one line naming the argument and the value."""
    from hf_gradfix.errors import HfGradfixError

    with pytest.raises(HfGradfixError) as err:
        PackedCollator(**kwargs)(samples or [{"input_ids": [1, 2]}])
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
