"""torch's own varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``) as a packing path.

The kernel itself needs CUDA (and is exercised by ``scripts/gpu_check.sh`` on the GPU machine). Here, on CPU, a
stand-in with ``varlen_attn``'s exact signature and semantics (:func:`reference_varlen_attn`, which also refuses GQA
without ``enable_gqa`` as torch does) is substituted, so the argument mapping (scale, causal + sliding windows as
``window_size=(left, 0)``, GQA with and without ``enable_gqa``), the fallbacks, the registration, the Trainer's
choice and the guard run for real; the ground truth is each sequence alone on fp32 eager attention.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

import harness as H
from hf_gradfix.packing import attention as A
from hf_gradfix.torch_private import varlen_attention

sys.path.insert(0, str(H.REPO_ROOT / "benchmarks"))
G = importlib.import_module("gpu_check")
SMALL = dict(lengths=(13, 29, 5, 21), config_kw=dict(hidden=64, heads=2, window=8))
FP = (torch.float32, torch.float64, torch.bfloat16)


def standin(enable_gqa: bool, fn=A.reference_varlen_attn) -> A.TorchVarlenKernel:
    return A.TorchVarlenKernel(fn, enable_gqa=enable_gqa, device_types=("cpu",), dtypes=FP)


def test_torch_here_has_varlen_attn_with_the_keywords_packing_passes():
    found = varlen_attention()
    assert found.fn is not None, found.why  # torch 2.13 (the suite's torch) has scale, window_size, enable_gqa
    assert found.enable_gqa and "varlen_attn" in found.why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA only; this machine has "
                    "none (scripts/gpu_check.sh runs it on the GPU machine)")
def test_the_real_kernel_matches_the_reference_on_cuda():  # pragma: no cover - CPU CI
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 64, generator=g).cuda().bfloat16() for h in (4, 2, 2))
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32, device="cuda")
    for window in ((-1, -1), (5, 5)):
        out = A.torch_flash_attn_varlen_func(q, k, v, cu, cu, 23, 23, causal=True, window_size=window)
        ref = A.reference_flash_attn_varlen_func(q.float(), k.float(), v.float(), cu, cu, 23, 23, causal=True,
                                                 window_size=window)
        assert (out.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("enable_gqa", [True, False])
@pytest.mark.parametrize("case", ["causal", "causal-window", "window-no-causal", "full"])
def test_flash_attn_arguments_map_onto_varlen_attn(enable_gqa, case):
    """flash-attn's (softmax_scale, causal, window_size) -> varlen_attn's (scale, window_size=(left, 0)), GQA by
    enable_gqa or by repeating K/V heads (torch 2.11): same result as the flash-attn-semantics reference."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(31, 4, 8, generator=g), torch.randn(31, 2, 8, generator=g), torch.randn(31, 2, 8, generator=g)
    cu = torch.tensor([0, 5, 17, 31], dtype=torch.int32)
    kw = dict(causal=case.startswith("causal"), window_size={"causal": (-1, -1), "causal-window": (3, 3),
                                                               "window-no-causal": (2, 4), "full": (-1, -1)}[case])
    seen = []

    def recording(*args, **options):
        seen.append(options)
        return A.reference_varlen_attn(*args, **options)

    A.reset_torch_varlen_counts()
    with A.use_torch_varlen_kernel(standin(enable_gqa, recording)):
        out = A.torch_flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, softmax_scale=0.3, **kw)
    ref = A.reference_flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, softmax_scale=0.3, **kw)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    assert A.torch_varlen_counts() == {"kernel": 1}
    left, right = kw["window_size"]
    assert seen[0]["scale"] == 0.3 and seen[0]["window_size"] == (left, 0 if kw["causal"] else right)
    assert seen[0].get("enable_gqa", False) is enable_gqa


def test_what_the_kernel_lacks_runs_on_the_reference_with_one_warning(caplog):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(12, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    A.reset_torch_varlen_counts()
    with A.use_torch_varlen_kernel(standin(True)), caplog.at_level(logging.WARNING, logger="hf_gradfix"):
        for _ in range(2):
            out = A.torch_flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, softcap=2.0)
        assert torch.equal(out, A.reference_flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, softcap=2.0))
        A.torch_flash_attn_varlen_func(q.double(), k.double(), v.double(), cu, cu, 7, 7, causal=True)
        A.torch_flash_attn_varlen_func(q.half(), k.half(), v.half(), cu, cu, 7, 7, causal=True)  # fp16 not in FP
    counts = A.torch_varlen_counts()
    assert counts.pop("kernel") == 1  # only the float64 call
    assert [k.split(" (")[0] for k in counts] == ["attention logit softcapping", "torch.float16 inputs"]
    assert list(counts.values()) == [2, 1]
    warnings = [r.getMessage() for r in caplog.records if "varlen FlashAttention cannot" in r.getMessage()]
    assert len(warnings) == 2  # once per reason


