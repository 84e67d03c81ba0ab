"""hf_gradfix's probes on a 4-bit (bitsandbytes) QLoRA model: they leave the quantized weights as they are, and the
patched Trainer trains it exactly.

Found by the peer suites (TRL's test_peft_with_quantization): the loss probe ran the model in eval mode without
gradients, and bitsandbytes 0.50 repacks a 4-bit layer's weights in place into an inference-only layout on such a
forward on a CPU with AVX512-BF16; QLoRA training then failed where stock trained (an assertion at hidden size 48,
an in-place error at 64). The probes now leave modules holding quantized parameters in their mode
(``hf_gradfix/probe_mode.py``). The control, measured in the test: on this CPU one eval-mode forward without gradients
(what the probe used to run) changes a frozen 4-bit weight or raises.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformers
from torch.utils.data import SequentialSampler

import harness as H
import hf_gradfix
from test_exactness import GRAD_TOL

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


class _InOrder(transformers.Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def _qlora(hidden: int):
    cfg = transformers.Qwen2Config(vocab_size=H.VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   pad_token_id=H.PAD_ID)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="hgf_qlora_")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map="cpu")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def _frozen(model) -> dict[str, torch.Tensor]:
    return {n: p.data.clone() for n, p in model.named_parameters() if not p.requires_grad}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _eval_forward_changes_weights(hidden: int) -> bool:
    """The control: one eval-mode forward without gradients on a fresh 4-bit model (what the probe used to run)."""
    model = _qlora(hidden)
    before = _frozen(model)
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    except (AssertionError, RuntimeError):
        return True
    return not _same(before, _frozen(model))


@pytest.mark.parametrize("hidden", [48, 64])
def test_patched_qlora_trains_exactly_and_keeps_its_4bit_weights(hidden, tmp_path):
    samples = H.make_samples("causal", n=8, seed=0, lo=4, hi=14)
    model = _qlora(hidden)
    before = _frozen(model)
    capture = H.GradCapture()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=4, gradient_accumulation_steps=2,
        per_device_train_batch_size=1, learning_rate=0.0, optim="sgd", save_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, seed=3)
    hf_gradfix.patch()
    try:
        trainer = _InOrder(model=model, args=args, train_dataset=H.TokenDataset(samples), callbacks=[capture])
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    assert any(not p.is_floating_point() for p in model.parameters())  # the model really holds quantized weights
    assert _same(before, _frozen(model)), "a frozen (4-bit) weight changed during the patched run"
    assert len(capture.grads) == 4
    for k, grads in enumerate(capture.grads):
        _, gt = H.ground_truth(model, samples[2 * k: 2 * k + 2], "causal")
        gt = {n: g for n, g in gt.items() if n in grads}
        assert gt and H.rel_err(grads, gt) <= GRAD_TOL, (k, H.rel_err(grads, gt))
    affected = any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules())
    if affected:  # bitsandbytes' own flag for this CPU: the hazard must show without the fix
        assert _eval_forward_changes_weights(hidden), "the control did not change the 4-bit weights on this CPU"
