"""``loss.head: lean``: the head and its cross-entropy together, never the logits of a micro-batch; exact.

Ground truth: harness.ground_truth (plain PyTorch, one process, each sample's own forward with the model's own logits
and cross-entropy, summed over the window and divided by its target count) on the batches the Trainer used. The
lean path's use is measured in each test (its call counter, the stock calls), never assumed. Memory and speed are in
benchmarks/bench_lean_head.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import harness as H
import hf_gradfix
from hf_gradfix.integration import lean_head
from hf_gradfix.integration.state import state_of
from test_exactness import LOSS_TOL

TOL = 1e-5  # the logged loss: test_exactness's LOSS_TOL where larger (transformers 4.x logs 4 decimals)
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
        assert loss_err is None or loss_err <= max(TOL, LOSS_TOL), (what, rows)


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
    caught by the same comparison. Planted in the training calls only (with grad): the probes run through the lean
    head too, and a lean head that ignored the count there would be measured as a mean and rescaled, exactly."""
    original = lean_head._Call.loss_function

    def local_mean(self, *args, num_items_in_batch=None, **kwargs):
        if torch.is_grad_enabled():
            num_items_in_batch = None
        return original(self, *args, num_items_in_batch=num_items_in_batch, **kwargs)

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


# -- what the lean head replaces: the model's own loss_function, measured (issue 50, item 2) ------------------------


