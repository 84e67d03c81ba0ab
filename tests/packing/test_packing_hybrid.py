"""Packing hybrid and state-space models (issue 37): the layers that carry a recurrent state or a convolution window
along the sequence run once per document, so a packed row trains exactly what each document alone trains.

Three families transformers 5.x ships, tiny and random-init (fp32, torch fallbacks: what runs on a CPU): LFM2 (a short
convolution), Qwen3.5 (Gated DeltaNet: a convolution and a recurrent state), Bamba (a Mamba-2 mixer). For each:

* the Trainer with hf_gradfix's packing: every optimizer window's gradient and logged loss vs the unpacked float64-free
  ground truth (each sample alone, CE summed, divided by the window's targets: ``harness.ground_truth``);
* stock beside it: one row of the same documents packed by transformers' ``DataCollatorWithFlattening`` (restarted
  ``position_ids``, no mask) through the unchanged model: its gradient error (or the error it raises);
* the controls that must fail: the split undone (the state and the window carried over: stock's leak), and the split
  at wrong boundaries (two documents run as one: the state not reset at that boundary).

The per-family table over every hybrid family (guard verdicts, kernels) is ``benchmarks/hybrid_packing_table.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import harness as H
import hf_gradfix
from hf_gradfix.packing import state_reset
from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_correctly
from test_packing_trainer import BUDGET, _train, _windows

from test_exactness import GRAD_TOL, LOSS_TOL  # noqa: E402  (1e-5; the logged loss: 4.57 rounds it to 4 digits)
FAMILIES = ["lfm2", "qwen3_5", "bamba"]


def build(family: str):
    common = dict(vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=H.PAD_ID, tie_word_embeddings=False)
    if family == "lfm2":
        cfg = transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"])
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common, head_dim=8, layer_types=["linear_attention", "full_attention"],
                                             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                             linear_value_head_dim=8)
    elif family == "bamba":
        cfg = transformers.BambaConfig(**common, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                                       mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16)
    else:
        raise KeyError(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def _has(family: str) -> bool:
    return hasattr(transformers, {"lfm2": "Lfm2Config", "qwen3_5": "Qwen3_5TextConfig", "bamba": "BambaConfig"}[family])


families = pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.skipif(
    not _has(f), reason=f"this transformers has no {f}")) for f in FAMILIES])


def row_grad_error(model, gt: dict, inputs: dict, labels: torch.Tensor) -> float:
    """Packed rows (``inputs``, ``labels`` [rows, T] with -100 at every document's first token and on padding) through
    ``model``: the relative gradient error of their token-mean loss (shifted within each row) against ``gt``."""
    model.zero_grad(set_to_none=True)
    model.train()
    # use_cache=False, as hf_gradfix's packing sets it (a cache holds the state across the row by design)
    logits = model(**inputs, use_cache=False).logits.float()
    shifted = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), ignore_index=-100,
                                             reduction="sum")
    (loss / (shifted != -100).sum()).backward()
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return H.rel_err(got, gt)


def packed_row_error(model, samples, **collator_kw) -> float:
    """One row of ``samples`` packed by transformers' DataCollatorWithFlattening (``collator_kw``: e.g.
    ``return_seq_idx=True``; every key it returns goes to the model) through ``model`` as it is: the relative gradient
    error of its token-mean loss against each sample alone (the ground truth); inf where the model refuses packed
    input."""
    _, gt = H.ground_truth(model, samples, "causal")
    batch = transformers.DataCollatorWithFlattening(**collator_kw)(
        [{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in samples])
    try:
        return row_grad_error(model, gt, {k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
    except ValueError:  # transformers' own refusal of packed input on this path (Qwen3.5 without fla)
        model.zero_grad(set_to_none=True)
        return float("inf")


@families
def test_trainer_packs_hybrid_layers_exactly_and_stock_does_not(family):
    model = build(family)
    samples = H.make_samples("causal", n=10, seed=0, lo=3, hi=30, prompt_mask_frac=0.3)
    stock = packed_row_error(model, samples[:4])
    assert stock > GRAD_TOL, f"{family}: stock's packed row should leak between documents or be refused ({stock:.3e})"
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": "varlen"}})
    try:
        try:
            trainer, grads = _train(model, samples, ga=2)
        except PackingCheckError as err:  # measured here: this release's model does not run the packed path at all
            message = str(err)
            assert "\n" not in message and message.startswith(type(model).__name__), message
            assert not check_model_packs_correctly(model, token_budget=BUDGET, raise_on_failure=False).passed
            pytest.skip(f"{family} on transformers {transformers.__version__}: refused before any step ({message[:160]})")
    finally:
        hf_gradfix.unpatch()
    line = " ".join(hf_gradfix.state_of(trainer).fixes)
    assert "documents run one by one through" in line and "guard passed" in line, line
    windows = _windows(samples, 2)
    assert len(windows) == len(grads) >= 2
    assert any(len(b) > 1 for w in windows for b in w)  # rows really hold several documents
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for k, (window, g) in enumerate(zip(windows, grads)):
        gt_loss, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"{family} step {k}: {H.rel_err(g, gt):.3e} (stock packed row: {stock:.3e})"
        assert abs(logged[k] - gt_loss) / gt_loss <= LOSS_TOL
    model._hf_gradfix_document_split.restore()


@families
def test_controls_state_carried_over_or_reset_at_the_wrong_boundary_fail(family, monkeypatch):
    """With the split the packed row is exact; undone (stock's path), or with two documents run as one (the state and
    the convolution window not reset at that boundary), the same row fails the tolerance."""
    model = build(family)
    samples = H.make_samples("causal", n=4, seed=1, lo=6, hi=20)
    probe = transformers.DataCollatorWithFlattening()([{"input_ids": list(s["input_ids"])} for s in samples[:3]])
    model.eval()
    mixers = state_reset.find_sequence_mixers(model, {"input_ids": probe["input_ids"], "position_ids": probe["position_ids"]})
    assert mixers and all(m.leak > 0 for m in mixers)
    split = state_reset.split_documents(model, mixers)
    exact = packed_row_error(model, samples)
    assert exact <= GRAD_TOL, exact
    assert split.calls > 0
    true_bounds = state_reset.segment_bounds

    def merged(position_ids):  # documents 0 and 1 as one segment: no reset between them
        rows = true_bounds(position_ids)
        return [[(r[0][0], r[1][1])] + r[2:] if len(r) > 1 else r for r in rows]

    monkeypatch.setattr(state_reset, "segment_bounds", merged)
    wrong = packed_row_error(model, samples)
    monkeypatch.setattr(state_reset, "segment_bounds", true_bounds)
    assert split.restore() == sum(len(m.modules) for m in mixers)
    carried = packed_row_error(model, samples)  # inf: transformers refuses the packed row on this path (Qwen3.5)
    assert wrong > GRAD_TOL and carried > GRAD_TOL, (wrong, carried)


def _table():
    import importlib.util

    path = H.REPO_ROOT / "benchmarks" / "hybrid_packing_table.py"
    spec = importlib.util.spec_from_file_location("hybrid_packing_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE_FAMILIES = sorted(_table().FAMILIES)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="the table's tiny configs are written for transformers 5.x (4.57: LFM2 / Bamba above)")
@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_every_hybrid_family_packs_exactly_with_the_split(family):
    """Every hybrid / state-space / linear-attention family of benchmarks/hybrid_packing_table.py (tiny, torch
    fallbacks): stock's packed row leaks (gradient error > 1e-5) and the guard refuses it unsplit; with the measured
    mixers split, the guard passes and the packed row's gradient is within 1e-5 of each document alone."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    table = _table()
    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    row = table.measure(family)
    if "build" in row:
        assert "no AutoModelForCausalLM class" in row["build"], row["build"]  # a text decoder shipped only in a VLM
        pytest.skip(row["build"])
    assert row["stock_grad"] is None or row["stock_grad"] > GRAD_TOL, row
    assert not (row["guard_before"] or {}).get("passed"), row
    assert row.get("mixers"), row
    assert row["guard_after"]["passed"] and row["guard_after"]["leak"] == 0.0, row
    assert row["split_grad"] <= GRAD_TOL, row


