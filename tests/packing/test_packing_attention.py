"""Packed rows compute exactly what separate runs compute (logits and gradients), on sdpa, eager and the
reference varlen (FlashAttention code path) attention, for five architectures; controls show what mixing looks
like; the reference kernel matches per-sequence attention; the guard accepts good models and rejects bad ones.

Tiny random-init fp32 models (hidden 32, 2 layers, 4 heads, 2 KV heads, initializer_range 0.2 so that attention is
peaked and mixing shows), sliding windows shrunk to 3 tokens, Gemma2 attention softcap 1.0.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version

from hf_gradfix.packing.attention import (
    REFERENCE_VARLEN_ATTENTION,
    reference_branch_counts,
    reference_flash_attn_varlen_func,
    register_reference_varlen_attention,
    reset_reference_branch_counts,
    select_varlen_attention,
    set_attention_implementation,
    unregister_reference_varlen_attention,
)
from hf_gradfix.packing.collator import PackedCollator, check_packed_batch
from hf_gradfix.packing.guard import PackingCheckError, check_model_packs_correctly

TF5 = Version(transformers.__version__) >= Version("5.0.0")
REF = register_reference_varlen_attention()
VOCAB = 64
LENGTHS = [5, 9, 1, 7, 4]
TOL = 1e-5
CONTROL_MIN = 1e-2
PRINT = os.environ.get("HF_GRADFIX_PRINT_DIFFS") == "1"

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    initializer_range=0.2,
)


def _config(arch: str, **overrides):
    kw = dict(COMMON)
    if arch == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **kw)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(num_key_value_heads=2, **kw)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(num_key_value_heads=2, sliding_window=3, **kw)
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=3,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=5.0,
            query_pre_attn_scalar=8,
            **kw,
        )
    elif arch == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(**kw)
    elif arch == "opt":
        cfg = transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
            max_position_embeddings=64, word_embed_proj_dim=32, init_std=0.2,
        )
    elif arch == "falcon":
        cfg = transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=64,  # 2048 by default: 4.57's eager path then spent 50 s on a tiny model
        )
    else:  # pragma: no cover
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "opt": "OPTForCausalLM",
    "falcon": "FalconForCausalLM",
}


def _model(arch: str, impl: str, **overrides):
    torch.manual_seed(0)
    cls = getattr(transformers, _CLASSES[arch])
    # transformers 5.x cannot *build* a model with a custom "flash" name (it looks it up as a hub kernel): build
    # with eager and switch, which works on 4.57 and 5.x alike.
    model = cls._from_config(_config(arch, **overrides), attn_implementation="eager" if impl == REF else impl)
    if impl == REF:
        set_attention_implementation(model, REF)
    return model.eval()


def _sequences(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _token_loss_sum(logits, labels):
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")


def _separate(model, seqs):
    """Each sequence alone (its own forward): logits concatenated, and gradients of the global token mean."""
    model.zero_grad(set_to_none=True)
    n_targets = sum(len(s) - 1 for s in seqs)
    logits = []
    for s in seqs:
        out = model(input_ids=s.unsqueeze(0), use_cache=False).logits[0]
        (_token_loss_sum(out, s) / n_targets).backward()
        logits.append(out.detach())
    return torch.cat(logits), _grads(model)


def _packed(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    labels = batch["labels"][0]
    n_targets = int((labels[1:] != -100).sum())
    loss = _token_loss_sum(out.logits[0], labels) / n_targets
    # transformers' own loss on the packed labels is the same token mean
    assert abs(float(out.loss.detach()) - float(loss.detach())) < 1e-6
    loss.backward()
    return out.logits[0].detach(), _grads(model)


def _max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


ARCHS = ["llama", "qwen2", "mistral", "gemma2", "gpt_neox"]
PATHS = ["sdpa", "eager", REF]


def _skip_unsupported(arch, impl):
    if arch == "gemma2" and impl == "sdpa" and TF5:
        pytest.skip("transformers 5.x refuses sdpa for Gemma2 (_supports_sdpa=False because of the attention softcap)")


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_separate_logits_and_gradients(arch, impl):
    _skip_unsupported(arch, impl)
    model = _model(arch, impl)
    seqs = _sequences()
    batch = PackedCollator()([{"input_ids": s} for s in seqs])
    check_packed_batch(batch)

    ref_logits, ref_grads = _separate(model, seqs)
    reset_reference_branch_counts()
    logits, grads = _packed(model, batch)
    branches = reference_branch_counts()
    logit_diff = float((logits - ref_logits).abs().max())
    grad_diff = _max_grad_diff(grads, ref_grads)

    with torch.no_grad():
        # control 1: the same row without restarted positions (and without cu_seq_lens): sequences mix
        plain = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
        control = float((plain - ref_logits).abs().max())
        # control 2: restarted positions + an all-ones attention_mask
        ones = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(batch["input_ids"]),
            use_cache=False,
        ).logits[0]
        ones_diff = float((ones - ref_logits).abs().max())
    if PRINT:
        print(f"\nDIFF {transformers.__version__} {arch} {impl} logits {logit_diff:.2e} grads {grad_diff:.2e} "
              f"control(no restart) {control:.2e} all-ones-mask {ones_diff:.2e}")

    assert logit_diff <= TOL, logit_diff
    assert grad_diff <= TOL, grad_diff
    assert control > CONTROL_MIN, control
    if impl == REF:
        # the FlashAttention code path really ran varlen on cu_seq_lens, once per layer
        assert branches == {"cu_seq_lens": model.config.num_hidden_layers}
        # FlashAttention drops an all-ones mask (flash_attention_mask returns None): still exact
        assert ones_diff <= TOL
    else:
        # sdpa/eager: ANY attention_mask switches packed detection off -> mixing (the pitfall the collator avoids)
        assert ones_diff > CONTROL_MIN

    # the guard agrees
    report = check_model_packs_correctly(model)
    assert report.passed and report.attn_implementation == impl


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt_neox"])
def test_rows_mode_equals_separate(arch, impl):
    model = _model(arch, impl)
    seqs = _sequences([5, 9, 1, 7, 4, 3])
    bins = [[{"input_ids": s} for s in seqs[:2]], [{"input_ids": s} for s in seqs[2:4]], [{"input_ids": s} for s in seqs[4:]]]
    batch = PackedCollator(mode="rows", pad_token_id=0)(bins)
    assert batch["input_ids"].shape == (3, 14)  # rows of 14, 8, 7 tokens: two padded tails
    check_packed_batch(batch)
    ref_logits, ref_grads = _separate(model, seqs)

    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False).logits
    n_targets = sum(len(s) - 1 for s in seqs)
    loss = sum(_token_loss_sum(out[r], batch["labels"][r]) for r in range(3)) / n_targets
    loss.backward()
    real = torch.cat([out[0, :14], out[1, :8], out[2, :7]]).detach()
    logit_diff = float((real - ref_logits).abs().max())
    grad_diff = _max_grad_diff(_grads(model), ref_grads)
    if PRINT:
        print(f"\nDIFF {transformers.__version__} {arch} {impl} rows logits {logit_diff:.2e} grads {grad_diff:.2e}")
    assert logit_diff <= TOL and grad_diff <= TOL
    assert check_model_packs_correctly(model, mode="rows").passed


@pytest.mark.parametrize("impl", PATHS)
def test_varlen_pad_segment_is_exact(impl):
    model = _model("mistral", impl)
    seqs = _sequences([5, 9, 4])
    batch = PackedCollator(pad_to_multiple_of=8)([{"input_ids": s} for s in seqs])
    assert batch["input_ids"].shape == (1, 24)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
        out = model(**batch, use_cache=False).logits[0, :18]
    assert float((out - ref).abs().max()) <= TOL


def test_sliding_window_and_softcap_really_bite():
    seq = _sequences([9])[0].unsqueeze(0)
    with torch.no_grad():
        for arch, change in (("mistral", {"sliding_window": None}), ("gemma2", {"attn_logit_softcapping": None})):
            a = _model(arch, "eager")(input_ids=seq, use_cache=False).logits
            b = _model(arch, "eager", **change)(input_ids=seq, use_cache=False).logits
            assert float((a - b).abs().max()) > CONTROL_MIN, (arch, change)


def test_use_cache_default_mixes_sequences_on_sdpa():
    """The pitfall the guard closes: config.use_cache=True builds a cache inside forward -> no packed detection."""
    model = _model("llama", "sdpa")
    model.config.use_cache = True
    seqs = _sequences()
    batch = PackedCollator()([{"input_ids": s} for s in seqs])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
        cached = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    assert float((cached - ref).abs().max()) > CONTROL_MIN
    check_model_packs_correctly(model)
    assert model.config.use_cache is False


# ------------------------------------------------------------------------------------------ the kernel
def _explicit_attention(q, k, v, causal, window, softcap, scale):
    """Independent per-sequence attention: sdpa with an explicit bool mask, or eager math when softcapped."""
    lq, lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    i = torch.arange(lq).unsqueeze(1) + (lk - lq)
    j = torch.arange(lk).unsqueeze(0)
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, L, D)
    if softcap:
        s = (qh @ kh.transpose(-1, -2)) * scale
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(s, -1) @ vh
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (3, 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_kernel_equals_per_sequence_attention(causal, window, softcap):
    g = torch.Generator().manual_seed(3)
    lens = [3, 8, 1, 6]
    total = sum(lens)
    q = torch.randn(total, 4, 8, generator=g, dtype=torch.float64) * 2
    k = torch.randn(total, 2, 8, generator=g, dtype=torch.float64) * 2
    v = torch.randn(total, 2, 8, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 3, 11, 12, 18], dtype=torch.int32)
    scale = 0.3
    out = reference_flash_attn_varlen_func(
        q, k, v, cu, cu, 8, 8, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap
    )
    expected = torch.cat([
        _explicit_attention(q[a:b], k[a:b], v[a:b], causal, window, softcap, scale)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    ])
    assert out.shape == (total, 4, 8)
    assert float((out - expected).abs().max()) < 1e-12


def test_reference_kernel_bottom_right_causal_and_empty_rows():
    """len_q != len_k: causal aligned to the bottom-right corner; rows that see no key give zeros (flash-attn)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2 + 5, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(6 + 3, 1, 4, generator=g, dtype=torch.float64)
    v = torch.randn(6 + 3, 1, 4, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    out = reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    scale = 1 / math.sqrt(4)
    # sequence 0: 2 queries over 6 keys -> query i sees keys <= i + 4
    assert torch.allclose(out[:2], _explicit_attention(q[:2], k[:6], v[:6], True, (-1, -1), 0.0, scale))
    # sequence 1: 5 queries over 3 keys -> the first two queries see nothing -> zeros
    assert torch.equal(out[2:4], torch.zeros_like(out[2:4]))
    assert torch.allclose(out[4:], _explicit_attention(q[2:7], k[6:], v[6:], True, (-1, -1), 0.0, scale)[2:])


def test_reference_kernel_gradients_match_autograd_of_explicit_attention():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(9, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    w = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)
    (reference_flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, window_size=(2, 2), softcap=2.0) * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    exp = torch.cat([_explicit_attention(q[a:b], k[a:b], v[a:b], True, (2, 2), 2.0, 1 / math.sqrt(8)) for a, b in ((0, 4), (4, 9))])
    (exp * w).sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        assert float((a - b).abs().max()) < 1e-12


@pytest.mark.parametrize(
    "cu, max_len, match",
    [
        (torch.tensor([0, 3, 6]), 3, "must be int32"),
        (torch.tensor([1, 3, 6], dtype=torch.int32), 3, "must start at 0"),
        (torch.tensor([0, 3, 5], dtype=torch.int32), 3, "must end at the number of tokens"),
        (torch.tensor([0, 4, 3, 6], dtype=torch.int32), 4, "non-decreasing"),
        (torch.tensor([0, 2, 6], dtype=torch.int32), 3, "longest sequence has 4 tokens"),
    ],
)
def test_reference_kernel_validates_cu_seqlens(cu, max_len, match):
    q = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match=match):
        reference_flash_attn_varlen_func(q, q, q, cu, cu, max_len, max_len, causal=True)


