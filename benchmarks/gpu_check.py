"""The CUDA paths, proven in one run on the lent GPU machine (offline): FlashAttention packing through torch's own
varlen kernel (and flash-attn 2 where installed), half precision, the guard, throughput, memory.

    bash scripts/gpu_check.sh                  # --profile full: every section, in order of value, ~5.5 min on an H100
    bash scripts/gpu_check.sh --profile rerun  # the smaller second call (quick sizes, ~2.5 min)
    python benchmarks/gpu_check.py --device cpu --only guard --quick   # the logic on CPU (what the tests run)

Without CUDA it prints one line (``gpu_check: skipped: ...``) and exits 0 without writing anything, so a CPU
machine never overwrites results a GPU produced. Every measurement is a function that also runs on CPU (the
reference varlen kernel, or a stand-in for torch's kernel, fp32, tiny sizes); ``tests/project/test_gpu_check.py`` runs them.
With ``--out-dir`` the results (``gpu-check.md``, ``gpu-check.json``) are rewritten after every section, and every
section has a time budget (``PROFILES``): a section stopped at its budget keeps the rows it finished.

Sections, in the order they run (each a row of the results table, ``passed`` / ``FAILED`` / ``measured`` /
``timeout`` / ``skipped: why``):

1. **packing**: packed-vs-separate logits and gradients through torch's varlen kernel (``flash_varlen_torch``,
   bf16 and fp16), ``flash_attention_2`` where installed (bf16 and fp16), and the reference varlen kernel (fp32),
   on Llama, Qwen2 (sliding window on layer 1), Mistral (sliding window) and Gemma 2 (sliding window + attention
   softcap + final softcap: torch's kernel has no softcap, so those calls run on the reference kernel, counted in
   ``torch_varlen_calls``). Tolerances: see :func:`half_precision_verdict`.
2. **guard**: ``check_model_packs_correctly`` on CUDA accepts torch's kernel / FA2 / the reference and refuses a model planted to mix packed sequences (all-ones mask).
3. **trainer**: ``hf_gradfix.patch(packing)`` + ``transformers.Trainer`` on CUDA against the unpacked ground truth
   of the windows the sampler drew (``tests/support/harness.py``): bf16 autocast through what the Trainer picks ("auto":
   FA2, else torch's kernel; half-precision rule), and fp32 through the reference kernel (<= 1e-5).
4. **throughput**: real tokens/s over one epoch of the same samples: padded batches vs hf_gradfix packing vs TRL's
   padding-free collator (through FA2, else torch's kernel), against the padding-waste limit 1 / (1 - waste).
5. **plan**: ``hf-gradfix plan`` (closed form; ``--simulate`` with ``--plan-trace``) against
   ``torch.cuda.max_memory_allocated`` of the same step (a Llama-3.2-1B-shaped model), per component.
6. **lean**: ``loss.head: lean`` beside the stock head, one training step per cell (8k / 32k tokens, 32k / 128k /
   152k vocabulary, bf16 autocast and fp32): ``torch.cuda.max_memory_allocated`` above the step's start, time, and
   the head's gradient against the stock head's.
7. **optim**: ``opt.step()`` time and memory of AdamW, galore-torch, our GaLore (svd / randomized), APOLLO and
   APOLLO-Mini on 7B-shaped layers (hidden 4096, intermediate 11008): the low-rank state's memory.
8. **vlm**: a tiny Qwen2.5-VL (``tests/support/vlm.py``) packed by ``MultimodalPackedCollator`` vs each document
   alone, against fp32 eager alone on the same weights: fp32 sdpa (<= 1e-5), bf16 sdpa and bf16 ``flash_attention_2``
   (varlen, where flash-attn imports) by :func:`half_precision_verdict`; then packed vs padded real tokens/s with
   ``benchmarks/bench_vlm_packing.py``'s model, samples and loop (bf16, FA2 else sdpa).

Not provable on one GPU (said in the results file): multi-rank DDP / FSDP2 / TP / CP exactness over NCCL, the
rank-balanced packed sampler across ranks, FSDP2 all-gather memory. Those are proven on CPU over gloo only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "tests" / "support", REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
__import__("suite_paths").add()  # the rooms' test modules (tests/support/suite_paths.py)

DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu-check.md"
SECTIONS = ("packing", "guard", "trainer", "throughput", "plan", "lean", "hybrid", "optim", "vlm")  # in order of value
FP32_TOL = 1e-5  # relative error, fp32 (the project's exactness bar)
HALF_FACTOR = 2.0  # packed half-precision error may be at most this multiple of the unpacked run's error
CONTROL_FACTOR = 10.0  # sequence mixing must be at least this multiple of the unpacked error (the check can fail)
NOT_PROVABLE_ON_ONE_GPU = [
    "DDP / FSDP2 / TP / CP exactness across ranks over NCCL (world size 1 has no cross-rank sums; proven over gloo "
    "on CPU by tests/parallel/test_ddp.py, test_nd_parallel.py, test_optim_distributed.py)",
    "the packed sampler's token balance across ranks and the per-rank count all-reduce (gloo tests only)",
    "FSDP2 all-gather / reduce-scatter buffer memory against the planner's comm_buffers (needs >= 2 GPUs)",
    "throughput scaling and communication overlap (the --suggest roofline is a model, not a measurement)",
]


def skip_reason() -> str | None:
    """Why this machine cannot run the check (``None`` when CUDA works).

    >>> skip_reason() is None or skip_reason().startswith("no CUDA")
    True
    """
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda})"
    return None


def flash_attn_status() -> tuple[bool, str]:
    """(usable, one line): flash-attn importable, transformers agrees, CUDA present."""
    try:
        import flash_attn  # noqa: F401

        version = getattr(flash_attn, "__version__", "?")
    except Exception as e:  # ImportError, or an ABI mismatch raising OSError/RuntimeError
        return False, f"flash-attn not importable ({type(e).__name__}: {str(e)[:120]})"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return False, f"flash-attn {version} installed but transformers' is_flash_attn_2_available() is False"
    if not torch.cuda.is_available():
        return False, f"flash-attn {version} installed but no CUDA"
    return True, f"flash-attn {version}"


def torch_varlen_status(device: str) -> tuple[bool, str]:
    """(usable on ``device``, one line): torch's own varlen FlashAttention (``torch_private.varlen_attention``), or a
    kernel a test substituted (``use_torch_varlen_kernel``); on CUDA a device of compute capability >= 8.0."""
    from hf_gradfix.packing.attention import _KERNEL_OVERRIDE, torch_varlen_kernel
    from hf_gradfix.torch_private import varlen_attention

    kernel = torch_varlen_kernel()
    if kernel is None:
        return False, varlen_attention().why
    line = "substituted kernel" if _KERNEL_OVERRIDE else varlen_attention().why
    dev = torch.device(device)
    if dev.type not in kernel.device_types:
        return False, f"{line}: runs on {'/'.join(kernel.device_types)}, not {dev.type}"
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev.index)[0] < 8:
        return False, f"{line}: needs compute capability >= 8.0"
    return True, line


def import_galore_torch() -> tuple[bool, str]:
    """(importable, one line). galore-torch 1.0's ``__init__`` imports its 8-bit optimizer, hence bitsandbytes
    (a 60+ MB wheel with CUDA libraries, too large to carry to the offline GPU machine); the check uses only
    ``GaLoreAdamW``, so where bitsandbytes is missing the package's modules are loaded without its ``__init__``."""
    import importlib.util
    import types

    try:
        import galore_torch  # noqa: F401

        return True, "galore-torch"
    except ModuleNotFoundError as e:
        if e.name != "bitsandbytes":
            return False, f"galore-torch not installed ({e.name} missing)"
    except Exception as e:
        return False, f"galore-torch does not import ({type(e).__name__}: {str(e)[:120]})"
    sys.modules.pop("galore_torch", None)
    spec = importlib.util.find_spec("galore_torch")
    package = types.ModuleType("galore_torch")
    package.__path__ = list(spec.submodule_search_locations)  # a package without running its __init__
    sys.modules["galore_torch"] = package
    try:
        package.GaLoreAdamW = importlib.import_module("galore_torch.adamw").AdamW
    except Exception as e:
        sys.modules.pop("galore_torch", None)
        return False, f"galore-torch's GaLoreAdamW does not import ({type(e).__name__}: {str(e)[:120]})"
    return True, "galore-torch (GaLoreAdamW only: bitsandbytes absent)"


