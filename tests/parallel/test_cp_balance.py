"""CP x packing, ``parallel.cp_balance: long_documents`` (issue 40, item 3), in one process: the layout keeps every
token once, in equal slices, and its rewritten mask is the document-causal mask of the ORIGINAL row.

Ground truth is built here from the original row alone (documents where the positions restart, query i sees key j
iff same document and i >= j), never from the layout's own ``doc`` or ``mask``. The CP launch that trains through
this layout exactly is ``packed_cp2_long_documents`` in test_context_parallel.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hf_gradfix.parallel.context_packing import (PackedLayout, deal_documents, masked_pairs_per_rank,
                                                 packed_attention_block)

IGNORE = -100


def _batch(rows: list[list[int]]) -> dict:
    """Packed rows of documents of the given lengths, every token id unique (id - 1 = its index in the batch), rows
    right-filled to one length with a last document (as the collator's ``rows`` mode does)."""
    width = max(sum(r) for r in rows)
    rows = [r + [width - sum(r)] if width > sum(r) else r for r in rows]
    positions = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    ids = torch.arange(1, positions.numel() + 1).reshape(positions.shape)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def _truth(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] document of each token of an original row (a new one where the position does not go up by one) and the
    [T, T] document-causal mask."""
    doc, current = [], 0
    for t in range(len(positions)):
        if t and int(positions[t]) != int(positions[t - 1]) + 1:
            current += 1
        doc.append(current)
    doc = torch.tensor(doc)
    causal = torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return doc, (doc[:, None] == doc[None, :]) & causal


def _problems(layout: PackedLayout, batch: dict, mask: torch.Tensor | None = None) -> list[str]:
    """What is wrong with ``layout`` against the original ``batch`` ([] = exact); ``mask``: [B, 1, L, L] in the
    permuted order, default the layout's own (every rank's slice stacked)."""
    out = []
    cp, length = layout.cp, layout.length
    mask = layout.full_mask() if mask is None else mask
    for b in range(batch["input_ids"].shape[0]):
        original = batch["input_ids"][b]
        if length % cp or sorted(layout.indices[b].tolist()) != list(range(length)):
            out.append(f"row {b}: the layout is not a permutation of {length} tokens in {cp} equal slices")
            continue
        ids = torch.cat([layout.shard("input_ids", r)[b] for r in range(cp)])
        real = torch.cat([layout.shard_real(r)[b] for r in range(cp)]).bool()
        if sorted(ids[real].tolist()) != sorted(original.tolist()):
            out.append(f"row {b}: real tokens lost or repeated")
            continue
        where = ids[real] - original[0]  # each real token's index in the original row
        positions = torch.cat([layout.shard("position_ids", r)[b] for r in range(cp)])
        if not torch.equal(positions[real], batch["position_ids"][b][where]):
            out.append(f"row {b}: positions did not travel with their tokens")
        doc, allowed = _truth(batch["position_ids"][b])
        # the target of token t is token t + 1 of the same document, else nothing
        nxt = torch.cat([original[1:], torch.tensor([IGNORE])])
        same = torch.cat([doc[1:] == doc[:-1], torch.tensor([False])])
        want_shift = torch.where(same, nxt, torch.full_like(nxt, IGNORE))
        shift = torch.cat([layout.shard("shift_labels", r)[b] for r in range(cp)])
        if not torch.equal(shift[real], want_shift[where]) or bool((shift[~real] != IGNORE).any()):
            out.append(f"row {b}: shift_labels differ from the original row's (or a pad has a target)")
        m = mask[b, 0]
        if not torch.equal(m[real][:, real], allowed[where][:, where]):
            out.append(f"row {b}: the mask between real tokens differs from the original row's document-causal mask")
        if bool(m[real][:, ~real].any()):
            out.append(f"row {b}: a real token sees a pad")
        if not bool(m.any(dim=1).all()):
            out.append(f"row {b}: a query sees no key (its softmax row would be NaN)")
    return out


ROWS = [
    ([[5, 13, 2, 9, 40, 3, 3, 1]], 2, 8),  # 13, 9 and 40 cut; 40 > the row's share too
    ([[5, 13, 2, 9, 40, 3, 3, 1]], 3, None),  # only 40 (> share 26) cut; cp 3: slices of a non-power of two
    ([[7, 7, 7, 7, 7, 7, 7, 7]], 4, None),  # nothing cut: whole documents, no pad at all
    ([[30, 2, 1], [4, 4, 4, 4, 4, 4]], 2, 3),  # rows mode: two rows, one slice length
    ([[64]], 8, None),  # a row of one document: cut over 8 ranks
]


@pytest.mark.parametrize("rows,cp,threshold", ROWS)
def test_long_documents_keeps_every_token_once_and_the_original_mask(rows, cp, threshold):
    batch = _batch(rows)
    layout = PackedLayout.build(batch, cp, balance="long_documents", threshold=threshold)
    assert _problems(layout, batch) == []
    shards = [layout.shard("input_ids", r) for r in range(cp)]
    assert len({s.shape for s in shards}) == 1 and shards[0].shape[1] * cp == layout.length


def test_long_documents_on_random_rows():
    rng = random.Random(0)
    for _ in range(40):
        cp = rng.choice([2, 3, 4, 8])
        rows = [[rng.choice([rng.randint(1, 12), rng.randint(20, 90)]) for _ in range(rng.randint(1, 9))]
                for _ in range(rng.randint(1, 3))]
        threshold = rng.choice([None, 1, 10, 40])
        batch = _batch(rows)
        layout = PackedLayout.build(batch, cp, balance="long_documents", threshold=threshold)
        assert _problems(layout, batch) == [], (rows, cp, threshold)


def test_short_documents_stay_whole_and_long_ones_reach_every_rank():
    lengths = [5, 13, 2, 9, 40, 3, 3, 1]
    batch = _batch([lengths])
    layout = PackedLayout.build(batch, 2, balance="long_documents", threshold=8)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    held = [set((layout.shard("input_ids", r)[0] - 1).tolist()) for r in range(2)]
    for start, n in zip(starts, lengths):
        ranks = [r for r in range(2) if held[r] & set(range(start, start + n))]
        assert len(ranks) == (2 if n > 8 else 1), (n, ranks)
    # pads: only the cut documents' (13 and 9 to multiples of 4: 3 + 3) and at most one to even out the slices
    assert layout.length - sum(lengths) <= 7


def test_whole_documents_are_dealt_by_attention_work():
    """Equal short documents: none cut, none padded, the same work on every rank; a document longer than a rank's
    share is cut even with no threshold."""
    assert masked_pairs_per_rank([10] * 8, 2, "long_documents") == [4 * 55] * 2
    layout = PackedLayout.build(_batch([[10] * 8]), 2, balance="long_documents")
    assert layout.length == 80 and layout.real.all()
    laid, ranges = deal_documents([30, 5, 5], 2, threshold=None)  # share 20: 30 is cut
    assert laid == [32, 5, 5] and all(any(e - s == 8 for s, e in r) for r in ranges)
    # longest first onto the least loaded rank, with room to spare: 12 alone (78 pairs) against 8 + 8 (72)
    assert deal_documents([8, 12, 8], 2, capacity=20)[1] == [[(8, 20)], [(0, 8), (20, 28)]]
    # no room to spare (14 tokens a rank): the last 8 is cut in contiguous pieces, its first 2 tokens (the cheaper
    # piece) onto the heavier rank; no slice grows, so no rank is padded
    assert deal_documents([8, 12, 8], 2)[1] == [[(8, 20), (20, 22)], [(0, 8), (22, 28)]]


def test_attention_through_the_layout_equals_the_original_row():
    """One process holding every slice: the permuted row under the layout's mask gives each real token the output of
    full attention over the ORIGINAL row under its document-causal mask."""
    batch = _batch([[5, 13, 2, 9, 40, 3, 3, 1]])
    layout = PackedLayout.build(batch, 2, balance="long_documents", threshold=8)
    _, allowed = _truth(batch["position_ids"][0])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, allowed.shape[0], 8, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    real = layout.real[0].bool()
    laid = [torch.randn(1, 2, layout.length, 8, dtype=torch.float64) for _ in range(3)]  # pads: anything
    for t, x in zip(laid, (q, k, v)):
        t[:, :, real] = x  # the laid-out row keeps the original order of the real tokens
    perm = layout.indices[0]
    with packed_attention_block(layout.full_mask(), None):
        got = F.scaled_dot_product_attention(*(t[:, :, perm] for t in laid), is_causal=True)
    ids = layout.permuted("input_ids")[0]  # id - 1: the original index of a real token
    real_perm = torch.gather(layout.real, 1, layout.indices)[0].bool()
    assert torch.allclose(got[:, :, real_perm], want[:, :, ids[real_perm] - 1], atol=1e-12)


def test_controls_fail():
    """A lost token, and the mask built from the permuted order (documents cut over the ranks without their global
    positions), are caught by the same check."""
    batch = _batch([[5, 13, 2, 9, 40, 3, 3, 1]])
    layout = PackedLayout.build(batch, 2, balance="long_documents", threshold=8)
    lost = PackedLayout(**{**layout.__dict__, "indices": layout.indices.clone()})
    lost.indices[0, 1] = lost.indices[0, 0]
    assert any("not a permutation" in p for p in _problems(lost, batch))
    doc = torch.gather(layout.doc, 1, layout.indices)  # the right documents, but causal in the permuted order
    local = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(layout.length, layout.length, dtype=torch.bool).tril())
    problems = _problems(layout, batch, mask=local[:, None])
    assert any("mask between real tokens differs" in p for p in problems), problems
    # dealing whole documents only, the permuted order IS causal within each document: the control needs a cut one
    whole = PackedLayout.build(_batch([[7] * 8]), 2, balance="long_documents")
    doc = torch.gather(whole.doc, 1, whole.indices)
    local = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(whole.length, whole.length, dtype=torch.bool).tril())
    assert _problems(whole, _batch([[7] * 8]), mask=local[:, None]) == []


def test_per_document_passes_the_same_check():
    """The independent check is not tuned to the new layout: today's per_document layout passes it too."""
    for rows, cp, _ in ROWS:
        batch = _batch(rows)
        assert _problems(PackedLayout.build(batch, cp), batch) == []


