"""``loss.head: lean``: the head and its cross-entropy together, never the logits of a micro-batch; exact.

Ground truth: harness.ground_truth (plain PyTorch, one process, each sample's own forward with the model's own logits
and cross-entropy, summed over the window and divided by its target count) on the batches the Trainer used. The
lean path's use is measured in each test (its call counter, the stock calls), never assumed. Memory and speed are in
benchmarks/lean_head.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import harness as H
import hf_gradfix
from hf_gradfix.integration import lean_head
from hf_gradfix.integration.state import state_of

TOL = 1e-5
LEAN = {"loss": {"head": "lean"}, "log_fixes": False}


@pytest.fixture
def lean():
    hf_gradfix.patch(LEAN)
    yield
    hf_gradfix.unpatch()


def _tied_llama():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**H._DECODER, "tie_word_embeddings": True})
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").float()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # measured: the head is the embedding
    return model


def _assert_exact(rows, what):
    for grad_err, loss_err in rows:
        assert grad_err <= TOL, (what, rows)
        assert loss_err is None or loss_err <= TOL, (what, rows)


def _run(model, samples, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = H.run_trainer(model, samples, "causal", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               **kw)
    return record, [str(w.message) for w in caught if "loss.head: lean" in str(w.message)]


@pytest.mark.parametrize("build", ["llama", "qwen2", "gpt2", "tied"])
def test_lean_head_gradient_and_loss_are_the_ground_truth(lean, build):
    model = _tied_llama() if build == "tied" else H.build_model(build)
    samples = H.make_samples("causal", n=8, seed=1, prompt_mask_frac=0.3)
    record, said = _run(model, samples)
    plan = state_of(record.trainer).lean
    assert plan.calls == 4 and plan.stock_calls == 0 and not said, (plan, said)  # every micro-batch ran lean
    _assert_exact(H.check_against_gt(model, samples, "causal", record), build)
    # nothing stays on the model: the head's forward and the loss function are the class's again
    head = model.get_output_embeddings()
    assert "forward" not in head.__dict__ and "_loss_function" not in model.__dict__


def test_control_a_lean_sum_divided_by_its_own_count_fails(lean, monkeypatch):
    """The control: the lean sum normalized by the micro-batch's own targets (the bug the plugin exists to fix) is
    caught by the same comparison."""
    original = lean_head._Call.loss_function

    def local_mean(self, *args, num_items_in_batch=None, **kwargs):
        return original(self, *args, num_items_in_batch=None, **kwargs)

    monkeypatch.setattr(lean_head._Call, "loss_function", local_mean)
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=8, seed=1, prompt_mask_frac=0.3)
    record, _ = _run(model, samples)
    assert state_of(record.trainer).lean.calls == 4
    worst = max(err for err, _ in H.check_against_gt(model, samples, "causal", record))
    assert worst > 1e-3, worst


def test_soft_capped_logits_keep_the_stock_head_said_once_and_exact(lean):
    """Gemma 2 soft-caps its logits between the head and the loss: the lean loss would be another objective. The
    first call finds it (the loss function does not receive the head's own output) and reruns stock; one warning."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma2Config(**{**H._DECODER, "head_dim": 16}, final_logit_softcapping=3.0, attn_logit_softcapping=None,
                          query_pre_attn_scalar=16, sliding_window=4096)
    model = tf.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager").float()
    samples = H.make_samples("causal", n=8, seed=1)
    record, said = _run(model, samples)
    plan = state_of(record.trainer).lean
    assert plan.calls == 0 and plan.stock_calls == 4, plan
    assert len(said) == 1 and "transformed between the output layer and the loss" in said[0], said
    _assert_exact(H.check_against_gt(model, samples, "causal", record), "gemma2 soft-capping")


def test_lora_on_the_head_is_exact(lean):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(H.build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False))
    samples = H.make_samples("causal", n=8, seed=2, prompt_mask_frac=0.3)
    record, said = _run(model, samples)
    plan = state_of(record.trainer).lean
    assert plan.calls == 4 and not said, (plan, said)
    grads = record.steps[0]["grads"]
    assert any("lm_head.lora_B" in name and g.abs().sum() > 0 for name, g in grads.items())  # the adapter learns
    _assert_exact(H.check_against_gt(model, samples, "causal", record), "lora on lm_head")