# ---------------------------------------------------------------------------------------------- metrics
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64.

    >>> rel(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    """
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1).to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_grads(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Relative error of all gradients concatenated (the harness's ``rel_err``, on any device)."""
    from harness import rel_err

    return rel_err({k: v.detach().cpu() for k, v in g.items()}, {k: v.detach().cpu() for k, v in ref.items()})


def half_precision_verdict(packed_err: float, separate_err: float, control_err: float | None,
                           dtype: torch.dtype) -> tuple[bool, str]:
    """Is a packed run exact up to its dtype? Errors are relative to an fp32 ground truth of separate sequences.

    fp32 / fp64: ``packed_err <= max(1e-5, 2 * separate_err)`` against an fp64 ground truth (bit-level
    exactness is not asked; 1e-5 fails on any mixing; ``2 * separate_err`` only where the device's own fp32
    rounding on each sequence alone is above 5e-6, as cuBLAS's is on an H100).

    bf16 / fp16 cannot meet 1e-5: rounding the weights and every activation already moves logits by ~2^-8
    (bf16) or ~2^-11 (fp16) relative, whether or not sequences are packed. The honest baseline is the *same*
    model in the same dtype and kernel on each sequence alone (``separate_err``): packing must not add error
    beyond that noise, so ``packed_err <= 2 * separate_err`` (2x: packed and separate runs tile the matmuls and
    the kernel differently, so their rounding differs but is of the same size). And the check must be able to
    fail: the mixing control (the same packed row without sequence boundaries) must deviate by at least
    ``10 * separate_err``, else this dtype's noise would hide a real bug and the verdict is a failure.

    >>> half_precision_verdict(3e-6, 2e-6, 1e-1, torch.float32)[0], half_precision_verdict(1.5e-5, 1e-5, 1e-1, torch.float32)[0]
    (True, True)
    >>> half_precision_verdict(1.1e-5, 1e-6, 1e-1, torch.float32)
    (False, 'packed 1.10e-05 > 1.00e-05')
    >>> half_precision_verdict(4e-3, 3e-3, 2e-1, torch.bfloat16)[0], half_precision_verdict(9e-3, 3e-3, 2e-1, torch.bfloat16)[0]
    (True, False)
    >>> half_precision_verdict(4e-3, 3e-3, 1e-2, torch.bfloat16)  # the control cannot be told from noise
    (False, 'control 1.00e-02 < 10 x separate 3.00e-03: this dtype cannot detect mixing here')
    """
    if dtype == torch.float32 or dtype == torch.float64:
        # The fp32 floor of the device: cuBLAS tiles a packed row's GEMMs differently from each sequence's, so
        # on a GPU even a correct packed fp32 run sits ~1e-5 from the fp64 truth (H100, 2026-11: separate 0 vs
        # an fp32 truth, packed 1.3-1.8e-5). Where the same fp32 model on each sequence alone is that far from
        # fp64 already, packed may be at most 2x that floor; mixing is ~1e-1 or more either way.
        bar = max(FP32_TOL, HALF_FACTOR * separate_err)
        ok = packed_err <= bar
        floor = f" (2 x separate {separate_err:.2e})" if bar > FP32_TOL else ""
        return ok, f"packed {packed_err:.2e} {'<=' if ok else '>'} {bar:.2e}{floor}"
    if control_err is not None and control_err < CONTROL_FACTOR * separate_err:
        return False, (f"control {control_err:.2e} < {CONTROL_FACTOR:.0f} x separate {separate_err:.2e}: "
                       "this dtype cannot detect mixing here")
    ok = packed_err <= HALF_FACTOR * separate_err
    return ok, f"packed {packed_err:.2e} {'<=' if ok else '>'} {HALF_FACTOR:.0f} x separate {separate_err:.2e}"


# ---------------------------------------------------------------------------------------------- 1. packing
ARCHS = ("llama", "qwen2", "mistral", "gemma2")


def arch_config(arch: str, *, hidden: int = 256, heads: int = 4, layers: int = 2, window: int = 16, vocab: int = 512):
    """A random-init config of ``arch`` with head_dim = hidden / heads, GQA (2 KV heads), initializer_range 0.2
    (peaked attention, so that mixing sequences shows), sliding windows of ``window`` tokens (Mistral: every layer;
    Qwen2: layer 1; Gemma 2: alternating, with attention softcap 1.0 and final softcap 5.0)."""
    import transformers

    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=max(1, heads // 2), intermediate_size=2 * hidden, max_position_embeddings=4096,
              initializer_range=0.2, use_cache=False, attention_dropout=0.0)
    if arch == "llama":
        return transformers.LlamaConfig(**kw)
    if arch == "qwen2":
        return transformers.Qwen2Config(**kw, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    if arch == "mistral":
        return transformers.MistralConfig(**kw, sliding_window=window)
    if arch == "gemma2":
        return transformers.Gemma2Config(**kw, head_dim=hidden // heads, sliding_window=window,
                                         attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                                         query_pre_attn_scalar=hidden // heads)
    raise KeyError(f"arch {arch!r}: one of {ARCHS}")


def _build(config, attn: str, dtype: torch.dtype, device: str, state: dict | None = None):
    import transformers

    from hf_gradfix.packing.attention import (REFERENCE_VARLEN_ATTENTION, TORCH_VARLEN_ATTENTION,
                                              set_attention_implementation)

    torch.manual_seed(0)
    later = (REFERENCE_VARLEN_ATTENTION, TORCH_VARLEN_ATTENTION, "flash_attention_2")
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager" if attn in later else attn)
    if state is not None:
        model.load_state_dict(state)
    model = model.to(device=device, dtype=dtype)
    if attn != model.config._attn_implementation:
        set_attention_implementation(model, attn)  # FA2 checks dtype/device here, after the move
    return model.eval()


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_hi(logits[:-1]), labels[1:], ignore_index=-100, reduction="sum")


def _hi(t: torch.Tensor) -> torch.Tensor:
    """fp32 for half precision, fp64 kept (the ground truth)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _separate(model, seqs) -> tuple[torch.Tensor, dict]:
    """Each sequence alone: logits concatenated, gradients of the global token mean."""
    model.zero_grad(set_to_none=True)
    n = sum(len(s) - 1 for s in seqs)
    outs = []
    for s in seqs:
        logits = model(input_ids=s.unsqueeze(0), use_cache=False).logits[0]
        (_ce_sum(logits, s) / n).backward()
        outs.append(_hi(logits.detach()))
    return torch.cat(outs), {k: _hi(p.grad.detach()).clone() for k, p in model.named_parameters() if p.grad is not None}


def _packed(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False).logits[0]
    labels = batch["labels"][0]
    (_ce_sum(logits, labels) / int((labels[1:] != -100).sum())).backward()
    return _hi(logits.detach()), {k: _hi(p.grad.detach()).clone() for k, p in model.named_parameters() if p.grad is not None}


def packed_vs_separate(arch: str, attn: str, dtype: torch.dtype, device: str, *, lengths=(37, 101, 5, 64, 23, 130),
                       config_kw: dict | None = None, seed: int = 1) -> dict:
    """Packed (hf_gradfix ``PackedCollator``, one row with ``cu_seq_lens``) vs each sequence alone, through ``attn``
    in ``dtype``, against an fp64 eager ground truth of the separate sequences (same weights, same device).

    Returns errors relative to the ground truth for logits and gradients (packed, separate, and the mixing control:
    the same row without restarted positions and boundaries), the branch the reference kernel took, and the verdict
    of :func:`half_precision_verdict` on logits and on gradients.
    """
    from hf_gradfix.packing.attention import (reference_branch_counts, reset_reference_branch_counts,
                                              reset_torch_varlen_counts, torch_varlen_counts)
    from hf_gradfix.packing.collator import PackedCollator, check_packed_batch

    config = arch_config(arch, **(config_kw or {}))
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(4, config.vocab_size, (n,), generator=g) for n in lengths]
    batch = PackedCollator()([{"input_ids": s} for s in seqs])
    check_packed_batch(batch)
    seqs = [s.to(device) for s in seqs]
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    truth_model = _build(config, "eager", torch.float64, device)  # fp64: below every dtype's floor here
    truth_logits, truth_grads = _separate(truth_model, seqs)
    state = {k: v.detach().float().cpu() for k, v in truth_model.state_dict().items()}
    del truth_model
    model = _build(config, attn, dtype, device, state)
    sep_logits, sep_grads = _separate(model, seqs)
    reset_reference_branch_counts()
    reset_torch_varlen_counts()
    pk_logits, pk_grads = _packed(model, batch)
    branches = reference_branch_counts()
    torch_kernel = torch_varlen_counts()
    with torch.no_grad():  # the bug this guards against: the same row, sequences attending to each other
        mixed = model(input_ids=batch["input_ids"], use_cache=False).logits[0].float()
    out = dict(arch=arch, attn=attn, dtype=str(dtype).replace("torch.", ""), device=str(device), lengths=list(lengths),
               logits=dict(packed=rel(pk_logits, truth_logits), separate=rel(sep_logits, truth_logits),
                           control=rel(mixed, truth_logits), packed_vs_separate=rel(pk_logits, sep_logits)),
               grads=dict(packed=rel_grads(pk_grads, truth_grads), separate=rel_grads(sep_grads, truth_grads),
                          packed_vs_separate=rel_grads(pk_grads, sep_grads)),
               reference_branches=branches, torch_varlen_calls=torch_kernel)
    ok_l, why_l = half_precision_verdict(out["logits"]["packed"], out["logits"]["separate"], out["logits"]["control"], dtype)
    ok_g, why_g = half_precision_verdict(out["grads"]["packed"], out["grads"]["separate"], None, dtype)
    if dtype == torch.float32:  # fp32 also states the control could fail
        ok_l = ok_l and out["logits"]["control"] > CONTROL_FACTOR * max(FP32_TOL, out["logits"]["separate"])
    out.update(passed=bool(ok_l and ok_g), why=f"logits: {why_l}; grads: {why_g}")
    del model
    _free(device)
    return out


def section_packing(device: str, quick: bool) -> dict:
    """Torch's varlen kernel first (the path a GPU without flash-attn trains on), then FA2, then the fp32 reference,
    each over the four architectures (a stopped run keeps the rows it finished)."""
    from hf_gradfix.packing.attention import (REFERENCE_VARLEN_ATTENTION, TORCH_VARLEN_ATTENTION,
                                              register_reference_varlen_attention, register_torch_varlen_attention)

    register_reference_varlen_attention()
    register_torch_varlen_attention()
    fa_ok, fa_line = flash_attn_status()
    tv_ok, tv_line = torch_varlen_status(device)
    runs: list[tuple[str, torch.dtype]] = []
    if tv_ok:
        runs += [(TORCH_VARLEN_ATTENTION, torch.bfloat16), (TORCH_VARLEN_ATTENTION, torch.float16)]
    if fa_ok:
        runs += [("flash_attention_2", torch.bfloat16), ("flash_attention_2", torch.float16)]
    runs.append((REFERENCE_VARLEN_ATTENTION, torch.float32))
    kw = dict(lengths=(13, 29, 5, 21), config_kw=dict(hidden=64, heads=2, window=8)) if quick else {}
    rows = _section_rows()
    for attn, dtype in runs:
        for arch in ARCHS:
            rows.append(packed_vs_separate(arch, attn, dtype, device, **kw))
    passed = all(r["passed"] for r in rows)
    summary = f"{sum(r['passed'] for r in rows)}/{len(rows)} (arch x attention x dtype) exact"
    if not tv_ok:
        summary += f"; torch varlen not run: {tv_line}"
    if not fa_ok:
        summary += f"; FA2 not run: {fa_line}"
    return dict(status="passed" if passed else "FAILED", summary=summary, rows=rows, flash_attn=fa_line,
                torch_varlen=tv_line)


# ---------------------------------------------------------------------------------------------- 2. trainer
class _OnDevice(torch.nn.Module):
    """Runs the harness's ground truth (which builds CPU inputs) on a model that lives on another device: inputs
    are moved in, logits are moved back (the gradient flows through both copies)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, **kwargs):
        device = next(self.inner.parameters()).device
        return {"logits": self.inner(input_ids=input_ids.to(device), **kwargs).logits.float().cpu()}


def packed_trainer_vs_ground_truth(device: str, attention: str, *, amp_bf16: bool = False, n: int = 16,
                                   budget: int = 64, ga: int = 2) -> dict:
    """``hf_gradfix.patch(packing varlen)`` + ``transformers.Trainer`` (lr 0, SGD) on ``device``, each optimizer
    step's gradient against the unpacked ground truth of the bins the sampler drew (harness ``ground_truth``: each
    sample alone, fp32, eager, one backward). ``attention``: ``"auto"`` (FA2 where installed) or a name to set on
    the model first (kept). With ``amp_bf16`` the Trainer runs under bf16 autocast and the baseline error is the
    same unpacked ground truth computed under bf16 autocast with sdpa."""
    import transformers
    from transformers import Trainer

    import harness as H
    import hf_gradfix
    from hf_gradfix.packing.attention import set_attention_implementation
    from test_packing_trainer import _windows

    assert budget == 64, "the windows are rebuilt with test_packing_trainer's budget"
    samples = H.make_samples("causal", n=n, seed=0, prompt_mask_frac=0.3)
    model = H.build_model("llama", attn_implementation="sdpa").to(device)
    cfg = {"packing": {"enabled": True, "token_budget": budget, "mode": "varlen"}}
    if attention != "auto":
        set_attention_implementation(model, attention)
        cfg["packing"]["attention"] = "keep"
    capture = H.GradCapture()
    args = transformers.TrainingArguments(
        output_dir="/tmp/hgf_gpu_check", optim="sgd", learning_rate=0.0, max_grad_norm=0.0,
        gradient_accumulation_steps=ga, per_device_train_batch_size=1, num_train_epochs=1, logging_strategy="no",
        report_to="none", use_cpu=device == "cpu", bf16=amp_bf16, save_strategy="no", disable_tqdm=True, seed=3,
        remove_unused_columns=False,
    )
    hf_gradfix.patch(cfg)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=H.TokenDataset(samples), callbacks=[capture])
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    used = model.config._attn_implementation
    windows = _windows(samples, ga)
    errs, base_errs = [], []
    inner = H.build_model("llama", attn_implementation="eager").to(device)  # same seed: the same weights
    gt_model = _OnDevice(inner)

    def ground_truth(window_samples):
        _, grads = H.ground_truth(gt_model, window_samples, "causal")
        return {k.removeprefix("inner."): v for k, v in grads.items()}

    for window, grads in zip(windows, capture.grads):
        window_samples = [samples[i] for b in window for i in b]
        gt = ground_truth(window_samples)
        errs.append(rel_grads(grads, gt))
        if amp_bf16:
            set_attention_implementation(inner, "sdpa")
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
                gt_half = ground_truth(window_samples)
            set_attention_implementation(inner, "eager")
            base_errs.append(rel_grads(gt_half, gt))
    out = dict(device=device, attention=used, amp_bf16=amp_bf16, steps=len(errs), grad_rel_err=errs)
    if not errs or len(windows) != len(capture.grads):
        out.update(passed=False, why=f"{len(capture.grads)} captured steps for {len(windows)} windows")
    elif amp_bf16:
        # max over steps against max over steps: one step's unpacked error can be small by chance
        ok = max(errs) <= HALF_FACTOR * max(base_errs)
        out.update(unpacked_bf16_rel_err=base_errs, passed=ok,
                   why=f"max packed {max(errs):.2e} {'<=' if ok else '>'} {HALF_FACTOR:.0f} x max unpacked-bf16 {max(base_errs):.2e}")
    else:
        out.update(passed=max(errs) <= FP32_TOL, why=f"max rel. gradient error {max(errs):.2e} (<= {FP32_TOL:.0e})")
    del model, gt_model, inner, trainer
    _free(device)
    return out