def test_reference_path_infers_boundaries_from_position_ids_without_cu_seq_lens():
    model = _model("mistral", REF)
    seqs = _sequences()
    batch = PackedCollator()([{"input_ids": s} for s in seqs])
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
        reset_reference_branch_counts()
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    assert reference_branch_counts() == {"position_ids": 2}
    assert float((out - ref).abs().max()) <= TOL


def test_reference_path_padding_mask_branch_equals_separate():
    """A padded batch with a 0/1 attention_mask takes the unpad branch (as real FA2 does) and stays exact."""
    model = _model("qwen2", REF)
    seqs = _sequences([7, 4])
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    with torch.no_grad():
        ref = [model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs]
        reset_reference_branch_counts()
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert reference_branch_counts() == {"padding_mask": 2}
    assert float((out[0] - ref[0]).abs().max()) <= TOL and float((out[1, :4] - ref[1]).abs().max()) <= TOL


def test_reference_path_generation_with_cache_matches_eager():
    """Decoding with a KV cache (len_q=1 < len_k: bottom-right causal alignment) gives eager's greedy tokens."""
    prompt = _sequences([6])[0].unsqueeze(0)
    outs = {}
    for impl in ("eager", REF):
        model = _model("mistral", impl)
        model.generation_config.pad_token_id = 0
        outs[impl] = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(outs["eager"], outs[REF])


