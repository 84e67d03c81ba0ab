"""The loss fix on vision-language models, per family, GA 2 on 2 gloo processes, against a float64 ground truth.

Families (``tests/support/vlm.py``): Qwen2.5-VL (``accepts_loss_kwargs=False``, mRoPE, flattened patches), Gemma 3
(bidirectional image mask, ``token_type_ids``), Idefics3 (SmolVLM's ancestor: per-sample tile stacks, image
splitting), LLaVA (CLIP tower). Every window (bs 2 x GA 2 x 2 ranks = 8 samples) mixes samples with 0, 1 and
several images of different sizes, and holds a text-only micro-batch. Paths: ``transformers.Trainer`` over the
real processors' per-sample outputs (vision tower trained, and frozen), and TRL's ``SFTTrainer`` vision path (its
``DataCollatorForVisionLanguageModeling``: assistant-only masks from the chat template's generation markers, and
prompt-completion with completion-only loss).

Ground truth (``vlm_loss.ground_truth``): each sample alone in float64, the loss sums added, divided by the window's
total target count over both ranks and both micro-batches. The patched gradient (every trainable parameter, the
vision tower's and projector's included) and the logged loss must be within 1e-5. Stock's error is measured beside
it: where stock transformers does not pass the count or the loss does not honour it (measured), stock must show a
large error (the control); where it does, stock must be exact too (then the patched run must not break it).

One launch of 2 processes trains every case (a launch costs ~10-20 s of imports and rendezvous on 2 cores).
"""

from __future__ import annotations

import pytest

import vlm
import vlm_loss as VL

pytestmark = pytest.mark.distributed

TOL = 1e-5
STOCK_BIASED = 1e-3  # the mean-of-means error of stock on these windows is percents; 1e-3 is far above fp32 noise


@pytest.fixture(scope="module")
def rows():
    runs = VL.launch()
    processors = {fam: vlm.build_processor(fam) for fam in vlm.FAMILIES}
    cache: dict = {}
    rows = {case: VL.compare(case, runs[case], processors[VL.parse(case)[1]], cache) for case in runs}
    print("seconds per case (rank 0):", {case: round(r[0]["seconds"] or 0, 1) for case, r in rows.items()})
    return rows


@pytest.fixture(scope="module")
def honours():
    return {fam: VL.loss_honours_count(fam) for fam in vlm.FAMILIES}


def _assert_exact(case_rows, what):
    assert [r["n_samples"] for r in case_rows] == [8, 4], f"{what}: expected a full and a partial window: {case_rows}"
    for r in case_rows:
        assert r["n_samples"] in (8, 4) and r["images"] > 0  # a full window, then a partial one
        assert r["rel_err"] <= TOL, f"{what} window {r['step']}: gradient rel err {r['rel_err']:.3e}"
        assert r["vision_params"] > 0 and r["vision_rel_err"] <= TOL, (
            f"{what} window {r['step']}: vision tower / projector rel err {r['vision_rel_err']}")
        assert r["text_rel_err"] <= TOL, f"{what} window {r['step']}: language model rel err {r['text_rel_err']:.3e}"
        assert r["loss_rel_err"] is not None and r["loss_rel_err"] <= TOL, f"{what} window {r['step']}: {r}"
        assert r["rank_grad_max_diff"] == 0.0
        # the planted bug (each micro-batch's own mean, averaged: ground_truth's biased_grads) is far outside the
        # tolerance on this window
        assert r["mean_of_means_rel_err"] > STOCK_BIASED, f"{what} window {r['step']}: {r}"


def _stock_verdict(case_rows, passes_count: bool, loss_honours: bool, what: str):
    errs = [r["rel_err"] for r in case_rows]
    print(f"{what}: stock passes the count {passes_count}, the loss honours it {loss_honours}; stock errors {errs}")
    if passes_count and loss_honours:
        assert max(errs) <= TOL, f"{what}: stock was expected exact (it passes the count the loss honours): {errs}"
    else:
        assert min(errs) > STOCK_BIASED, f"{what}: stock should be biased here, the control did not fail: {errs}"