def _modernbert_mlm(sparse_prediction=False):
    """ModernBertForMaskedLM: a plain linear decoder whose loss goes through ``self.loss_function`` (ForMaskedLM:
    unshifted), so the lean path reaches it; on main the lean head scored it against next-token targets."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ModernBertConfig(
        vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=128, pad_token_id=H.PAD_ID, bos_token_id=H.BOS_ID, eos_token_id=H.EOS_ID,
        cls_token_id=H.BOS_ID, sep_token_id=H.EOS_ID, mlp_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0,
        classifier_dropout=0.0, global_attn_every_n_layers=1, sparse_prediction=sparse_prediction)
    return tf.ModernBertForMaskedLM._from_config(cfg, attn_implementation="eager").float()


def _t5gemma():
    """T5GemmaForConditionalGeneration without soft-capping: a seq2seq decoder (inputs right-shifted from the
    labels) whose loss goes through ``self.loss_function`` with same-position targets."""
    import transformers as tf

    torch.manual_seed(0)
    side = dict(vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, query_pre_attn_scalar=16,
                sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None, use_cache=False,
                pad_token_id=H.PAD_ID, eos_token_id=H.EOS_ID, bos_token_id=H.BOS_ID)
    cfg = tf.T5GemmaConfig(encoder=dict(side), decoder=dict(side), vocab_size=H.VOCAB, dropout_rate=0.0,
                           attention_dropout=0.0, classifier_dropout_rate=0.0, tie_word_embeddings=False,
                           pad_token_id=H.PAD_ID, eos_token_id=H.EOS_ID, bos_token_id=H.BOS_ID)
    model = tf.T5GemmaForConditionalGeneration._from_config(cfg, attn_implementation="eager").float()
    model.config.use_cache = False
    return model


# (builder, task, the Objective the lean call computes or None for the stock head, what the one warning names)
FAMILIES = {
    "causal": (lambda: H.build_model("llama"), "causal", ("next", "num_items"), None),
    "masked_loss_function": (_modernbert_mlm, "mlm", ("same", "num_items"), None),
    "masked_inline": (lambda: H.build_model("bert_mlm"), "mlm", None, "computes its loss without its loss_function"),
    "masked_sparse": (lambda: _modernbert_mlm(True), "mlm", None, "other labels than the model call's"),
    "seq2seq_loss_function": (_t5gemma, "seq2seq", ("same", "num_items"), None),
    "seq2seq_inline": (lambda: H.build_model("t5"), "seq2seq", None, "computes its loss without its loss_function"),
    "token_classification": (lambda: H.build_model("llama_tokcls"), "tokcls", None, "has no output embeddings"),
}


def _family_run(family, **kw):
    build, task, _, _ = FAMILIES[family]
    model = build()
    samples = H.make_samples(task, n=8, seed=1, **({"prompt_mask_frac": 0.3} if task == "causal" else {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = H.run_trainer(model, samples, task, per_device_train_batch_size=2, gradient_accumulation_steps=2, **kw)
    said = [str(w.message) for w in caught if "loss.head: lean" in str(w.message)]
    return model, samples, task, record, said


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_head_family_is_lean_only_where_its_loss_is_measured_and_exact_either_way(lean, family):
    """Per head family, the gradient and the logged loss against harness.ground_truth (each sample alone, the task's
    own targets: shifted for causal, unshifted for masked / seq2seq / token classification). A model whose
    loss_function computes a cross-entropy of the head's output runs lean with exactly that objective (measured on
    its loss_function, never assumed: the causal shift for a causal LM, none for a masked LM or a seq2seq decoder);
    any other keeps the stock head with exactly one warning naming the one reason. On main the masked LM and the
    seq2seq decoder trained the causal objective through the lean head, silently (gradient error 1.13 / 0.41)."""
    model, samples, task, record, said = _family_run(family)
    _, _, objective, why = FAMILIES[family]
    _assert_exact(H.check_against_gt(model, samples, task, record), family)
    plan = state_of(record.trainer).lean
    if objective is not None:
        assert plan.calls == 4 and plan.stock_calls == 0 and not said, (plan, said)
        assert plan.probe_calls > 0, plan  # the first window's probes ran lean too (item 3)
        measured = {(o.targets, o.reduction) for o in plan.objectives.values()}
        assert objective in measured and all(not isinstance(o, str) for o in plan.objectives.values()), measured
    else:
        assert plan.calls == 0 and plan.stock_calls == 4, plan
        assert len(said) == 1 and why in said[0], said


@pytest.mark.parametrize("family", ["masked_loss_function", "seq2seq_loss_function"])
def test_control_the_causal_shift_forced_on_an_unshifted_loss_fails(lean, monkeypatch, family):
    """The planted bug (what main did): the lean head scores next-token targets whatever the model's loss_function
    computes. The same comparison with the ground truth catches it."""
    real = lean_head.measure_objective

    def always_shifted(*args, **kwargs):
        found = real(*args, **kwargs)
        return found if isinstance(found, str) else lean_head.Objective("next", found.reduction)

    monkeypatch.setattr(lean_head, "measure_objective", always_shifted)
    model, samples, task, record, _ = _family_run(family)
    assert state_of(record.trainer).lean.calls == 4
    worst = max(err for err, _ in H.check_against_gt(model, samples, task, record))
    assert worst > 1e-2, worst


def _smoothing_gt(model, samples, eps, task):
    """transformers' LabelSmoother objective over the window, each sample alone: (1 - eps) * NLL / N
    + eps * sum(-log p over the vocabulary) / (N * V), the task's targets (the causal shift or none)."""
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    nll = smooth = 0.0
    count = 0
    for s in samples:
        logits = H._logits(model, s, task).float()
        labels = torch.tensor([s["labels"]])
        if task == "causal":
            logits, labels = logits[:, :-1], labels[:, 1:]
        logp = F.log_softmax(logits, dim=-1)
        mask = labels.ne(-100)
        nll = nll - logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask].sum()
        smooth = smooth - logp.sum(-1)[mask].sum()
        count += int(mask.sum())
    loss = (1 - eps) * nll / count + eps * smooth / (count * logp.shape[-1])
    loss.backward()
    grads = H._grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_label_smoothing_on_a_masked_lm_runs_lean_without_the_shift_and_is_exact(lean):
    """label_smoothing_factor 0.1 on ModernBertForMaskedLM: the smoother scores same-position targets (the count
    rule the probes measured: unshifted), the lean head computes that smoothed objective; exact against the float
    ground truth. Control: the same run's gradient is not the unsmoothed objective's."""
    from test_exactness import custom_gt_rows

    model, samples, task, record, said = _family_run("masked_loss_function",
                                                      extra_args={"label_smoothing_factor": 0.1})
    plan = state_of(record.trainer).lean
    assert plan.calls == 4 and plan.stock_calls == 0 and not said, (plan, said)
    _assert_exact(custom_gt_rows(model, samples, record, lambda m, w: _smoothing_gt(m, w, 0.1, task)), "mlm smoothing")
    worst = max(err for err, _ in H.check_against_gt(model, samples, task, record))
    assert worst > 1e-3, worst