# ------------------------------------------------------------------------------------------ registration
def test_registration_is_idempotent_and_reversible():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert register_reference_varlen_attention() == REF == REFERENCE_VARLEN_ATTENTION
    assert register_reference_varlen_attention() == REF
    assert REF in AttentionInterface._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[REF] is ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    name = register_reference_varlen_attention("flash_varlen_reference_tmp")
    assert unregister_reference_varlen_attention(name) is True
    assert name not in AttentionInterface._global_mapping and name not in ALL_MASK_ATTENTION_FUNCTIONS
    assert unregister_reference_varlen_attention(name) is False
    assert unregister_reference_varlen_attention("sdpa") is False  # never removes what it did not register
    for bad in ("varlen_reference", "flash_attention_2", "flash_attention_7", "org/flash-kernel"):
        with pytest.raises(ValueError):
            register_reference_varlen_attention(bad)


def test_select_varlen_attention_on_this_machine():
    expected = "flash_attention_2" if (torch.cuda.is_available() and transformers.utils.is_flash_attn_2_available()) else REF
    assert select_varlen_attention() == expected
    assert select_varlen_attention("cpu") == REF


def test_set_attention_implementation_round_trip():
    model = _model("llama", "sdpa")
    assert set_attention_implementation(model, REF) == "sdpa"
    assert model.config._attn_implementation == REF and model.model.config._attn_implementation == REF
    assert set_attention_implementation(model, "eager") == REF
    assert model.config._attn_implementation == "eager"


