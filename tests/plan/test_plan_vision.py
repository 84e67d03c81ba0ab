"""hf-gradfix plan on a vision-language model (hf_gradfix/plan/vision.py, issue 52 item 5): the vision tower's
activations and the image tokens of a row, against a real CPU step.

Ground truth: a tiny-but-not-trivial Qwen2.5-VL (4 vision blocks with window and full attention, 2 decoder layers)
runs one real forward + backward in fp32 with 2 images of 112x168 per sample, 2 samples; saved-tensor hooks count
every distinct storage autograd saves (parameters excluded), attributed to the vision tower while it runs. The
image tokens per image come from transformers' own Qwen2-VL image processor on a real image of that size. The
planner's numbers come from fake tensors (it never runs the step)."""

from __future__ import annotations

import pytest
import torch

from hf_gradfix.parallel import ParallelDims
from hf_gradfix.plan import PlanError, Settings, estimate
from hf_gradfix.plan.command import plan_main
from hf_gradfix.plan.vision import VisionRun, parse_image_size

transformers = pytest.importorskip("transformers")

IMAGE, VSTART, VEND = 497, 496, 495
H, W, N_IMAGES, ROWS, SEQ = 112, 168, 2, 2, 128


def qwen_vl_config():
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=500,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "rope_type": "default"})
    vision = dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                  fullatt_block_indexes=[3], window_size=56, patch_size=14, spatial_merge_size=2)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0, image_token_id=IMAGE, vision_start_token_id=VSTART,
                                         vision_end_token_id=VEND, video_token_id=494)