def test_measured_objective_of_transformers_losses_and_of_losses_that_are_none():
    """measure_objective on transformers' own loss functions called as the models call them (positional or by
    keyword, with and without the count, with shift_labels), and on losses the lean head must not replace: each of
    those gets a reason naming what it returned."""
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    from hf_gradfix.loss.lean_head import measure_objective

    labels = torch.randint(0, 50, (2, 9))
    n = torch.tensor(11)

    def measure(fn, args=(), **kwargs):
        found = measure_objective(fn, args, kwargs, labels)
        return found if isinstance(found, str) else (found.targets, found.reduction)

    assert measure(ForCausalLMLoss, logits=None, labels=labels, vocab_size=50, num_items_in_batch=n) == (
        "next", "num_items")
    assert measure(ForCausalLMLoss, logits=None, labels=labels, vocab_size=50) == ("next", "mean")
    assert measure(ForCausalLMLoss, logits=None, labels=labels, vocab_size=50, num_items_in_batch=n,
                   shift_labels=labels) == ("shift_labels", "num_items")
    assert measure(ForMaskedLMLoss, (None, labels), vocab_size=50, num_items_in_batch=n) == ("same", "num_items")
    assert measure(ForMaskedLMLoss, (None, labels, 50)) == ("same", "mean")

    def smoothed(logits, labels, vocab_size, num_items_in_batch=None, **kw):
        return F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1), label_smoothing=0.1)

    def z_loss(logits, labels, vocab_size, num_items_in_batch=None, **kw):
        return ForMaskedLMLoss(logits, labels, vocab_size, num_items_in_batch) + 1e-2 * logits.logsumexp(-1).pow(2).mean()

    def weighted(logits, labels, vocab_size, num_items_in_batch=None, **kw):
        weight = torch.linspace(0.5, 1.5, vocab_size, dtype=logits.dtype)
        return F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1), weight=weight)

    def wrong_arguments(logits, labels):
        return logits.sum()

    for fn in (smoothed, z_loss, weighted):
        why = measure(fn, (None, labels), vocab_size=50, num_items_in_batch=n)
        assert isinstance(why, str) and "returned" in why and "closest" in why and fn.__name__ in why, why
    why = measure(wrong_arguments, (None, labels), vocab_size=50)
    assert isinstance(why, str) and "raised TypeError" in why, why