# ------------------------------------------------------------------------------------------ the guard
class _AllOnesMaskLlama(transformers.LlamaForCausalLM):
    """A model 'forced to ignore packing': it always passes an all-ones attention_mask (a common custom-loop bug)."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


def test_guard_rejects_a_model_that_mixes_sequences_with_the_class_and_the_reason():
    torch.manual_seed(0)
    model = _AllOnesMaskLlama._from_config(_config("llama"), attn_implementation="sdpa").eval()
    with pytest.raises(PackingCheckError) as e:
        check_model_packs_correctly(model)
    msg = str(e.value)
    assert msg.startswith("_AllOnesMaskLlama cannot be trained on packed sequences with attn_implementation='sdpa'")
    assert "it ignores position_ids-based packing: sequences attend to each other" in msg
    assert "measured in self_attn (LlamaAttention, 2 layer(s))" in msg  # the layer named by measurement
    report = e.value.report
    assert report.first_sequence_diff <= 1e-5 < CONTROL_MIN < report.max_diff
    # the same model on the FlashAttention path is fine: the flash mask function drops an all-ones mask
    assert check_model_packs_correctly(model, attn_implementation=REF).passed
    assert model.config._attn_implementation == "sdpa"  # restored


def _measured_packing_diff(model, lengths=LENGTHS):
    """The ground truth for a guard verdict, measured here: max |logit| difference between every sequence of one
    packed row (PackedCollator, restarted positions) and the same sequence run alone; None if the model cannot
    even run on this attention path."""
    seqs = _sequences(lengths)
    batch = PackedCollator()([{"input_ids": s} for s in seqs])
    batch.pop("labels")
    with torch.no_grad():
        try:
            alone = torch.cat([model(input_ids=s.unsqueeze(0), use_cache=False).logits[0] for s in seqs])
            packed = model(**batch, use_cache=False).logits[0]
        except Exception:  # noqa: BLE001 - a model that cannot run on this path cannot pack on it either
            return None
    return float((packed - alone).abs().max())


def _assert_guard_follows_measurement(model, arch_class):
    """The guard passes a model exactly when the measurement says its packed sequences stay apart, and refuses it
    (naming the class and the reason) when they mix or the packed row cannot run."""
    was_training = model.training
    diff = _measured_packing_diff(model)
    report = check_model_packs_correctly(model, raise_on_failure=False)
    assert model.training == was_training  # restored
    if PRINT:
        print(f"\nGUARD {transformers.__version__} {arch_class} {model.config._attn_implementation}: measured "
              f"{diff if diff is None else f'{diff:.2e}'}, guard {'passed' if report.passed else 'refused'}: {report.reason}")
    if diff is not None and diff <= TOL:
        assert report.passed, (diff, report)
        return "apart"
    assert not report.passed, (diff, report)
    if diff is None:
        assert "raised" in report.reason, report
    else:
        assert diff > CONTROL_MIN, diff  # a refusal is for real mixing, not numerics
        assert "sequences attend to each other" in report.reason, report
    with pytest.raises(PackingCheckError, match=rf"^{arch_class} cannot "):
        check_model_packs_correctly(model)
    return "refused"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["opt", "falcon"])
def test_guard_verdict_on_real_architectures_follows_the_measurement(arch, impl):
    """OPT and Falcon built their causal masks without position_ids in the releases this project started on, so
    packed sequences attended to each other; transformers releases change that (Falcon keeps them apart from 5.24
    on). The expected verdict is measured in the test, never assumed from the release."""
    model = _model(arch, impl)
    model.train()
    _assert_guard_follows_measurement(model, _CLASSES[arch])


def test_guard_verdict_for_falcon_on_the_flash_path_follows_the_measurement():
    """Falcon on the reference varlen path: it mixed (4.57: its own code without a mask) or crashed (5.x: None mask)
    in the releases this project started on; whatever this release does, the guard agrees with the measurement."""
    _assert_guard_follows_measurement(_model("falcon", REF), _CLASSES["falcon"])


def test_the_measurement_sees_mixing_on_a_model_that_mixes():
    """Control: the measurement the verdict tests rely on does detect mixing (a model forced to ignore packing),
    and the guard refuses that model, so the tests above can fail."""
    torch.manual_seed(0)
    model = _AllOnesMaskLlama._from_config(_config("llama"), attn_implementation="sdpa").eval()
    assert _measured_packing_diff(model) > CONTROL_MIN
    assert _assert_guard_follows_measurement(model, "_AllOnesMaskLlama") == "refused"
    assert _assert_guard_follows_measurement(_model("llama", "sdpa"), "LlamaForCausalLM") == "apart"


def test_guard_rejects_rows_mode_on_the_flash_path():
    model = _model("llama", REF)
    with pytest.raises(PackingCheckError, match="only in ONE row with cu_seq_lens; use mode='varlen'"):
        check_model_packs_correctly(model, mode="rows")
    assert check_model_packs_correctly(model, mode="varlen").passed


def test_guard_can_return_the_failing_report():
    torch.manual_seed(0)
    model = _AllOnesMaskLlama._from_config(_config("llama"), attn_implementation="sdpa").eval()
    report = check_model_packs_correctly(model, raise_on_failure=False)
    assert not report.passed and report.model_class == "_AllOnesMaskLlama"
    assert report.max_diff > CONTROL_MIN and report.first_sequence_diff <= 1e-5