def processor_tokens_per_image(height, width) -> int:
    """Image tokens of one height x width image, as transformers' Qwen2-VL image processor lays it out."""
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28,
                                 max_pixels=4096 * 28 * 28)
    image = (torch.rand(3, height, width) * 255).to(torch.uint8)
    grid = proc(images=[image], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // 4, grid


@pytest.fixture(scope="module")
def measured():
    """One real fp32 step: the bytes autograd saves inside the vision tower, and in the whole step."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    config = qwen_vl_config()
    config._attn_implementation = "sdpa"
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).train()
    k, grid = processor_tokens_per_image(H, W)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        ids = []
        for _ in range(N_IMAGES):
            ids += [VSTART] + [IMAGE] * k + [VEND]
        ids += torch.randint(3, 490, (SEQ - len(ids),), generator=g).tolist()
        rows.append(ids)
    input_ids = torch.tensor(rows)
    grids = grid.repeat(ROWS * N_IMAGES, 1)
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    params |= {StorageWeakRef(b.untyped_storage()) for b in model.buffers()}
    seen, where, counts = set(), {"vision": False}, {"vision": 0, "all": 0}

    def pack(t):
        w = StorageWeakRef(t.untyped_storage())
        if w in params or w in seen:
            return t
        seen.add(w)
        counts["all"] += t.untyped_storage().nbytes()
        if where["vision"]:
            counts["vision"] += t.untyped_storage().nbytes()
        return t

    tower = model.model.visual
    tower.register_forward_pre_hook(lambda m, a: where.__setitem__("vision", True))
    tower.register_forward_hook(lambda m, a, o: where.__setitem__("vision", False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grids, labels=input_ids)
    out.loss.backward()
    assert all(p.grad is not None for p in tower.parameters())  # the tower trained: its activations were needed
    return {"vision": counts["vision"], "all": counts["all"], "tokens_per_image": k, "config": config}


def _plan(config, vision=True, **kw):
    s = Settings(seq_len=SEQ, micro_batch=ROWS, dtype="fp32",
                 vision=VisionRun(H, W, N_IMAGES) if vision else None, **kw)
    return estimate(config, ParallelDims(1), s)


def test_vision_activations_match_a_real_step(measured):
    plan = _plan(measured["config"])
    vis = plan.extra["vision"]
    assert vis["images"] == ROWS * N_IMAGES
    # the planner's vision term (fake tensors) against the bytes the real step's tower saved
    err = abs(vis["bytes"] - measured["vision"]) / measured["vision"]
    print("vision bytes planned", vis["bytes"], "measured", measured["vision"], "of", measured["all"], "err", err)
    assert err <= 0.10, (vis["bytes"], measured["vision"], err)
    # the image tokens per image: the model's own feature rows, as the image processor expands an image
    assert vis["tokens_per_image"] == measured["tokens_per_image"]
    # control: the tower is a large share of the step's saved tensors here, so a plan without it is far off
    no_vision = _plan(measured["config"], vision=False)
    missed = plan.activations_no_recompute - no_vision.activations_no_recompute
    assert missed == pytest.approx(vis["bytes"])
    assert measured["vision"] / measured["all"] > 0.25, measured
    assert abs(0 - measured["vision"]) / measured["vision"] > 0.9  # the text-only plan counts none of it


def test_full_recompute_keeps_block_inputs(measured):
    full = _plan(measured["config"], recompute="full").extra["vision"]
    none = _plan(measured["config"]).extra["vision"]
    assert 0 < full["bytes"] < none["bytes"]


def test_image_tokens_bound_the_row_and_packing_counts_images(measured):
    config = measured["config"]
    k = measured["tokens_per_image"]
    with pytest.raises(PlanError, match=r"--images-per-sample 8 --image-size 112x168: .* exceed the row of 128 tokens"):
        estimate(config, ParallelDims(1), Settings(seq_len=SEQ, micro_batch=1, dtype="fp32",
                                                     vision=VisionRun(H, W, 8)))
    packed = estimate(config, ParallelDims(1), Settings(seq_len=SEQ, micro_batch=1, dtype="fp32", packing=True,
                                                        vision=VisionRun(H, W, 1, text_len=8))).extra["vision"]
    assert packed["samples_per_row"] == SEQ // (k + 8)
    assert packed["images"] == SEQ // (k + 8)


def test_bad_values_one_line(capsys):
    with pytest.raises(PlanError, match=r"^--image-size '12y4': invalid value; give HEIGHTxWIDTH"):
        parse_image_size("12y4")
    with pytest.raises(PlanError, match=r"^--images-per-sample -1: invalid value; it must be a whole number"):
        VisionRun(10, 10, -1).check()
    assert plan_main(["--model", "tiny-llama", "--images-per-sample", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--images-per-sample 2: needs --image-size HEIGHTxWIDTH (the images' size); add it, or "
                            "drop --images-per-sample"), err
    assert plan_main(["--model", "tiny-llama", "--image-size", "448x448"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "LlamaConfig has no vision tower" in err[-1], err


def test_fixed_resolution_tower_llava():
    """A per-image family (LLaVA, CLIP tower at its own 112x112): any image size is resized to the tower's, the
    image tokens are its patches (the CLS row dropped by the default feature selection), and the planned saved bytes
    of tower + projector match a real fp32 step's."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from hf_gradfix.plan.vision import trace_vision

    vc = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, image_size=112, patch_size=14)
    tc = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=500)
    config = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE, vision_feature_layer=-2)
    planned = trace_vision(config, images=4, height=300, width=200, dtype="fp32")
    assert planned.tower_size == (112, 112) and planned.tokens_per_image == (112 // 14) ** 2

    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = transformers.LlavaForConditionalGeneration(config).train()
    ids = torch.tensor([[IMAGE] * 64 * 2 + [5] * 20] * 2)
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen, state = set(), {"on": False, "bytes": 0}

    def pack(t):
        w = StorageWeakRef(t.untyped_storage())
        if w not in params and w not in seen:
            seen.add(w)
            state["bytes"] += t.untyped_storage().nbytes() if state["on"] else 0
        return t

    inner = model.model.get_image_features

    def image_features(*a, **kw):  # the model's own image path (tower + projector), as the planner traces it
        state["on"] = True
        try:
            return inner(*a, **kw)
        finally:
            state["on"] = False

    model.model.get_image_features = image_features
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, pixel_values=torch.randn(4, 3, 112, 112), labels=ids)
    out.loss.backward()
    assert abs(planned.saved - state["bytes"]) / state["bytes"] <= 0.10, (planned.saved, state["bytes"])


def test_an_image_path_that_cannot_be_traced_is_one_line():
    """Idefics3 (per-sample image stacks; its image path drops padding images by a data-dependent mask): refused in
    one line naming the config class and the fix, not a traceback."""
    import vlm as V

    config = V.build_vlm("idefics3").config
    with pytest.raises(PlanError) as err:
        estimate(config, ParallelDims(1), Settings(seq_len=64, micro_batch=1, dtype="fp32",
                                                   vision=VisionRun(64, 64, 1)))
    line = str(err.value)
    assert "\n" not in line and line.startswith("Idefics3Config: its image path") and "plan without --image-size" in line