def test_the_real_kernel_is_not_called_on_cpu_tensors():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    A.reset_torch_varlen_counts()
    out = A.torch_flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True)  # the real kernel: CUDA only
    assert torch.equal(out, A.reference_flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True))
    assert list(A.torch_varlen_counts()) == ["cpu tensors (the kernel runs on cuda)"]


def test_selection_order_flash_attn_then_torch_then_reference(monkeypatch):
    assert A.select_varlen_attention("cpu") == A.REFERENCE_VARLEN_ATTENTION
    monkeypatch.setattr(A, "_flash_attn_2_usable", lambda device: False)
    monkeypatch.setattr(A, "_torch_varlen_usable", lambda device: True)  # a CUDA machine without flash-attn
    assert A.select_varlen_attention("cuda") == A.TORCH_VARLEN_ATTENTION
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping[A.TORCH_VARLEN_ATTENTION] is A.torch_varlen_attention_forward
    monkeypatch.setattr(A, "_flash_attn_2_usable", lambda device: True)
    assert A.select_varlen_attention("cuda") == "flash_attention_2"


def test_torch_varlen_needs_cuda_and_the_kernel():
    assert not A._torch_varlen_usable("cpu")
    if not torch.cuda.is_available():
        assert not A._torch_varlen_usable(None)


@pytest.mark.parametrize("arch", G.ARCHS)
def test_models_pack_exactly_through_the_torch_path(arch):
    """Llama, Qwen2 (window on layer 1), Mistral (window), Gemma 2 (window + softcap): packed vs separate through
    torch_varlen_attention_forward on the stand-in, fp32, against fp32 eager per sequence (<= 1e-5)."""
    with A.use_torch_varlen_kernel(standin(enable_gqa=False)):
        r = G.packed_vs_separate(arch, A.TORCH_VARLEN_ATTENTION, torch.float32, "cpu", **SMALL)
    assert r["passed"], r["why"]
    assert r["logits"]["control"] > 1e-2
    assert r["reference_branches"] == {"cu_seq_lens": 2}
    if arch == "gemma2":  # softcap: the reference computes it
        assert set(r["torch_varlen_calls"]) == {"attention logit softcapping (torch's varlen kernel has no softcap; "
                                               "flash-attn 2 has)"}
    else:
        assert r["torch_varlen_calls"] == {"kernel": 2}


def test_a_kernel_that_drops_the_window_is_caught():
    """The exactness check can fail on this path: a kernel that ignores window_size mixes far tokens in Mistral."""
    def no_window(*args, window_size=(-1, -1), **options):
        return A.reference_varlen_attn(*args, window_size=(-1, 0), **options)

    with A.use_torch_varlen_kernel(standin(True, no_window)):
        r = G.packed_vs_separate("mistral", A.TORCH_VARLEN_ATTENTION, torch.float32, "cpu", **SMALL)
    assert not r["passed"] and r["logits"]["packed"] > 1e-3


def test_autocast_casts_fp32_queries_as_transformers_flash_path_does():
    """Under autocast RoPE's fp32 cos/sin promote the query to fp32; the kernel gets the autocast dtype."""
    import types

    dtypes = []

    def recording(q, k, v, *args, **options):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return A.reference_varlen_attn(q, k, v, *args, **options)

    q = torch.randn(1, 2, 6, 8)
    kv = torch.randn(1, 2, 6, 8).bfloat16()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with A.use_torch_varlen_kernel(standin(True, recording)), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = A.torch_varlen_attention_forward(types.SimpleNamespace(is_causal=True), q, kv, kv, None,
                                                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    assert dtypes == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16


def test_guard_and_packed_trainer_on_the_torch_path():
    """What a CUDA machine without flash-attn runs, on CPU: the packed Trainer picks torch's path (selection forced),
    the guard passes on it, and every step's gradient matches the unpacked ground truth (<= 1e-5)."""
    from unittest import mock

    from hf_gradfix.packing.guard import check_model_packs_correctly

    with A.use_torch_varlen_kernel(standin(True)), \
            mock.patch.object(A, "_torch_varlen_usable", lambda device: True):
        model = H.build_model("llama", attn_implementation="sdpa")
        report = check_model_packs_correctly(model, attn_implementation=A.TORCH_VARLEN_ATTENTION)
        assert report.passed and report.attn_implementation == A.TORCH_VARLEN_ATTENTION
        A.reset_torch_varlen_counts()
        r = G.packed_trainer_vs_ground_truth("cpu", "auto")
    assert r["attention"] == A.TORCH_VARLEN_ATTENTION and r["passed"], r["why"]
    assert A.torch_varlen_counts().get("kernel", 0) > 0 and set(A.torch_varlen_counts()) == {"kernel"}