def test_lora_dropout_on_the_head_keeps_the_stock_head(lean):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(H.build_model("llama"), peft.LoraConfig(
        r=4, target_modules=["lm_head"], lora_dropout=0.1, init_lora_weights=False))
    samples = H.make_samples("causal", n=4, seed=2)
    record, said = _run(model, samples)
    plan = state_of(record.trainer).lean
    assert plan.calls == 0 and plan.stock_calls == 2 and len(said) == 1 and "LoRA dropout 0.1" in said[0], (plan, said)


def test_eval_loss_is_the_same_and_logits_stay_where_they_are_read(lean):
    """evaluate(): loss-only evaluation runs lean with the stock eval_loss; with compute_metrics (the logits are
    read) it runs stock; the second trainer after unpatch() is stock."""
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=8, seed=3, prompt_mask_frac=0.3)
    record, _ = _run(model, samples)
    trainer = record.trainer
    plan = state_of(trainer).lean
    before = plan.calls
    lean_eval = trainer.evaluate(H.ListDataset(samples))["eval_loss"]
    assert plan.calls > before
    seen = {}

    def metrics(pred):
        seen["shape"] = tuple(pred.predictions.shape)
        return {}

    trainer.compute_metrics = metrics
    calls = plan.calls
    with_logits = trainer.evaluate(H.ListDataset(samples))["eval_loss"]
    assert plan.calls == calls and seen["shape"][-1] == H.VOCAB  # the real logits reached compute_metrics
    hf_gradfix.unpatch()
    stock = H.make_trainer(model, samples, "causal")
    assert state_of(stock) is None
    stock_eval = stock.evaluate(H.ListDataset(samples))["eval_loss"]
    assert abs(lean_eval - stock_eval) <= TOL * abs(stock_eval) and abs(with_logits - stock_eval) <= TOL * abs(stock_eval)


def test_label_smoothing_through_the_lean_head_is_transformers_objective(lean):
    """label_smoothing_factor 0.1: the lean head computes LabelSmoother's objective per target itself (no logits),
    exact against test_exactness's float ground truth of (1 - eps) * NLL / N + eps * sum(-log p) / (N * V)."""
    from test_exactness import _label_smoothing_gt, custom_gt_rows

    model = H.build_model("llama")
    samples = H.make_samples("causal", n=8, seed=6, prompt_mask_frac=0.3)
    record, said = _run(model, samples, extra_args={"label_smoothing_factor": 0.1})
    plan = state_of(record.trainer).lean
    assert plan.calls == 4 and plan.stock_calls == 0 and not said, (plan, said)
    _assert_exact(custom_gt_rows(model, samples, record, lambda m, w: _label_smoothing_gt(m, w, 0.1)), "smoothing")
    # control: the same run's gradient is not the unsmoothed objective's
    worst = max(err for err, _ in H.check_against_gt(model, samples, "causal", record))
    assert worst > 1e-3, worst


def test_lean_head_through_the_callback_way_in():
    """No patch(): GradFixCallback with loss.head: lean on an ordinary Trainer; lean on every micro-batch, exact."""
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=8, seed=5, prompt_mask_frac=0.3)
    record, said = _run(model, samples, callbacks=[hf_gradfix.GradFixCallback(LEAN)])
    plan = state_of(record.trainer).lean
    assert plan is not None and plan.calls == 4 and plan.stock_calls == 0 and not said, (plan, said)
    _assert_exact(H.check_against_gt(model, samples, "causal", record), "callback way in")


def _one_call(model, seed=4):
    samples = H.make_samples("causal", n=2, seed=seed, prompt_mask_frac=0.3)
    return H.RecordingCollator("causal", H.pad_id_of(model)).collate(samples)


def test_an_exception_inside_the_forward_leaves_nothing_on_the_model():
    """An error after the head ran (an out-of-memory, a user's hook) goes to the caller as it is, is no verdict
    about the model, and leaves the head's forward and the loss function as they were: the next call runs lean."""
    model = H.build_model("llama")
    call = _one_call(model)
    plan = lean_head.LeanHead()

    def fail(module, args, output):
        raise RuntimeError("simulated failure after the head")

    handle = model.lm_head.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="simulated failure after the head"):
        lean_head.run_model(plan, model, call, lambda: model(**call), training=True)
    handle.remove()
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__
    assert plan.calls == 0 and plan.stock_calls == 0 and not plan.refused
    stock = model(**call).loss.detach()
    out = lean_head.run_model(plan, model, call, lambda: model(**call), training=True)
    assert plan.calls == 1 and abs(out.loss.item() - stock.item()) <= TOL * abs(stock.item())