def section_trainer(device: str, quick: bool) -> dict:
    from hf_gradfix.packing.attention import REFERENCE_VARLEN_ATTENTION, register_reference_varlen_attention

    register_reference_varlen_attention()
    fa_ok, fa_line = flash_attn_status()
    tv_ok, tv_line = torch_varlen_status(device)
    rows = _section_rows()
    if fa_ok or tv_ok:  # "auto": what the packed Trainer picks here (FA2, else torch's varlen kernel)
        rows.append(packed_trainer_vs_ground_truth(device, "auto", amp_bf16=True))
    rows.append(packed_trainer_vs_ground_truth(device, REFERENCE_VARLEN_ATTENTION))
    ok = all(r["passed"] for r in rows)
    summary = "; ".join(f"{r['attention']}{' bf16' if r['amp_bf16'] else ' fp32'}: {r['why']}" for r in rows)
    if not (fa_ok or tv_ok):
        summary += f"; no flash kernel: {fa_line}; {tv_line}"
    return dict(status="passed" if ok else "FAILED", summary=summary, rows=rows)


# ---------------------------------------------------------------------------------------------- 3. guard
def _all_ones_mask(model):
    """Turn ``model`` into one that mixes packed sequences in every transformers release (the control the guard
    must refuse): its forward always passes an all-ones attention_mask, which switches sdpa's packed-sequence
    detection off. A planted fault, not a fact about one architecture in one release."""
    forward = model.forward

    def mixing_forward(input_ids=None, attention_mask=None, **kwargs):
        return forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)

    model.forward = mixing_forward
    return model


def guard_on(device: str, attn: str, dtype: torch.dtype, arch: str = "llama") -> dict:
    """``check_model_packs_correctly`` on ``device``: Llama-family models must pass; ``arch="mixing_control"``
    (a Llama forced to pass an all-ones mask, on sdpa) must be refused."""
    from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_correctly

    expected_refusal = arch == "mixing_control"
    config = arch_config("llama" if expected_refusal else arch, hidden=64, heads=2, window=4)
    model = _build(config, attn, dtype, device)
    if expected_refusal:
        model = _all_ones_mask(model)
    try:
        report = check_model_packs_correctly(model)
        refused, message = False, ""
        max_diff, control = report.max_diff, report.control_diff
    except PackingCheckError as e:
        refused, message = True, str(e).splitlines()[0]
        max_diff, control = e.report.max_diff, e.report.control_diff
    return dict(arch=arch, attn=attn, dtype=str(dtype).replace("torch.", ""), refused=refused, message=message,
                max_diff=max_diff, control_diff=control, passed=refused == expected_refusal)


def section_guard(device: str, quick: bool) -> dict:
    from hf_gradfix.packing.attention import REFERENCE_VARLEN_ATTENTION, register_reference_varlen_attention

    from hf_gradfix.packing.attention import TORCH_VARLEN_ATTENTION, register_torch_varlen_attention

    register_reference_varlen_attention()
    register_torch_varlen_attention()
    fa_ok, fa_line = flash_attn_status()
    tv_ok, tv_line = torch_varlen_status(device)
    rows = _section_rows()
    for ok_here, attn in ((tv_ok, TORCH_VARLEN_ATTENTION), (fa_ok, "flash_attention_2")):
        if ok_here:
            for arch in ("llama", "mistral", "gemma2"):
                rows.append(guard_on(device, attn, torch.bfloat16, arch))
    rows.append(guard_on(device, REFERENCE_VARLEN_ATTENTION, torch.float32))
    rows.append(guard_on(device, "sdpa", torch.float32, "mixing_control"))
    ok = all(r["passed"] for r in rows)
    summary = ", ".join(f"{r['arch']}/{r['attn']}/{r['dtype']} {'refused' if r['refused'] else 'accepted'}" for r in rows)
    if not tv_ok:
        summary += f"; torch varlen not run: {tv_line}"
    if not fa_ok:
        summary += f"; FA2 not run: {fa_line}"
    return dict(status="passed" if ok else "FAILED", summary=summary, rows=rows)


# ---------------------------------------------------------------------------------------------- 4. plan
def llama_1b_config():
    """A Llama-3.2-1B-shaped config (1.24B parameters, tied embeddings): built from numbers, nothing downloaded."""
    import transformers

    return transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=131072, tie_word_embeddings=True, use_cache=False)


