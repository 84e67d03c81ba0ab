"""The composition matrix (issue 50): every opt-in setting crossed pairwise with the others, the head families
(causal, masked, seq2seq, token and sequence classification) and the trainers (transformers' Trainer, TRL's SFTTrainer
and GRPOTrainer), each cell trained for real and held to an independent ground truth; how, in ``tests/support/composition.py``.

Each cell must be exact, or equal to stock with exactly one warning, or refused before any step in one line, and
every opt-in setting of the cell must be in force or named by a warning: never silent. The planted composition bugs
(the lean head's causal shift forced onto a masked LM; TRL's packed rows re-packed as one document) must fail the
cells that hold them: the controls that show the matrix can fail.
"""

from __future__ import annotations

import pytest

import composition as C

ROWS, IMPOSSIBLE = C.covering_rows()
SOLO = C.solo_rows()
CELLS = ROWS + SOLO
VERDICTS: dict[str, C.Verdict] = {}

pytestmark = pytest.mark.filterwarnings("ignore")


def verdict_of(row) -> C.Verdict:
    key = C.cell_id(row)
    if key not in VERDICTS:
        VERDICTS[key] = C.judge(row)
    return VERDICTS[key]


def test_the_cells_cover_every_pair_or_say_why_not():
    """Pure: every pair of values of two factors is in a covering row, or cannot be built (with the reason), or is a
    solo cell (a combination refused by design, run on its own), or no allowed row can hold it (with the reason)."""
    covered = {pair for row in ROWS for pair in C._row_pairs(row)}
    for pair in C.all_pairs():
        reason = C.unbuildable(*pair) or C.solo_reason(*pair) or IMPOSSIBLE.get(pair)
        assert pair in covered or reason, f"{pair} is in no cell and no reason says why"
        if C.solo_reason(*pair):
            assert any(all(row[f] == v for f, v in pair) for row in SOLO), pair
    assert len(ROWS) <= 60, f"{len(ROWS)} covering rows: the greedy covering grew (CI time)"
    for row in CELLS:  # a covering row never holds a pair that cannot be built or that is refused by design
        for pair in C._row_pairs(row):
            assert C.unbuildable(*pair) is None, (C.cell_id(row), pair)
            if row not in SOLO:
                assert C.solo_reason(*pair) is None, (C.cell_id(row), pair)


@pytest.mark.parametrize("row", CELLS, ids=C.cell_id)
def test_cell(row):
    verdict = verdict_of(row)
    assert verdict.ok, f"{C.cell_id(row)}: {verdict.detail}"


def test_every_pair_trained_together_somewhere():
    """A covering row that hf_gradfix refuses trains none of its pairs: every pair a covering row holds must be in a
    row that trained (exact or stock), else the refusal hid it (make that combination a solo cell)."""
    trained = set()
    for row in ROWS:
        if verdict_of(row).kind in ("exact", "stock"):
            trained.update(C._row_pairs(row))
    hidden = []
    for row in ROWS:
        verdict = verdict_of(row)
        if verdict.kind == "refused":
            hidden += [pair for pair in C._row_pairs(row) if pair not in trained]
    assert not hidden, f"pairs only in refused rows (add their refusing pair to SOLO_PAIRS): {sorted(set(hidden))[:12]}"


def _cells_holding(**pair) -> list[dict]:
    cells = [row for row in ROWS if all(row[f] == v for f, v in pair.items())]
    assert cells, f"no covering row holds {pair}"
    return cells


def test_control_the_lean_heads_causal_shift_forced_on_a_masked_lm_fails_the_matrix(monkeypatch):
    """The planted composition bug (what main did): the lean head scores next-token targets whatever the model's
    loss_function computes. Every covering cell that trains the lean head on a masked LM must fail."""
    from hf_gradfix.integration import lean_head

    real = lean_head.measure_objective

    def always_shifted(*args, **kwargs):
        found = real(*args, **kwargs)
        return found if isinstance(found, str) else lean_head.Objective("next", found.reduction)

    monkeypatch.setattr(lean_head, "measure_objective", always_shifted)
    verdicts = [C.judge(row) for row in _cells_holding(lean=True, head="masked")]
    assert all(v.kind == "FAIL" for v in verdicts), [(C.cell_id(v.row), v.kind, v.detail) for v in verdicts]


def test_control_trls_packed_rows_repacked_as_one_document_fail_the_matrix(monkeypatch):
    """The planted composition bug (what main did): the plugin's packing reads no document boundaries in TRL's
    packed rows, so each trains as one sequence. Every covering cell with both packings must fail."""
    from hf_gradfix.packing import collator

    monkeypatch.setattr(collator, "document_lengths", lambda sample, n, where="sample": [n])
    cells = [row for packing in ("map", "stream") for row in ROWS
             if row["packing"] == packing and row["trl_packing"] == "bfd"]
    assert cells
    verdicts = [C.judge(row) for row in cells]
    assert all(v.kind == "FAIL" for v in verdicts), [(C.cell_id(v.row), v.kind, v.detail) for v in verdicts]