@pytest.mark.parametrize("family", VL.TRAINER_FAMILIES)
def test_trainer_patched_is_exact_tower_trained(family, rows):
    case_rows = rows[f"trainer:{family}:patched:trained"]
    _assert_exact(case_rows, f"Trainer {family}")
    if family == "qwen2_5_vl":  # video frames too (vlm.add_video: the video processor needs torchvision)
        assert case_rows[0]["videos"] == 2


@pytest.mark.parametrize("family", VL.TRAINER_FAMILIES)
def test_trainer_patched_is_exact_tower_frozen(family, rows):
    case_rows = rows[f"trainer:{family}:patched:frozen"]
    _assert_exact(case_rows, f"Trainer {family} frozen tower")
    trained = rows[f"trainer:{family}:patched:trained"][0]["vision_params"]
    assert 0 < case_rows[0]["vision_params"] < trained  # the projector trains, the tower does not


@pytest.mark.parametrize("family", VL.TRAINER_FAMILIES)
def test_trainer_stock_control(family, rows, honours):
    case_rows = rows[f"trainer:{family}:stock:trained"]
    _stock_verdict(case_rows, bool(case_rows[0]["accepts_loss_kwargs"]), honours[family], f"stock Trainer {family}")


@pytest.mark.parametrize("path,family", [("trl", f) for f in VL.TRL_FAMILIES] + [("trlpc", f) for f in VL.TRLPC_FAMILIES])
def test_trl_sft_vision_patched_is_exact(path, family, rows):
    _assert_exact(rows[f"{path}:{family}:patched:trained"], f"SFTTrainer ({path}) {family}")


@pytest.mark.parametrize("path,family", [("trl", f) for f in VL.TRL_FAMILIES] + [("trlpc", f) for f in VL.TRLPC_FAMILIES])
def test_trl_sft_vision_stock_control(path, family, rows):
    """TRL's SFTTrainer computes its loss itself as sum / num_items_in_batch when the Trainer passes a count (only
    with ``model_accepts_loss_kwargs``), so whether stock is exact hangs on the flag alone (measured in the run)."""
    case_rows = rows[f"{path}:{family}:stock:trained"]
    _stock_verdict(case_rows, bool(case_rows[0]["accepts_loss_kwargs"]), True, f"stock SFTTrainer ({path}) {family}")


def test_windows_mix_image_counts_and_sizes():
    """What every window holds (the premise of the tests above): samples with 0, 1 and several images, images of
    different sizes within one sample, a micro-batch without any image."""
    samples = VL.samples_for("trainer", "qwen2_5_vl")
    counts = [len(s["images"]) for s in samples]
    assert {0, 1} <= set(counts) and max(counts) >= 3
    assert any(len({im.size for im in s["images"]}) >= 2 for s in samples)
    pairs = [counts[i : i + VL.BS] for i in range(0, len(counts), VL.BS)]
    assert [0, 0] in pairs


def test_trl_padding_free_on_vision_data_does_not_run_stock(tmp_path):
    """Stock TRL's padding-free path for vision data, the other stock error the issue asks for beside the padded one:
    measured, TRL 1.16 refuses it before training (so there is no stock padding-free error to report). If a TRL
    release lifts the ban (trl#7081), this fails: its error must then be measured in vlm_loss like the padded one."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    family = "llava"
    args = SFTConfig(output_dir=str(tmp_path), padding_free=True, use_cpu=True, report_to="none", bf16=False,
                     per_device_train_batch_size=2, max_length=None)
    data = datasets.Dataset.from_list([{k: v for k, v in s.items() if k != "idx"}
                                       for s in vlm.make_samples(family, 2, counts=(1, 2))])
    with pytest.raises(ValueError, match="(?i)padding-free.*vision"):
        SFTTrainer(model=vlm.build_vlm(family), args=args, train_dataset=data,
                   processing_class=vlm.build_processor(family))