def measure_training_step(config, settings, device: str, steps: int = 2, *, mem=None) -> dict[str, int]:
    """The step ``hf_gradfix.plan.simulate`` traces, on real tensors and the real allocator (CUDA).

    Same model build (``from_config`` in the settings' dtype, sdpa: the fused attention profile), same optimizer
    (``simulate._make_optimizer``), the same forward / backward / step, ``steps`` times; the last step is measured.
    Returns bytes: ``parameters`` (after the build), ``optimizer_state`` (after the step, minus parameters),
    ``gradients`` (after backward, minus what stays after the step), ``activations``: what forward and backward
    hold beyond parameters, optimizer state and the gradients accumulated so far (the plan's activations and
    temporaries), sampled at the end of the forward and at every parameter's gradient accumulation
    (``register_post_accumulate_grad_hook``), and at the first accumulation also the allocator's peak since the
    end of the forward less that gradient: the loss backward's fp32 gradients (the step's peak at 1B) live between
    samples and were missed before issue 53 (4.33 GiB measured, 6.28 GiB true at 1B); a lower bound still;
    ``fwd_bwd_above_state`` (the forward+backward peak above parameters and optimizer state, gradients
    included: an upper bound), ``peak`` (max_memory_allocated over the last step) and ``peak_phase``.
    ``mem``: the allocator statistics (default ``torch.cuda``; tests pass a stand-in to run the logic on CPU).
    """
    import transformers

    from hf_gradfix.plan.simulate import _make_optimizer

    if mem is None:
        if torch.device(device).type != "cuda":
            raise RuntimeError("measure_training_step reads torch.cuda's allocator; it needs a CUDA device")
        mem = torch.cuda
    mem.synchronize()
    _free(device)
    base = mem.memory_allocated()
    dtype = torch.bfloat16 if settings.dtype == "bf16-pure" else torch.float32
    amp = settings.dtype == "amp-bf16"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.train()
    if settings.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = mem.memory_allocated() - base
    opt = _make_optimizer(model, settings)
    ids = torch.randint(0, config.vocab_size, (settings.micro_batch, settings.seq_len), device=device)
    sampling: dict[str, Any] = {"on": False, "grads": 0, "beyond": [], "seen": set()}

    def on_grad(p):  # allocated beyond the gradients accumulated so far, at each accumulation
        if sampling["on"]:
            first = not sampling["seen"]
            if id(p) not in sampling["seen"]:
                sampling["seen"].add(id(p))
                sampling["grads"] += p.grad.numel() * p.grad.element_size()
            if first:  # the loss backward's peak (peak stats reset at the end of the forward), this gradient off
                sampling["beyond"].append(mem.max_memory_allocated() - base - sampling["grads"])
            sampling["beyond"].append(mem.memory_allocated() - base - sampling["grads"])

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters() if p.requires_grad]
    out: dict[str, Any] = {}
    for step in range(steps):
        last = step == steps - 1
        if last:
            after_prev = mem.memory_allocated() - base
            sampling.update(on=True, grads=0, beyond=[], seen=set())
            mem.reset_peak_memory_stats()
        autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        after_forward = mem.memory_allocated() - base
        if last:
            fwd_peak = mem.max_memory_allocated() - base
            mem.reset_peak_memory_stats()
        loss.backward()
        del loss
        mem.synchronize()
        if last:
            sampling["on"] = False
            fb_peak = max(fwd_peak, mem.max_memory_allocated() - base)
            after_backward = mem.memory_allocated() - base
            mem.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad()
        mem.synchronize()
        if last:
            step_peak = mem.max_memory_allocated() - base
            after_step = mem.memory_allocated() - base
            activations = max([after_forward] + sampling["beyond"]) - after_prev
            out = dict(parameters=params, optimizer_state=after_step - params, gradients=after_backward - after_step,
                       activations=activations, fwd_bwd_above_state=fb_peak - after_prev,
                       peak=max(fb_peak, step_peak), peak_phase="optimizer step" if step_peak > fb_peak else "forward/backward")
    for h in hooks:
        h.remove()
    del model, opt, ids
    _free(device)
    return out


COMPONENTS = (("parameters", "max"), ("gradients", "max"), ("optimizer_state", "after_step"),
              ("activations", "max:activations_and_temporaries"))


def compare_memory(closed: dict[str, float], traced: dict[str, Any], measured: dict[str, int]) -> list[dict]:
    """Rows (component, measured, closed form, traced, errors relative to the measured bytes).

    ``closed``: ``Plan.components`` plus ``peak``; ``traced``: ``simulate()``'s result; ``measured``:
    :func:`measure_training_step`'s.

    >>> rows = compare_memory({"parameters": 110, "peak": 200}, {"max": {"parameters": 100}, "peak": 190},
    ...                       {"parameters": 100, "peak": 200})
    >>> [(r["component"], r["closed_err"], r["traced_err"]) for r in rows]
    [('parameters', 0.1, 0.0), ('peak', 0.0, -0.05)]
    """
    rows = []
    for comp, where in COMPONENTS + (("peak", "peak"),):
        if comp not in measured or comp not in closed:
            continue
        kind, _, key = where.partition(":")
        if kind == "peak":
            t = traced.get("peak")
        else:
            t = (traced.get(kind) or {}).get(key or comp)
        m = measured[comp]
        rows.append(dict(component=comp, measured=m, closed=closed[comp], traced=t,
                         closed_err=round((closed[comp] - m) / m, 4) if m else None,
                         traced_err=round((t - m) / m, 4) if (m and t is not None) else None))
    return rows


def plan_vs_allocator(config, device: str, *, seq_len: int = 2048, micro_batch: int = 1, dtype: str = "bf16-pure",
                      recompute: str = "none", optimizer: str = "adamw", mem=None, trace: bool = True) -> dict:
    """``hf-gradfix plan`` (closed form and ``--simulate``, one process) against :func:`measure_training_step`
    (``mem``: passed on, for tests on CPU; ``trace=False`` skips ``--simulate``, 1-4 minutes of host CPU at 1B)."""
    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate
    from hf_gradfix.plan.simulate import simulate

    settings = Settings(seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, recompute=recompute, optimizer=optimizer,
                        attention="fused")
    mesh = ParallelDims(1)
    plan = estimate(config, mesh, settings)
    closed = dict(plan.components, peak=plan.peak)
    t0 = time.perf_counter()
    traced = simulate(config, mesh, settings) if trace else {}
    trace_s = time.perf_counter() - t0
    measured = measure_training_step(config, settings, device, mem=mem)
    rows = compare_memory(closed, traced, measured)
    peak = next(r for r in rows if r["component"] == "peak")
    return dict(settings=dict(seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, recompute=recompute,
                              optimizer=optimizer), rows=rows,
                trace_seconds=round(trace_s, 1), peak_phase=measured["peak_phase"],
                summary=(f"{dtype} {optimizer} seq {seq_len} x {micro_batch} recompute {recompute}: measured peak "
                         f"{measured['peak'] / 2**30:.2f} GiB; closed form {peak['closed_err']:+.1%}, "
                         + (f"--simulate {peak['traced_err']:+.1%}" if trace else "--simulate not run")))


PLAN_CASES = [dict(dtype="bf16-pure"), dict(dtype="bf16-pure", optimizer="galore_adamw")]
PLAN_MORE_CASES = [dict(dtype="amp-bf16"), dict(dtype="bf16-pure", recompute="full")]


def section_plan(device: str, quick: bool, more: bool = False, trace: bool = False) -> dict:
    """The 1B model in bf16 with AdamW and with GaLore (``more``: also amp-bf16 and full recomputation). Each
    ``--simulate`` trace takes 1-4 minutes of host CPU for a 1B model (fake tensors, one thread): off unless
    ``trace`` (``--plan-trace``), so the closed form meets the allocator inside one device call."""
    if quick:
        from hf_gradfix.plan import load_model_config

        config, cases = load_model_config("tiny-llama"), [dict(seq_len=128, dtype="fp32")]
    else:
        config = llama_1b_config()
        cases = PLAN_CASES + (PLAN_MORE_CASES if more else [])
    rows = _section_rows()
    for case in cases:
        try:
            rows.append(plan_vs_allocator(config, device, **case, trace=trace or quick))
        except Exception as e:  # one case failing (e.g. out of memory) should not hide the others
            error = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(dict(settings=case, error=error, summary=f"{case}: {error}"))
            _free(device)
    return dict(status="measured" if all("error" not in r for r in rows) else "error",
                summary="; ".join(r["summary"] for r in rows), rows=rows)