def test_bad_balance_and_threshold_are_refused():
    from hf_gradfix.parallel.context import ContextParallelError

    batch = _batch([[4, 4]])
    with pytest.raises(ContextParallelError, match="cp_balance: 'long_document' is not one of"):
        PackedLayout.build(batch, 2, balance="long_document")
    with pytest.raises(ContextParallelError, match="cp_balance_threshold: 0"):
        PackedLayout.build(batch, 2, balance="long_documents", threshold=0)


def test_config_keys():
    from hf_gradfix.config import ConfigError, config_from_dict
    from hf_gradfix.config.resolve import parallel_requested

    def error(d: dict) -> str:
        with pytest.raises(ConfigError) as info:
            config_from_dict(d)
        return str(info.value)

    cfg = config_from_dict({"parallel": {"cp": 2, "cp_balance": "long_documents", "cp_balance_threshold": 512}})
    assert (cfg.parallel.cp_balance, cfg.parallel.cp_balance_threshold) == ("long_documents", 512)
    assert config_from_dict({}).parallel.cp_balance == "per_document"
    msg = error({"parallel": {"cp_balance": "long"}})
    assert msg.count("\n") == 0 and "parallel.cp_balance: invalid value 'long'" in msg and "'long_documents'" in msg
    assert "parallel.cp_balance_threshold: invalid value 0; it must be >= 1" in error(
        {"parallel": {"cp_balance": "long_documents", "cp_balance_threshold": 0}})
    msg = error({"parallel": {"cp_balance_threshold": 512}})
    assert msg.count("\n") == 0 and "applies with cp_balance: long_documents only" in msg
    # a layout option is not a mesh: alone it sets nothing up
    assert not parallel_requested(config_from_dict({"parallel": {"cp_balance": "long_documents"}}).parallel)


def test_guard_probes_the_long_documents_layout():
    import transformers as tf

    from hf_gradfix.packing.guard import check_model_packs_under_cp

    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64)
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    report = check_model_packs_under_cp(model, cp=2, balance="long_documents")
    assert report.passed and report.details["attention_calls"] == 1 and report.max_diff < 1e-5


def test_config_check_names_the_balance(tmp_path, capsys):
    from hf_gradfix.cli import main
    from test_cli import _cpu_yaml, _write

    section = {"parallel": {"tp": 2, "cp": 2, "cp_balance": "long_documents", "cp_balance_threshold": 1024},
               "packing": True}
    assert main(["config", "check", str(_write(tmp_path, {**_cpu_yaml(4), "hf_gradfix": section}))]) == 0
    assert ("cp=2 over packed rows: documents longer than 1024 tokens or a rank's share of the row padded to a "
            "multiple of 4 and split head-tail over the cp ranks, the others dealt whole") in capsys.readouterr().out