def test_a_loss_function_that_is_not_a_head_cross_entropy_keeps_the_stock_head_said_once(lean):
    """A causal LM whose loss_function scales its cross-entropy (its own objective, here 1.5x): the lean head would
    compute the plain one. The measurement finds it at the first call (a probe's), the model keeps the stock head
    with exactly one warning naming its loss function and what it returned, and the gradient is that loss's."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def with_extra_scale(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
        return 1.5 * ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, **kwargs)

    model = H.build_model("llama")
    model.loss_function = with_extra_scale  # PreTrainedModel's own setter
    samples = H.make_samples("causal", n=8, seed=1, prompt_mask_frac=0.3)
    record, said = _run(model, samples)
    plan = state_of(record.trainer).lean
    assert plan.calls == 0 and plan.stock_calls == 4, plan
    assert len(said) == 1 and "with_extra_scale" in said[0] and "returned" in said[0], said
    model.load_state_dict(record.initial_state)
    by_idx = {s["idx"]: s for s in samples}
    for step in record.steps:  # 1.5x the ground truth's gradient (the lean head's would be 1x)
        _, gt = H.ground_truth(model, [by_idx[i] for b in step["idx_batches"] for i in b], "causal")
        assert H.rel_err(step["grads"], {k: 1.5 * v for k, v in gt.items()}) <= TOL


# -- the first window (issue 50, item 3): the probes run through the lean head, no step holds tokens x vocab ----------


class _LargestStorage:
    """A dispatch mode that records, per optimizer step (a callback closes each), the largest storage any op
    returned: the logits of a micro-batch are ``tokens x vocab x 4`` bytes (the lean head's stand-in is a 0-stride
    expand of one element: 4 bytes)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from transformers import TrainerCallback

        steps = self.steps = [[0, None]]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > steps[-1][0]:
                        steps[-1][:] = [t.untyped_storage().nbytes(), f"{func} {tuple(t.shape)}"]
                return out

        class StepEnd(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                steps.append([0, None])

        self.mode, self.callback = Mode(), StepEnd()


def _first_steps_largest(vocab=2048, tokens=48, **kw):
    """Two optimizer steps (2 micro-batches of 2 x ``tokens`` each) of a Llama whose logits dominate every other
    tensor (vocabulary 2048, hidden 32): the largest storage of each step, and the logits' bytes."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**{**H._DECODER, "vocab_size": vocab}),
                                             attn_implementation="eager").float()
    samples = H.make_samples("causal", n=8, lo=tokens, hi=tokens, vocab=vocab, seed=1, prompt_mask_frac=0.25)
    largest = _LargestStorage()
    with largest.mode:
        record = H.run_trainer(model, samples, "causal", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               callbacks=[largest.callback], **kw)
    return model, samples, record, largest.steps[:2], 2 * tokens * vocab * 4


@pytest.mark.parametrize("path", ["torch", "fallback"])
def test_no_training_step_holds_the_logits_the_first_included(lean, monkeypatch, path):
    """With loss.head: lean the first optimizer step, whose first micro-batch runs the loss probes (five no-grad
    forwards), never holds a storage as large as one micro-batch's logits: the probes run through the lean head.
    On main they ran the stock head (step 1 at 0.66x stock's peak, step 2 at 0.02x in the Trainer benchmark). On
    torch's chunked op and on the chunked fallback (chunks of 16 tokens here, visible to the dispatcher). Exact."""
    from hf_gradfix.loss import lean_head as math

    if path == "fallback":
        monkeypatch.setattr(math, "has_torch_linear_cross_entropy", lambda: False)
        monkeypatch.setattr(math, "FALLBACK_CHUNK_TOKENS", 16)
    model, samples, record, steps, logits_bytes = _first_steps_largest()
    assert all(size < logits_bytes for size, _ in steps), (steps, logits_bytes)
    plan = state_of(record.trainer).lean
    assert plan.calls == 4 and plan.probe_calls > 0 and plan.stock_calls == 0, plan
    _assert_exact(H.check_against_gt(model, samples, "causal", record), f"first steps, {path}")


def test_control_the_probes_on_the_stock_head_hold_the_logits_in_the_first_step(lean, monkeypatch):
    """The control: the probes' forwards through the stock head (what main did) hold the logits in step 1, and the
    same check fails there; step 2 (no probes) is lean either way."""
    monkeypatch.setattr(lean_head, "probe_forward", lambda plan, model, call: model(**call))
    _, _, record, steps, logits_bytes = _first_steps_largest()
    assert steps[0][0] >= logits_bytes and steps[1][0] < logits_bytes, (steps, logits_bytes)
    assert state_of(record.trainer).lean.probe_calls == 0


# -- the last pipeline stage measures the model's loss_function too ------------------------------------------------


def test_the_last_pipeline_stage_computes_the_measured_objective_or_keeps_the_stock_head():
    """parallel.pp's lean loss (integration/parallel/pipeline.py) replaces window_loss_fn, which calls the model's
    loss_function: a masked LM's loss (same-position targets) gives a lean loss equal to the stock one, not the
    causal shift; a loss that is no head cross-entropy keeps the stock head, said once."""
    from types import SimpleNamespace

    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

    from hf_gradfix.integration.parallel.pipeline import _lean_last_stage
    from hf_gradfix.parallel.dims import ParallelDims

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden, labels = torch.randn(2, 7, 8), torch.randint(0, 30, (2, 7))
    labels[:, :2] = -100
    dims = ParallelDims(world_size=2, dp_shard=1, pp=2)
    for loss_function in (ForCausalLMLoss, ForMaskedLMLoss):
        module = SimpleNamespace(is_last=True, head=head, lean_head=False)
        fn, lean = _lean_last_stage([module], dims, "1f1b", False, "stock", loss_function)
        assert lean == "lean" and module.lean_head, lean
        n = torch.tensor(9)
        stock = loss_function(logits=head(hidden), labels=labels, vocab_size=30, num_items_in_batch=n)
        assert abs(float(fn(hidden, labels, n)) - float(stock)) <= 1e-6 * abs(float(stock)), loss_function

    def scaled(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
        return 2.0 * ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, **kwargs)

    module = SimpleNamespace(is_last=True, head=head, lean_head=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, why = _lean_last_stage([module], dims, "1f1b", False, "stock", scaled)
    said = [str(w.message) for w in caught if "loss.head: lean" in str(w.message)]
    assert fn == "stock" and not module.lean_head and len(said) == 1 and "scaled" in said[0], said


@pytest.mark.parametrize("trainer", ["SFTTrainer", "GRPOTrainer"])
def test_a_trainer_whose_loss_never_reaches_the_lean_head_says_so_once(trainer):
    """TRL's SFTTrainer and GRPOTrainer compute their loss with their own log-prob head: ``loss.head: lean`` never ran
    and said nothing (found by the composition matrix). One warning at the first optimizer step now, decided by the
    model calls the lean head saw (none), not by the trainer's class; the control: the Trainer runs lean, no warning."""
    pytest.importorskip("trl")
    import composition as C

    for name, expect in ((trainer, 1), ("Trainer", 0)):
        run = C.run(dict(C.DEFAULTS, trainer=name, lean=True), "patch")
        assert run.error is None and len(run.grads) == 2, run.error
        said = [w for w in run.warnings if "lean is not used" in w]
        assert len(said) == expect, (name, run.warnings)
        if expect:
            assert f"{name}.compute_loss computes its loss without calling the model" in said[0]