# ---------------------------------------------------------------------------------------------- 5. throughput
def throughput(device: str, attn: str, dtype: torch.dtype, *, samples: int = 2000, budget: int = 4096,
               batch: int = 8, sigma: float = 1.0, model_kw: dict | None = None, warmup_steps: int = 3,
               arms: tuple[str, ...] = ("padded", "packed", "padded-sdpa", "trl-padding-free"),
               keep: dict | None = None) -> dict:
    """Real tokens/s over one epoch of the same samples (``bench_packing_throughput``'s lognormal lengths):

    - ``padded``: stock Trainer, random batches of ``batch`` samples padded to the longest (``attn``, mask; FA2
      unpads attention itself, the rest of the model still computes the padding);
    - ``padded-sdpa``: the same with sdpa (transformers' default attention), where attention computes it too;
    - ``packed``: ``hf_gradfix.patch(packing varlen, token_budget)`` (FA2 where ``attn`` is FA2);
    - ``trl-padding-free``: TRL's ``DataCollatorForLanguageModeling(padding_free=True)``, random batches of
      ``batch`` samples flattened into one row with position_ids / cu_seq_lens (its FA2 path).

    Every arm sees every sample exactly once, so real tokens are the same; time = the epoch's ``trainer.train()``
    wall time after a short warm-up run in the same process. The padded arm's padding waste gives the limit a
    padding-free path can reach, 1 / (1 - waste). ``keep``: a dict that receives each arm's result as it finishes
    (a stopped run keeps them). Without TRL importable, its arm is reported as skipped.
    """
    import transformers

    import bench_packing_throughput as B
    import hf_gradfix

    lens = B.lengths(samples, 0, budget, sigma)
    vocab = 512
    data = B.Rows(lens, vocab, 0)
    real_tokens = sum(lens)
    mkw = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4)
    mkw.update(model_kw or {})
    counted = {"padded": 0, "real": 0}

    def padded_collate(features):
        out = B.pad_collate(features)
        counted["padded"] += int(out["input_ids"].numel())
        counted["real"] += int(out["attention_mask"].sum())
        return out

    trl_collate = None
    if "trl-padding-free" in arms:
        try:
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            trl_collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
        except Exception as e:  # not installed, or a TRL that does not import with this transformers
            arms = tuple(a for a in arms if a != "trl-padding-free")
            skipped_trl = f"{type(e).__name__}: {str(e)[:160]}"

    def build(attn):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=budget, use_cache=False,
                                       pad_token_id=0, **mkw)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=dtype)
        if attn != "sdpa":
            from hf_gradfix.packing.attention import set_attention_implementation

            set_attention_implementation(model, attn)
        return model

    def run(arm: str, max_steps: int = -1) -> float:
        args = transformers.TrainingArguments(
            output_dir="/tmp/hgf_gpu_check_tp", max_steps=max_steps, num_train_epochs=1,
            per_device_train_batch_size=batch, learning_rate=1e-5, report_to="none", use_cpu=device == "cpu",
            save_strategy="no", disable_tqdm=True, logging_strategy="no", remove_unused_columns=False, seed=0,
            dataloader_num_workers=0,
        )
        if arm == "packed":
            hf_gradfix.patch({"packing": {"enabled": True, "token_budget": budget, "mode": "varlen",
                                          "attention": "keep"}, "log_fixes": False})
        collate = trl_collate if arm == "trl-padding-free" else padded_collate
        try:
            model = build("sdpa" if arm == "padded-sdpa" else attn)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
            _sync(device)
            t0 = time.perf_counter()
            trainer.train()
            _sync(device)
            return time.perf_counter() - t0
        finally:
            hf_gradfix.unpatch()
            _free(device)

    results: dict[str, Any] = keep if keep is not None else {}
    if trl_collate is None and "skipped_trl" in locals():
        results["trl-padding-free"] = dict(skipped=skipped_trl)
    for arm in arms:
        if warmup_steps:
            run(arm, max_steps=warmup_steps)  # kernels, allocator, autotuning: paid outside the timed epoch
        counted.update(padded=0, real=0)
        seconds = run(arm)
        if arm == "padded":
            waste_counts = dict(counted)
        results[arm] = dict(seconds=round(seconds, 3), real_tokens_per_s=real_tokens / seconds)
    out = dict(device=device, attn=attn, dtype=str(dtype).replace("torch.", ""), samples=samples,
               real_tokens=real_tokens, budget=budget, batch=batch, model=mkw, arms=results)
    if "padded" in results:
        waste = 1.0 - waste_counts["real"] / max(waste_counts["padded"], 1)
        limit = 1.0 / (1.0 - waste)
        base = results["padded"]["real_tokens_per_s"]
        out.update(padding_waste=waste, limit=limit)
        for arm, r in results.items():
            if "real_tokens_per_s" not in r:
                continue
            r["vs_padded"] = r["real_tokens_per_s"] / base
            r["of_limit"] = r["vs_padded"] / limit
    return out


def section_throughput(device: str, quick: bool) -> dict:
    """Packed vs padded through a flash kernel: flash-attn 2 where installed, else torch's varlen kernel."""
    from hf_gradfix.packing.attention import TORCH_VARLEN_ATTENTION, register_torch_varlen_attention

    fa_ok, fa_line = flash_attn_status()
    tv_ok, tv_line = torch_varlen_status(device)
    if not (fa_ok or tv_ok):
        return dict(status=f"skipped: {fa_line}; {tv_line}", summary="packed vs padded on a GPU needs a varlen kernel")
    attn = "flash_attention_2" if fa_ok else register_torch_varlen_attention(TORCH_VARLEN_ATTENTION)
    kw = dict(samples=200, budget=1024, model_kw=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2)) if quick else \
        dict(samples=1000)
    arms: dict[str, Any] = {}
    _section_rows().append(dict(attn=attn, arms=arms, partial=True))  # what a stopped run keeps
    r = throughput(device, attn, torch.bfloat16, keep=arms, **kw)
    _section_rows()[:] = [r]
    summary = (f"{attn}: padding waste {r['padding_waste']:.1%} -> limit {r['limit']:.2f}x; " +
               ", ".join(f"{a} {v['vs_padded']:.2f}x ({v['of_limit']:.0%} of limit)" if "vs_padded" in v
                         else f"{a} {v.get('skipped', '?')}" for a, v in r["arms"].items() if a != "padded"))
    return dict(status="measured", summary=summary, rows=_section_rows())