def test_a_tuple_output_keeps_its_loss_and_never_hands_out_the_stand_in():
    """return_dict=False: the model returns (loss, logits, ...); the stand-in's place holds None, never zeros."""
    model = H.build_model("llama")
    call = _one_call(model)
    stock = model(**call, return_dict=False)
    plan = lean_head.LeanHead()
    out = lean_head.run_model(plan, model, call, lambda: model(**call, return_dict=False), training=True)
    assert plan.calls == 1 and isinstance(out, tuple) and len(out) == len(stock), (plan, type(out))
    assert out[1] is None and stock[1].shape[-1] == H.VOCAB
    assert abs(float(out[0]) - float(stock[0])) <= TOL * abs(float(stock[0]))


@pytest.mark.parametrize("path", ["torch", "fallback"])
def test_head_sum_equals_float64_cross_entropy_on_both_paths(monkeypatch, path):
    """The pure-math sum against float64 logits + cross-entropy (gradients of hidden, weight and bias), on torch's
    linear_cross_entropy and on the chunked fallback that torch < 2.13 gets (3 chunks here)."""
    from hf_gradfix.loss import lean_head as math

    if path == "fallback":
        monkeypatch.setattr(math, "has_torch_linear_cross_entropy", lambda: False)
        monkeypatch.setattr(math, "FALLBACK_CHUNK_TOKENS", 7)
    elif not math.has_torch_linear_cross_entropy():
        pytest.skip("this torch has no linear_cross_entropy")
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(19, 8), torch.randn(50, 8) * 0.3, torch.randn(50) * 0.1
    targets = torch.randint(0, 50, (19,))
    targets[::4] = -100
    got = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    lean = math.head_cross_entropy_sum(*got, targets)
    stock = torch.nn.functional.cross_entropy(ref[0] @ ref[1].T + ref[2], targets, reduction="sum")
    lean.backward()
    stock.backward()
    assert abs(float(lean) - float(stock)) <= 1e-6 * abs(float(stock))
    for g, r in zip(got, ref):
        assert float((g.grad.double() - r.grad).norm() / r.grad.norm()) <= 1e-6


def test_half_precision_sum_is_as_close_to_float64_as_the_stock_head():
    """bf16 (a bf16 model, or autocast over fp32 weights): the lean sum and its gradients are as close to float64 as
    the stock head's (bf16 matmul, fp32 upcast). Control: torch's linear_cross_entropy fed the bf16 tensors, which
    accumulates the loss in bf16 (what the lean head did before), is far off on the same data."""
    from hf_gradfix.loss import lean_head as math

    torch.manual_seed(0)
    n, h, v = 2048, 32, 4096
    hidden = torch.randn(n, h).bfloat16()
    weight32 = torch.randn(v, h) * 0.05
    targets = torch.randint(0, v, (n,))
    targets[::7] = -100
    ref_h, ref_w = hidden.double().requires_grad_(), weight32.bfloat16().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_h @ ref_w.T, targets, reduction="sum")
    ref.backward()

    def errors(fn):
        hid, w = hidden.clone().requires_grad_(), weight32.clone().requires_grad_()
        loss = fn(hid, w)
        loss.backward()
        rel = [abs(float(loss) - float(ref)) / abs(float(ref))]
        rel += [float((g.double() - r.grad).norm() / r.grad.norm()) for g, r in ((hid.grad, ref_h), (w.grad, ref_w))]
        return rel

    def stock(hid, w):
        return torch.nn.functional.cross_entropy((hid @ w.bfloat16().T).float(), targets, reduction="sum")

    def lean(hid, w):
        return math.head_cross_entropy_sum(hid, w, None, targets, compute_dtype=torch.bfloat16)

    s, le = errors(stock), errors(lean)
    assert all(a <= 1.5 * b for a, b in zip(le, s)), (le, s)
    assert le[2] <= s[2] * 1.01  # the fp32 weight's gradient accumulates over the chunks in fp32, like stock's
    if math.has_torch_linear_cross_entropy():
        def torch_op_in_bf16(hid, w):
            options = torch.nn.LinearCrossEntropyOptions(acc_policy="accurate", acc_dtype=torch.float32)
            return torch.nn.functional.linear_cross_entropy(hid, w.bfloat16(), targets, reduction="sum",
                                                            options=options)

        control = errors(torch_op_in_bf16)
        assert control[0] > 100 * max(s[0], 1e-6), (control, s)