# ------------------------------------------------------------------ issue 50 item 12: rows that hold one document
def _split_model(build_fn):
    """A model with its stateful layers split as the packed Trainer installs them (the probe, then the split)."""
    model = build_fn()
    mixers = state_reset.probe_sequence_mixers(model)
    assert mixers, "the probe finds no layer that carries state"
    state_reset.split_documents(model, mixers)
    return model


def _one_document_errors(model, docs: list[list[int]]) -> dict[str, float]:
    """Each way the collator lays out rows that hold one document each (varlen: one row, ``cu_seq_lens = [0, n]``;
    rows: one row, and two rows of one document each), through ``model``: the relative gradient error of the rows'
    token-mean loss against each document alone. A forward that raises is recorded as its error message."""
    from hf_gradfix.packing.collator import PackedCollator

    _table()._zero_dropout(model)
    layouts = {"varlen": [[{"input_ids": docs[0]}]], "rows": [[{"input_ids": docs[0]}]],
               "rows x2": [[{"input_ids": d}] for d in docs[:2]]}
    errors: dict[str, float] = {}
    for name, bins in layouts.items():
        samples = [{"input_ids": b[0]["input_ids"], "labels": b[0]["input_ids"]} for b in bins]
        _, gt = H.ground_truth(model, samples, "causal")
        batch = PackedCollator(mode=name.split()[0])(bins)
        try:
            model.zero_grad(set_to_none=True)
            model.train()
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits.float()
            shifted = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), shifted.flatten(), reduction="sum")
            (loss / (shifted != -100).sum()).backward()
            # every parameter, as the ground truth has them (a layer the rows leave unused has a zero gradient)
            got = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                   for n, p in model.named_parameters() if p.requires_grad}
            model.zero_grad(set_to_none=True)
            errors[name] = H.rel_err(got, gt)
        except ValueError as err:  # transformers' own refusal of the varlen keywords on this path
            model.zero_grad(set_to_none=True)
            errors[name] = f"{type(err).__name__}: {str(err)[:160]}"
    return errors


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="the table's tiny configs are written for transformers 5.x (4.57: LFM2 / Bamba above)")
@pytest.mark.parametrize("family", TABLE_FAMILIES)
def test_rows_of_one_document_train_exactly_on_every_hybrid_family(family):
    """Issue 50 item 12: a packed row holding exactly one document (the last row of an epoch or a stream, every row
    when documents are as long as the budget) reached the split mixers' own forward with the collator's
    ``cu_seq_lens = [0, n]``, and the Gated DeltaNet families' torch fallback refuses any ``cu_seq_lens`` (a
    ``ValueError`` at the first step, on 5.24 and 5.25: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid, lara,
    qwen4_exp). Every table family, split as training splits it: each one-document layout within 1e-5 of the document
    alone. Run by hand on the newest transformers too (``/work/venv-latest``, see docs/testing.md)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    table = _table()
    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    try:
        model = _split_model(lambda: table.build(family))
    except LookupError as err:  # a text decoder shipped only in a VLM (no causal-LM class)
        pytest.skip(str(err))
    model.float()
    errors = _one_document_errors(model, table.documents((13, 13), 1))
    assert all(isinstance(e, float) and e <= GRAD_TOL for e in errors.values()), errors


def test_control_one_document_rows_without_the_fix_crash_and_the_guard_refuses_them(monkeypatch):
    """The control of the test above: the one-document call undone (the varlen keywords handed on, as before), Qwen3.5's
    one-document row raises again, and the guard, which now probes a one-document row, refuses the model before any
    step in one line instead of the crash at the first step; with the fix the guard passes."""
    if not _has("qwen3_5"):
        pytest.skip("this transformers has no Qwen3.5")
    model = _split_model(lambda: build("qwen3_5"))
    assert check_model_packs_correctly(model, token_budget=BUDGET).passed
    monkeypatch.setattr(state_reset, "_one_document_call", lambda forward, args, kwargs: forward(*args, **kwargs))
    errors = _one_document_errors(model, [list(range(4, 17)), list(range(20, 33))])
    assert isinstance(errors["varlen"], str) and "chunk_gated_delta_rule" in errors["varlen"], errors
    with pytest.raises(PackingCheckError) as err:
        check_model_packs_correctly(model, token_budget=BUDGET)
    message = str(err.value)
    assert "\n" not in message and "a packed row holding one document" in message, message


@families
@pytest.mark.parametrize("source", ["map", "stream"])
def test_trainer_rows_of_one_document_and_the_last_row_train_exactly(family, source, tmp_path):
    """Issue 50 item 12 through the Trainer: documents of 60-63 tokens at a budget of 64 (every row one document), then
    short documents with one long one that no other fits beside (map-style: one one-document row among several-document
    rows; a stream whose last row holds one document alone). Every window within 1e-5 of
    each document alone (before: Qwen3.5 raised at the first step)."""
    import test_packing_stream as S

    model = build(family)
    if source == "map":
        runs = [H.make_samples("causal", n=4, seed=0, lo=60, hi=63),
                H.make_samples("causal", n=7, seed=2, lo=5, hi=30) + H.make_samples("causal", n=1, seed=3, lo=60, hi=60)]
    else:
        # best-fit-decreasing: [50, 14], [32, 32], and 45 alone, the emptiest row, which the stream hands out last
        runs = [[H.make_samples("causal", n=1, seed=k, lo=n, hi=n)[0] for k, n in enumerate((50, 14, 32, 32, 45))]]
    for samples in runs:
        hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "buffer_size": 16}})
        try:
            if source == "map":
                trainer, grads = _train(model, samples, ga=2)
                windows = [[[samples[i] for i in b] for b in w] for w in _windows(samples, 2)]
            else:
                stream = S.TorchStream(samples)
                windows = S._epoch_windows(stream, 2, epochs=1)
                capture = H.GradCapture()
                init = {k: v.clone() for k, v in model.state_dict().items()}
                trainer = transformers.Trainer(model=model, args=S._args(tmp_path, max_steps=len(windows)),
                                               train_dataset=stream, callbacks=[capture])
                trainer.train()
                model.load_state_dict(init)
                grads = capture.grads
        except PackingCheckError as err:  # measured: this release's model does not run the packed path at all
            assert "\n" not in str(err) and str(err).startswith(type(model).__name__), err
            pytest.skip(f"{family} on transformers {transformers.__version__}: refused before any step ({str(err)[:160]})")
        finally:
            hf_gradfix.unpatch()
        rows = [row for w in windows for row in w]
        assert any(len(row) == 1 for row in rows), [len(r) for r in rows]
        if source == "stream":
            assert len(rows[-1]) == 1, [len(r) for r in rows]  # the stream's last row
        assert len(grads) == len(windows)
        for k, (window, g) in enumerate(zip(windows, grads)):
            _, gt = H.ground_truth(model, [s for row in window for s in row], "causal")
            assert H.rel_err(g, gt) <= GRAD_TOL, f"{family} {source} step {k}: {H.rel_err(g, gt):.3e}"
    model._hf_gradfix_document_split.restore()