# ---------------------------------------------------------------------------------------------- 6. optimizers
def optimizer_cost(device: str, *, arms=("adamw", "galore-torch", "svd", "randomized", "apollo", "apollo-mini"),
                   hidden: int = 4096, intermediate: int = 11008, layers: int = 2, heads: int = 32, vocab: int = 32000,
                   rank: int | None = None, steps: int = 12, gap: int = 10, batch: int = 1, seq: int = 512,
                   keep: dict | None = None) -> dict:
    """``opt.step()`` time and memory per arm (``bench_optim.build_optimizer``), one arm at a time on a fresh copy
    of the same fp32 model (``bench_optim.build_model``; default: two Llama-7B-shaped layers).

    Per arm: median ``step()`` time over non-refresh steps and the refresh step (step ``gap``; step 0 also
    allocates the state), state bytes (``bench_optim.state_breakdown``: distinct storages), and on CUDA the
    allocator's growth over the first step (the state) and the transient peak of a non-refresh step above what
    was allocated before it.
    """
    import bench_optim as BO

    ns = argparse.Namespace(vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                            seq=seq, rank=rank or hidden // 4, apollo_rank=rank or hidden // 4, gap=gap, scale=0.25,
                            lr_adamw=1e-3, lr_lowrank=1e-2)
    cuda = torch.device(device).type == "cuda"
    base = BO.build_model(ns, 0).to(device)  # built once (a 7B-shaped init on the host takes a while)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    results = keep if keep is not None else {}
    for arm in arms:
        model = copy.deepcopy(base)
        opt = BO.build_optimizer(arm, model, ns)
        times, refresh, transient, state_growth = [], None, [], None
        for i in range(steps):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            del loss
            _sync(device)
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            dt = time.perf_counter() - t0
            if cuda:
                if i == 0:
                    state_growth = torch.cuda.memory_allocated() - before
                elif i % gap:
                    transient.append(torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())
            opt.zero_grad(set_to_none=True)
            if i == gap:
                refresh = dt
            elif i % gap:
                times.append(dt)
        projected = {id(p) for p in BO.target_split(model)[0]}
        state = BO.state_breakdown(opt, projected)
        results[arm] = dict(step_ms=1e3 * sorted(times)[len(times) // 2], refresh_ms=None if refresh is None else 1e3 * refresh,
                            state_bytes=state["total"], state_growth_bytes=state_growth,
                            step_transient_bytes=max(transient) if transient else None)
        del model, opt
        _free(device)
    del base
    _free(device)
    ref = results.get("adamw")
    if ref:
        for r in results.values():
            r["step_vs_adamw"] = r["step_ms"] / ref["step_ms"]
            r["state_vs_adamw"] = r["state_bytes"] / ref["state_bytes"]
    return dict(device=device, shape=dict(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab,
                                          rank=ns.rank, gap=gap, batch=batch, seq=seq), arms=results)


def section_optim(device: str, quick: bool) -> dict:
    arms = ["adamw", "svd", "randomized", "apollo", "apollo-mini"]
    missing = []
    ok, line = import_galore_torch()
    if ok:
        arms.insert(1, "galore-torch")
    else:
        missing.append(line)
    kw = dict(hidden=128, intermediate=344, heads=4, vocab=512, seq=64, steps=6, gap=3) if quick else {}
    keep: dict[str, Any] = {}
    _section_rows().append(dict(arms=keep, partial=True))
    r = optimizer_cost(device, arms=tuple(arms), keep=keep, **kw)
    _section_rows()[:] = [r]
    summary = ", ".join(f"{a} step {v['step_ms']:.1f} ms ({v.get('step_vs_adamw', 1):.2f}x), state "
                        f"{v['state_bytes'] / 2**20:.0f} MiB ({v.get('state_vs_adamw', 1):.2f}x)" for a, v in r["arms"].items())
    if missing:
        summary += "; " + "; ".join(missing)
    return dict(status="measured", summary=summary, rows=[r])


def lean_head_cell(device: str, vocab: int, tokens: int, dtype: str, *, hidden: int = 512, repeats: int = 3) -> dict:
    """One (vocabulary, tokens, dtype) cell of the lean head beside the stock head (issue 40): a Llama with that
    head (2 layers), one training step (forward + backward) each way; peak memory above the step's start
    (``torch.cuda.max_memory_allocated``; None on CPU), the median time of ``repeats`` steps after a warm-up, and the
    lean head's weight-gradient error against the stock head's (both runs from the same weights and batch)."""
    import transformers

    from hf_gradfix.integration.lean_head import LeanHead, run_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=tokens, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(device).float()
    ids = torch.randint(4, vocab, (1, tokens), device=device)
    labels = ids.clone()
    labels[:, : tokens // 4] = -100
    n = (labels[:, 1:] != -100).sum().float()
    call = {"input_ids": ids, "labels": labels, "num_items_in_batch": n}
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    plan = LeanHead()
    cuda = torch.device(device).type == "cuda"
    out: dict[str, Any] = dict(vocab=vocab, tokens=tokens, dtype=dtype, hidden=hidden)
    grads = {}
    for head in ("stock", "lean"):
        def step():
            model.zero_grad(set_to_none=True)
            with autocast:
                loss = (run_model(plan, model, call, lambda: model(**call), True) if head == "lean"
                        else model(**call)).loss
            loss.backward()

        step()  # warm-up
        _free(device)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[f"{head}_peak_bytes"] = (torch.cuda.max_memory_allocated() - start) if cuda else None
        out[f"{head}_ms"] = round(1e3 * sorted(times)[len(times) // 2], 2)
        grads[head] = model.lm_head.weight.grad.double().clone()
    out["lean_calls"] = plan.calls
    out["grad_rel_err"] = rel(grads["lean"], grads["stock"])
    if out["stock_peak_bytes"]:
        out["mem_ratio"] = round(out["lean_peak_bytes"] / out["stock_peak_bytes"], 3)
    out["time_ratio"] = round(out["lean_ms"] / out["stock_ms"], 2)
    del model
    _free(device)
    return out


def section_lean(device: str, quick: bool, grid=None) -> dict:
    """The lean head beside the stock head on this device (fp32: torch's ``linear_cross_entropy``; bf16 autocast:
    the chunked path), the grid of ``benchmarks/bench_lean_head.py`` (2k / 8k / 32k tokens, 32k / 128k / 152k
    vocabulary), memory from the allocator."""
    grid = grid or ([(32000, 2048, "bf16"), (128256, 8192, "bf16")] if quick else
                    [(v, t, d) for v, t in ((32000, 8192), (128256, 8192), (151936, 8192), (128256, 32768))
                     for d in ("bf16", "fp32")])
    rows = _section_rows()
    for vocab, tokens, dtype in grid:
        rows.append(lean_head_cell(device, vocab, tokens, dtype))
    summary = ", ".join(f"{r['vocab'] // 1000}k x {r['tokens'] // 1024}k {r['dtype']}: memory "
                        f"{r.get('mem_ratio', '-')}x, time {r['time_ratio']}x, grad {r['grad_rel_err']:.1e}"
                        for r in rows)
    return dict(status="measured", summary=summary, rows=list(rows))


# ---------------------------------------------------------------------------------------------- 7. hybrid packing
HYBRID_KERNELS = ("fla", "causal_conv1d", "mamba_ssm")  # the varlen kernels transformers 5.x's mixers can call


def kernel_imports() -> dict[str, str]:
    """Which of the hybrid mixers' varlen kernels import here (version, or why not)."""
    import importlib

    found = {}
    for name in HYBRID_KERNELS:
        try:
            found[name] = str(getattr(importlib.import_module(name), "__version__", "ok"))
        except Exception as e:  # ImportError, or a CUDA extension built for another torch
            found[name] = f"not importable ({type(e).__name__})"
    return found


def hybrid_packed_row(family: str, device: str, *, repeats: int = 3) -> dict:
    """One tiny hybrid model (``tests/packing/test_packing_hybrid.build``, fp32) on ``device``: the probe's verdict per state-
    carrying layer (split, or handed to the kernels), the gradient of one packed row (``PackedCollator`` varlen, sdpa)
    against each document alone on the same device (CE summed, divided by the targets), stock's error on the same row
    (the model unchanged: the control), and the packed step's time with the verdict and with every layer split."""
    import harness as H
    from hf_gradfix.packing import state_reset
    from hf_gradfix.packing.collator import PackedCollator
    from test_packing_hybrid import build

    model = build(family).to(device)
    samples = H.make_samples("causal", n=6, seed=0, lo=8, hi=48)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads_of(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def ce_sum(logits, labels):
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    model.train()
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s["input_ids"]], device=device)
        labels = torch.tensor(s["labels"][1:], device=device)
        total = total + ce_sum(model(input_ids=ids, use_cache=False).logits[0, :-1], labels)
        count += int((labels != -100).sum())
    truth = grads_of(total / count)
    batch = PackedCollator(mode="varlen")([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples])
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"][0, 1:].to(device)

    def packed_grads():
        logits = model(**inputs, use_cache=False).logits[0, :-1]
        return grads_of(ce_sum(logits, labels) / int((labels != -100).sum()))

    def timed():
        packed_grads()
        _sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            packed_grads()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return round(1e3 * sorted(times)[len(times) // 2], 2)

    row: dict[str, Any] = dict(family=family, documents=len(samples), tokens=int(batch["input_ids"].shape[1]))
    try:
        row["stock_grad_rel_err"] = rel_grads(packed_grads(), truth)
    except Exception as e:  # transformers' own refusal of packed input on this path
        row["stock_grad_rel_err"] = f"raised {type(e).__name__}: {str(e)[:100]}"
    mixers = state_reset.probe_sequence_mixers(model) or []
    row["layers"] = [dict(layer=m.label, leak=m.leak, handed_to_kernels=m.handoff) for m in mixers]
    split = state_reset.split_documents(model, mixers)
    row["grad_rel_err"] = rel_grads(packed_grads(), truth)
    row["ms"] = timed()
    if any(m.handoff for m in mixers):
        split.restore()
        every = state_reset.split_documents(model, [dataclasses.replace(m, handoff=False) for m in mixers])
        row["split_grad_rel_err"] = rel_grads(packed_grads(), truth)
        row["split_ms"] = timed()
        split = every
    split.restore()
    row["passed"] = bool(mixers) and row["grad_rel_err"] <= FP32_TOL and row.get("split_grad_rel_err", 0.0) <= FP32_TOL
    return row


def section_hybrid(device: str, quick: bool) -> dict:
    """Packing hybrid / state-space models on this device with whatever varlen kernels import (``fla``,
    ``causal_conv1d``, ``mamba_ssm``): per family, the probe's verdict (split or handed to the kernels), the packed
    row's gradient vs each document alone (fp32 <= 1e-5) and stock's error beside it, the time of both paths."""
    import transformers

    kernels = kernel_imports()
    families = [f for f, cls in (("lfm2", "Lfm2Config"), ("qwen3_5", "Qwen3_5TextConfig"), ("bamba", "BambaConfig"))
                if hasattr(transformers, cls)]
    rows = _section_rows()
    for family in families[:1] if quick else families:
        try:
            rows.append(hybrid_packed_row(family, device))
        except Exception as e:  # a family this transformers builds but cannot run here: said, not hidden
            rows.append(dict(family=family, passed=False, error=f"{type(e).__name__}: {str(e)[:200]}"))
    summary = "; ".join(
        f"{r['family']}: " + (r["error"] if "error" in r else
                              f"{', '.join(('kernels ' if x['handed_to_kernels'] else 'split ') + x['layer'] for x in r['layers'])}, "
                              f"grad {r['grad_rel_err']:.1e} (stock {_fmt(r['stock_grad_rel_err'])}), {r['ms']} ms"
                              + (f" (all split {r['split_ms']} ms)" if "split_ms" in r else ""))
        for r in rows)
    summary += "; kernels: " + ", ".join(f"{k} {v}" for k, v in kernels.items())
    return dict(status="passed" if rows and all(r["passed"] for r in rows) else "FAILED", summary=summary,
                rows=list(rows), kernels=kernels)


# ---------------------------------------------------------------------------------------------- 9. vlm
VLM_COUNTS = (0, 3, 1, 0, 2)  # images per document: image documents sit after other documents in the row
VLM_SIZES = dict(quick=dict(samples=8, budget=512, batch=4, rounds=1), full=dict(samples=192, budget=4096, batch=8,
                                                                                  rounds=3))
_VLM_CACHE: dict = {}


def _to(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def vlm_packed_vs_alone(device: str, dtype: torch.dtype, attn: str) -> dict:
    """A tiny Qwen2.5-VL (``tests/support/vlm.py``) on ``device`` in ``dtype`` through ``attn``: one row packed by
    ``MultimodalPackedCollator(rope_index_fn(model))`` against each document alone (``tests/support/vlm_packing.py``),
    logits and gradients relative to an fp32 eager ground truth of each document alone on the same (dtype-rounded)
    weights. Verdict: :func:`half_precision_verdict` (fp32: <= 1e-5; bf16: packed <= 2 x the same dtype's
    documents-alone error, and the control, the row without restarted positions, >= 10 x it)."""
    import vlm as V
    import vlm_packing as P
    from hf_gradfix.packing.multimodal import MultimodalPackedCollator, rope_index_fn

    if "feats" not in _VLM_CACHE:
        proc = V.build_processor("qwen2_5_vl")
        _VLM_CACHE["feats"] = V.processed_samples(
            "qwen2_5_vl", V.make_samples("qwen2_5_vl", len(VLM_COUNTS), seed=3, counts=VLM_COUNTS), proc)
    feats = _VLM_CACHE["feats"]
    model = V.build_vlm("qwen2_5_vl", dtype=dtype, attn_implementation=attn).to(device).eval()
    truth = V.build_vlm("qwen2_5_vl").eval()
    truth.load_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()})  # the same rounded weights
    batch = _to(MultimodalPackedCollator(rope_index_fn(truth), pad_token_id=V.pad_id("qwen2_5_vl"))(feats), device)
    truth = truth.to(device)  # the collator ran on the host, as a DataLoader's does
    dfeats = _to([dict(f) for f in feats], device)
    ref_logits, ref_grads = P.docs_alone(truth, dfeats, grad=True)
    del truth
    alone_logits, alone_grads = P.docs_alone(model, dfeats, grad=True)
    logits, grads = P.packed_run(model, batch, grad=True)
    plain = {k: v for k, v in batch.items() if k not in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                                          "max_length_q", "max_length_k")}
    control, _ = P.packed_run(model, plain)
    err = dict(logits=dict(packed=P.worst_rel(P.split_row(logits, feats), ref_logits),
                           separate=P.worst_rel(alone_logits, ref_logits),
                           control=P.worst_rel(P.split_row(control, feats), ref_logits)),
               grads=dict(packed=P.grad_rel(grads, ref_grads), separate=P.grad_rel(alone_grads, ref_grads)))
    ok_l, why_l = half_precision_verdict(err["logits"]["packed"], err["logits"]["separate"], err["logits"]["control"],
                                         dtype)
    ok_g, why_g = half_precision_verdict(err["grads"]["packed"], err["grads"]["separate"], None, dtype)
    # the control must be far off in every dtype (fp32: the rule above has no control, so it is asked here)
    ok_c = err["logits"]["control"] >= CONTROL_FACTOR * max(err["logits"]["packed"], FP32_TOL)
    del model
    _free(device)
    return dict(arch="qwen2_5_vl", attn=attn, dtype=str(dtype).replace("torch.", ""), logits=err["logits"],
                grads=err["grads"], passed=ok_l and ok_g and ok_c,
                why=f"logits {why_l}; grads {why_g}" + ("" if ok_c else "; control too close"))


def vlm_throughput(device: str, quick: bool) -> dict:
    """Real (non-pad) tokens/s of the same samples padded vs packed: ``benchmarks/bench_vlm_packing.py``'s model,
    samples, padded batches and timed loop (forward + backward); bf16 and FA2 (else sdpa) on CUDA, fp32 sdpa on CPU."""
    import bench_vlm_packing as B
    from hf_gradfix.packing import pack
    from hf_gradfix.packing.multimodal import MultimodalPackedCollator, rope_index_fn

    size = VLM_SIZES["quick" if quick else "full"]
    cuda = torch.device(device).type == "cuda"
    attn = "flash_attention_2" if (cuda and flash_attn_status()[0]) else "sdpa"
    dtype = torch.bfloat16 if (cuda and torch.cuda.is_bf16_supported()) else torch.float32
    model = B.build_model()
    data = B.samples(size["samples"], 0, size["budget"])
    real = sum(len(s["input_ids"]) for s in data)
    collator = MultimodalPackedCollator(rope_index_fn(model), max_tokens=size["budget"], pad_token_id=B.PAD)
    batches = dict(padded=B.padded_batches(data, size["batch"]),
                   packed=[collator([data[i] for i in b]) for b in pack([len(s["input_ids"]) for s in data],
                                                                          budget=size["budget"])])
    slots = {k: sum(b["input_ids"].numel() for b in v) for k, v in batches.items()}
    model = model.to(device=device, dtype=dtype)
    batches = {k: _to(v, device) for k, v in batches.items()}
    for k in batches:  # warm-up
        B.run(model, batches[k][:1], attn)
    times: dict[str, list] = {k: [] for k in batches}
    for _ in range(size["rounds"]):
        for k, v in batches.items():
            _sync(device)
            t = time.perf_counter()
            B.run(model, v, attn)
            _sync(device)
            times[k].append(time.perf_counter() - t)
    del model
    _free(device)
    arms = {k: dict(micro_batches=len(batches[k]), padding=round(1 - real / slots[k], 3), seconds=round(min(t), 3),
                    real_tokens_per_s=round(real / min(t))) for k, t in times.items()}
    return dict(attn=attn, dtype=str(dtype).replace("torch.", ""), real_tokens=real, arms=arms,
                ratio=round(arms["packed"]["real_tokens_per_s"] / arms["padded"]["real_tokens_per_s"], 2),
                padding_bound=round((1 - arms["packed"]["padding"]) / (1 - arms["padded"]["padding"]), 2))


def section_vlm(device: str, quick: bool) -> dict:
    """VLM packing (Qwen2.5-VL, mRoPE): exactness of a packed row vs each document alone (fp32; bf16 where the device
    has it; flash_attention_2's varlen path on CUDA where flash-attn imports), then packed vs padded real tokens/s."""
    cuda = torch.device(device).type == "cuda"
    cases = [(torch.float32, "sdpa")]
    if cuda and torch.cuda.is_bf16_supported():
        cases.append((torch.bfloat16, "sdpa"))
        if flash_attn_status()[0]:
            cases.append((torch.bfloat16, "flash_attention_2"))
    rows = _section_rows()
    for dtype, attn in cases:
        rows.append(vlm_packed_vs_alone(device, dtype, attn))
    tp = vlm_throughput(device, quick)
    rows.append(dict(throughput=tp))
    exact = [r for r in rows if "passed" in r]
    summary = "; ".join(f"{r['attn']} {r['dtype']}: {'passed' if r['passed'] else 'FAILED'} ({r['why']})"
                        for r in exact)
    summary += (f"; throughput ({tp['attn']}, {tp['dtype']}): packed / padded real tokens/s {tp['ratio']}x "
                f"(padding bound {tp['padding_bound']}x)")
    return dict(status="passed" if all(r["passed"] for r in exact) else "FAILED", summary=summary, rows=list(rows))


# ---------------------------------------------------------------------------------------------- running, writing
def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


RUNNERS: dict[str, Callable[[str, bool], dict]] = {
    "packing": section_packing, "trainer": section_trainer, "guard": section_guard, "plan": section_plan,
    "throughput": section_throughput, "lean": section_lean, "hybrid": section_hybrid, "optim": section_optim,
    "vlm": section_vlm,
}


def environment(device: str) -> dict:
    import transformers

    env = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
               transformers=transformers.__version__, device=device, flash_attn=flash_attn_status()[1],
               torch_varlen=torch_varlen_status(device)[1])
    from importlib.metadata import PackageNotFoundError, version

    for name in ("trl", "datasets", "accelerate", "peft", "galore-torch", "apollo-torch"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = "not installed"
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                   gpus_visible=torch.cuda.device_count())
    return env


class SectionTimeout(BaseException):
    """A section ran past its time budget (a BaseException: the sections' own ``except Exception`` cannot eat it)."""


_ROWS: list[list] = [[]]


def _section_rows() -> list:
    """The running section's row list: rows appended here survive the section being stopped at its budget."""
    return _ROWS[-1]


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (``None`` or <= 0: no limit). Python code
    is interrupted between bytecodes; a CUDA kernel already launched finishes first (they are short here)."""
    import signal

    if not seconds or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"stopped at its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: ``--profile``: sections in order of value, each with its time budget in seconds (a stopped section keeps its rows).
#: ``full`` fits one device call (``timeout_s`` 520, device machine warm or not); ``rerun`` is the smaller second call.
PROFILES: dict[str, dict[str, Any]] = {
    # measured on an H100 (2026-11-27): packing 22.5 s, guard 0.3, trainer 8, throughput 66, plan 6.5, optim 228
    # (the 7B-shaped SVD refreshes: ~50 s each for galore-torch and svd), 332 s together
    # lean (not yet measured on a GPU): 8 cells of one step x 4 each; optim gets what is left of the total
    # vlm (not yet measured on a GPU; 8 s on CPU --quick): optim's budget went 185 -> 160 so the sum stays in the total
    "full": dict(quick=False, budget_s=450, sections={"packing": 45, "guard": 15, "trainer": 30, "throughput": 90,
                                                      "plan": 30, "lean": 45, "hybrid": 25, "optim": 160,
                                                      "vlm": 40}),
    "rerun": dict(quick=True, budget_s=150, sections={"packing": 40, "guard": 20, "trainer": 40, "throughput": 35,
                                                      "optim": 15}),
}


def run_sections(device: str, sections, quick: bool = False, log=print, budgets: dict[str, float] | None = None,
                 total_s: float | None = None, on_section: Callable[[dict], None] | None = None) -> dict:
    """Run ``sections`` on ``device`` in order. A section that raises is recorded as ``error`` with its traceback;
    one that outlives its budget (``budgets[name]``, cut to what is left of ``total_s``) as ``timeout`` with the
    rows it finished. ``on_section(results)`` runs after each section (the driver writes the files there)."""
    results = dict(environment=environment(device), sections={}, not_provable_on_one_gpu=NOT_PROVABLE_ON_ONE_GPU,
                   started=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), quick=quick)
    start = time.perf_counter()
    for name in sections:
        budget = (budgets or {}).get(name)
        if total_s is not None:
            left = total_s - (time.perf_counter() - start)
            if left < 5:
                results["sections"][name] = dict(status="skipped: no time left", summary=f"{total_s:.0f} s spent",
                                                 seconds=0.0)
                log(f"gpu_check: {name}: skipped: no time left")
                continue
            budget = min(budget, left) if budget else left
        t0 = time.perf_counter()
        _ROWS.append([])
        try:
            with time_limit(budget):
                res = RUNNERS[name](device, quick)
        except SectionTimeout as e:
            rows = _section_rows()
            res = dict(status="timeout", summary=f"{e}; {len(rows)} row(s) finished", rows=list(rows))
            _free(device)
        except Exception as e:
            res = dict(status="error", summary=f"{type(e).__name__}: {str(e)[:300]}",
                       traceback=traceback.format_exc()[-4000:], rows=list(_section_rows()))
            _free(device)
        finally:
            _ROWS.pop()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        if budget:
            res["budget_s"] = round(budget, 1)
        results["sections"][name] = res
        log(f"gpu_check: {name}: {res['status']} ({res['seconds']} s): {res['summary']}")
        if on_section is not None:
            on_section(results)
    return results


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render_markdown(results: dict) -> str:
    """The results file: a summary table, one table per section, the not-provable list, and the whole result as
    a ``json`` block (read it back with :func:`read_results`)."""
    env = results["environment"]
    lines = [f"# GPU check: {env.get('gpu', env.get('device'))}", "",
             f"`bash scripts/gpu_check.sh` ({results.get('started', '')}{', --quick' if results.get('quick') else ''}): "
             + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             "| check | status | result | seconds |", "|---|---|---|---:|"]
    for name, sec in results["sections"].items():
        lines.append(f"| {name} | {sec['status']} | {sec['summary']} | {sec.get('seconds', '')} |")
    packing = results["sections"].get("packing", {}).get("rows")
    if packing:
        lines += ["", "## Packed vs separate (relative errors against fp64 eager, separate sequences)", "",
                  "| arch | attention | dtype | logits packed | logits separate | logits control (mixed) | grads packed "
                  "| grads separate | verdict |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in packing:
            lines.append(f"| {r['arch']} | {r['attn']} | {r['dtype']} | {_fmt(r['logits']['packed'])} | "
                         f"{_fmt(r['logits']['separate'])} | {_fmt(r['logits']['control'])} | {_fmt(r['grads']['packed'])} | "
                         f"{_fmt(r['grads']['separate'])} | {'passed' if r['passed'] else 'FAILED'}: {r['why']} |")
        lines += ["", "Tolerance: fp32 <= 1e-5 relative; bf16/fp16: packed <= 2 x the same dtype's unpacked error, and "
                  "the mixing control >= 10 x that error (else the dtype could not detect the bug)."]
    plan = [case for case in results["sections"].get("plan", {}).get("rows") or [] if case.get("rows")]
    if plan:
        lines += ["", "## Planner vs allocator", "", "| settings | component | measured GiB | closed form GiB | "
                  "closed form err | --simulate GiB | --simulate err |", "|---|---|---:|---:|---:|---:|---:|"]
        for case in plan:
            for r in case.get("rows", []):
                gib = lambda b: "-" if b is None else f"{b / 2**30:.3f}"  # noqa: E731
                err = lambda e: "-" if e is None else f"{e:+.1%}"  # noqa: E731
                lines.append(f"| {case['settings']} | {r['component']} | {gib(r['measured'])} | {gib(r['closed'])} | "
                             f"{err(r['closed_err'])} | {gib(r['traced'])} | {err(r['traced_err'])} |")
    for key, title in (("throughput", "Throughput (real tokens/s, one epoch each)"), ("optim", "Optimizer step")):
        rows = results["sections"].get(key, {}).get("rows")
        if not rows:
            continue
        arms = rows[0]["arms"]
        cols = sorted({k for v in arms.values() for k in v})
        lines += ["", f"## {title}", "", "| arm | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        cell = lambda c, x: f"{x / 2**20:.1f} MiB" if (c.endswith("_bytes") and x is not None) else _fmt(x)  # noqa: E731
        lines += [f"| {a} | " + " | ".join(cell(c, v.get(c)) for c in cols) + " |" for a, v in arms.items()]
    lean = results["sections"].get("lean", {}).get("rows")
    if lean:
        lines += ["", "## The lean loss head beside the stock head (one training step)", "",
                  "| vocab | tokens | dtype | stock peak MiB | lean peak MiB | lean / stock memory | stock ms | lean ms | "
                  "lean / stock time | head gradient error |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
        for r in lean:
            lines.append(f"| {r['vocab']:,} | {r['tokens']:,} | {r['dtype']} | {mib(r['stock_peak_bytes'])} | "
                         f"{mib(r['lean_peak_bytes'])} | {r.get('mem_ratio', '-')} | {r['stock_ms']} | {r['lean_ms']} | "
                         f"{r['time_ratio']} | {_fmt(r['grad_rel_err'])} |")
    hybrid = results["sections"].get("hybrid", {}).get("rows")
    if hybrid:
        lines += ["", "## Hybrid packing (one packed row vs each document alone, fp32)", "",
                  "Kernels: " + ", ".join(f"{k} {v}" for k, v in results["sections"]["hybrid"].get("kernels", {}).items()),
                  "", "| family | layers (split / kernels) | grad rel err | stock's error | ms | every layer split: "
                  "grad, ms |", "|---|---|---:|---:|---:|---|"]
        for r in hybrid:
            if "error" in r:
                lines.append(f"| {r['family']} | {r['error']} | - | - | - | - |")
                continue
            layers = "; ".join(("kernels: " if x["handed_to_kernels"] else "split: ") + x["layer"] for x in r["layers"])
            alt = f"{_fmt(r['split_grad_rel_err'])}, {r['split_ms']}" if "split_ms" in r else "-"
            lines.append(f"| {r['family']} | {layers} | {_fmt(r['grad_rel_err'])} | {_fmt(r['stock_grad_rel_err'])} | "
                         f"{r['ms']} | {alt} |")
    vlm = results["sections"].get("vlm", {}).get("rows")
    if vlm:
        lines += ["", "## VLM packing (Qwen2.5-VL: one packed row vs each document alone, against fp32 eager alone)", "",
                  "| attention | dtype | logits packed | logits alone | logits control (no restarted positions) | "
                  "grads packed | grads alone | verdict |", "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in vlm:
            if "passed" in r:
                lines.append(f"| {r['attn']} | {r['dtype']} | {_fmt(r['logits']['packed'])} | "
                             f"{_fmt(r['logits']['separate'])} | {_fmt(r['logits']['control'])} | "
                             f"{_fmt(r['grads']['packed'])} | {_fmt(r['grads']['separate'])} | "
                             f"{'passed' if r['passed'] else 'FAILED'}: {r['why']} |")
        for r in vlm:
            if "throughput" in r:
                tp = r["throughput"]
                lines += ["", f"VLM throughput ({tp['attn']}, {tp['dtype']}, {tp['real_tokens']} real tokens, fastest "
                          f"round): packed / padded {tp['ratio']}x, padding bound {tp['padding_bound']}x", "",
                          "| way | micro-batches | padding | seconds | real tokens/s |", "|---|---:|---:|---:|---:|"]
                lines += [f"| {k} | {a['micro_batches']} | {a['padding']:.1%} | {a['seconds']} | "
                          f"{a['real_tokens_per_s']} |" for k, a in tp["arms"].items()]
    lines += ["", "## What one GPU cannot prove", ""] + [f"- {x}" for x in results["not_provable_on_one_gpu"]]
    lines += ["", "## Raw results", "", "```json", json.dumps(results, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def read_results(path: str | Path) -> dict:
    """The JSON block of a results file written by :func:`write_results`."""
    text = Path(path).read_text(encoding="utf-8")
    start = text.index("```json\n") + len("```json\n")
    return json.loads(text[start:text.index("\n```", start)])


def merge_results(old: dict, new: dict) -> dict:
    """``new`` with the sections of ``old`` it did not run (same GPU only: mixing devices would mislead).

    >>> old = {"environment": {"gpu": "H100"}, "sections": {"a": 1, "b": 2}}
    >>> merge_results(old, {"environment": {"gpu": "H100"}, "sections": {"b": 3}})["sections"]
    {'a': 1, 'b': 3}
    """
    if old.get("environment", {}).get("gpu") != new.get("environment", {}).get("gpu"):
        raise SystemExit(f"gpu_check: --merge: the existing file is from {old.get('environment', {}).get('gpu')}, "
                         f"this run is on {new.get('environment', {}).get('gpu')}; write to another --out")
    merged = dict(new)
    merged["sections"] = {**old.get("sections", {}), **new["sections"]}
    return merged


def write_results(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(results), encoding="utf-8")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default=None,
                    help="sections in order of value with time budgets: full (one device call) or rerun (smaller)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the results file (markdown + a JSON block)")
    ap.add_argument("--out-dir", default=None,
                    help="write gpu-check.md and gpu-check.json here after every section (overrides --out)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for all sections together")
    ap.add_argument("--device", default="cuda", help="cpu runs the logic on the reference kernel (tests)")
    ap.add_argument("--plan-all", action="store_true", help="plan: also amp-bf16 and full recomputation (+4-8 min)")
    ap.add_argument("--plan-trace", action="store_true", help="plan: also --simulate (1-4 min of host CPU per case)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other sections of an existing --out file (to run sections in separate commands)")
    ns = ap.parse_args(argv)
    profile = PROFILES.get(ns.profile or "", {})
    budgets = dict(profile.get("sections", {}))
    if ns.only:
        sections = [s.strip() for s in ns.only.split(",") if s.strip()]
    else:
        sections = list(budgets) if budgets else list(SECTIONS)
    unknown = [s for s in sections if s not in RUNNERS]
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    quick = ns.quick or bool(profile.get("quick"))
    total_s = ns.budget_s if ns.budget_s is not None else profile.get("budget_s")
    if ns.device == "cuda":
        reason = skip_reason()
        if reason:
            print(f"gpu_check: skipped: {reason}; nothing written")
            return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    if ns.plan_all or ns.plan_trace:
        more, trace = ns.plan_all, ns.plan_trace
        RUNNERS["plan"] = lambda device, quick: section_plan(device, quick, more=more, trace=trace)
    out = Path(ns.out_dir) / "gpu-check.md" if ns.out_dir else Path(ns.out)
    old = read_results(out) if (ns.merge and out.exists()) else None

    def save(results: dict) -> None:  # after every section: a run stopped later still returns what it measured
        merged = merge_results(old, results) if old is not None else results
        write_results(merged, out)
        if ns.out_dir:
            (Path(ns.out_dir) / "gpu-check.json").write_text(json.dumps(merged, indent=1, default=str), encoding="utf-8")

    results = run_sections(ns.device, sections, quick, budgets=budgets, total_s=total_s, on_section=save)
    save(results)
    bad = [n for n, s in results["sections"].items() if s["status"] in ("FAILED", "error")]
    print(f"gpu_check: wrote {out}; " + (f"FAILED: {', '.join(bad)}" if bad else "no failures"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
