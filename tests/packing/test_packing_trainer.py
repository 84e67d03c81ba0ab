"""Packing inside the Trainer: exact against the unpacked full-batch ground truth, entry points, guard."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import Trainer

import harness as H
from multiproc import run_launch, torchrun, worker_env
import hf_gradfix
from hf_gradfix.packing import PackedBatchSampler
from hf_gradfix.packing.guard import PackingCheckError
from test_exactness import GRAD_TOL, LOSS_TOL

BUDGET = 64


def _train(model, samples, *, ga=2, callbacks=(), epochs=1):
    capture = H.GradCapture()
    args = transformers.TrainingArguments(
        output_dir="/tmp/hgf_packing", optim="sgd", learning_rate=0.0, max_grad_norm=0.0, gradient_accumulation_steps=ga,
        per_device_train_batch_size=1, num_train_epochs=epochs, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=3, remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=H.TokenDataset(samples), callbacks=[*callbacks, capture])
    init = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    model.load_state_dict(init)
    return trainer, capture.grads


def _windows(samples, ga, epochs=1):
    """The bins each optimizer step trained on, from an identical sampler (single process)."""
    sampler = PackedBatchSampler([len(s["input_ids"]) for s in samples], BUDGET, num_replicas=1, rank="all", seed=3)
    windows = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        bins = list(sampler)
        windows += [bins[k : k + ga] for k in range(0, len(bins), ga)]
    return windows


@pytest.mark.parametrize("mode,head", [("varlen", "stock"), ("rows", "stock"), ("varlen", "lean")])
def test_packed_training_is_exact_against_the_unpacked_full_batch(mode, head):
    """Packed rows against each sample alone; with loss.head: lean too (the packed labels' document starts are
    ignored targets, so the lean head's next-token shift never crosses a document)."""
    from hf_gradfix.integration.state import state_of

    samples = H.make_samples("causal", n=16, seed=0, prompt_mask_frac=0.3)
    model = H.build_model("llama", attn_implementation="sdpa")
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": mode}, "loss": {"head": head}})
    try:
        trainer, grads = _train(model, samples, ga=2, epochs=2)
    finally:
        hf_gradfix.unpatch()
    lean = state_of(trainer).lean
    assert (lean is not None and lean.calls > 0 and lean.stock_calls == 0) if head == "lean" else lean is None
    windows = _windows(samples, 2, epochs=2)
    assert len(windows) == len(grads) >= 4
    seen = sorted(i for w in windows[: len(windows) // 2] for b in w for i in b)
    assert seen == list(range(len(samples)))  # every sample exactly once per epoch
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for k, (window, g) in enumerate(zip(windows, grads)):
        gt_loss, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"{mode} step {k}: {H.rel_err(g, gt):.3e}"
        assert abs(logged[k] - gt_loss) / gt_loss <= LOSS_TOL
    expected = "flash_varlen_reference" if mode == "varlen" else "sdpa"
    assert model.config._attn_implementation in (expected, "flash_attention_2")


def test_packing_through_the_callback():
    samples = H.make_samples("causal", n=12, seed=1)
    model = H.build_model("qwen2", attn_implementation="sdpa")
    cb = hf_gradfix.GradFixCallback({"packing": {"enabled": True, "token_budget": BUDGET}})
    _, grads = _train(model, samples, ga=2, callbacks=[cb])
    for window, g in zip(_windows(samples, 2), grads):
        _, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL


def test_stock_padding_free_without_restarted_positions_would_be_wrong():
    # The control: the same packed rows with positions NOT restarted mix sequences (the guard's reason to exist).
    model = H.build_model("llama", attn_implementation="sdpa")
    from hf_gradfix.packing.guard import check_model_packs_correctly

    report = check_model_packs_correctly(model, mode="rows", raise_on_failure=False)
    assert report.passed and report.control_diff > 1e-2


class _AllOnesMaskLlama(transformers.LlamaForCausalLM):
    """A model that mixes packed sequences in every transformers release: it always passes an all-ones
    attention_mask (a common custom-model bug), which switches sdpa's packed-sequence detection off."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


class _MixingEmbeddingLlama(transformers.LlamaForCausalLM):
    """Mixes the row before any decoder layer (a running sum over positions added to the embeddings): no decoder-layer
    child carries the leak, so running children per document cannot help."""

    def __init__(self, config):
        super().__init__(config)
        self.model.embed_tokens.register_forward_hook(lambda module, args, out: out + 0.1 * out.cumsum(1))


def test_attention_that_mixes_packed_sequences_runs_per_document_and_a_leak_elsewhere_is_refused():
    """An attention that ignores the packed boundaries (an all-ones attention_mask switches sdpa's packed detection off)
    is a decoder-layer child that carries one document into the next, found by measurement like a recurrent layer:
    the Trainer runs it once per document and every window equals the unpacked ground truth. A leak before the decoder
    layers (the control) cannot be split and is refused before the first step by the guard's line."""
    config = H.build_model("llama", attn_implementation="sdpa").config
    torch.manual_seed(0)
    model = _AllOnesMaskLlama._from_config(config, attn_implementation="sdpa")
    samples = H.make_samples("causal", n=8, seed=0)
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "mode": "rows"}})
    try:
        trainer, grads = _train(model, samples)
        line = " ".join(hf_gradfix.state_of(trainer).fixes)
        assert "documents run one by one through self_attn (LlamaAttention, 2 layer(s))" in line, line
        torch.manual_seed(0)
        mixing = _MixingEmbeddingLlama._from_config(config, attn_implementation="sdpa")
        with pytest.raises(PackingCheckError, match="^_MixingEmbeddingLlama cannot "):
            _train(mixing, samples)
    finally:
        hf_gradfix.unpatch()
    windows = _windows(samples, 2)
    assert len(windows) == len(grads) >= 2
    for k, (window, g) in enumerate(zip(windows, grads)):
        _, gt = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")
        assert H.rel_err(g, gt) <= 1e-5, f"step {k}: {H.rel_err(g, gt):.3e}"


def test_bad_packing_config_is_a_clear_error():
    with pytest.raises(hf_gradfix.ConfigError, match="token_budjet.*did you mean 'token_budget'"):
        hf_gradfix.patch({"packing": {"token_budjet": 512}})
    # a budget that cannot work is refused by the schema, at patch(), not at train()
    with pytest.raises(hf_gradfix.ConfigError, match="packing.token_budget: invalid value 0; it must be >= 8"):
        hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 0}})
    assert not hf_gradfix.is_patched()


def test_a_sample_longer_than_the_budget_is_an_error_not_a_truncation():
    samples = H.make_samples("causal", n=6, seed=0, lo=3, hi=41)
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 16}})
    try:
        with pytest.raises(ValueError, match="16"):
            _train(H.build_model("llama"), samples)
    finally:
        hf_gradfix.unpatch()


@pytest.mark.distributed
@pytest.mark.parametrize("balance", ["tokens", "compute"])
def test_packed_training_under_ddp_is_exact(tmp_path, balance):
    """Two ranks, packed rows dealt by tokens or by compute (packing.balance): every window's gradient is the
    ground truth's over the samples the sampler's plan put in it (the deal moves rows between ranks, never the
    loss)."""

    import ddp_packing_worker as W
    from hf_gradfix.packing.balance import attention_cost_coeff

    cmd = torchrun(H.TESTS_DIR / "ddp_packing_worker.py", tmp_path, *(["compute"] if balance == "compute" else []))
    proc = run_launch(cmd, env=worker_env(), step="ddp_packing_worker.py launch")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    samples = W.samples()
    lengths = [len(s["input_ids"]) for s in samples]
    model = H.build_model("llama", attn_implementation="sdpa")
    cost = attention_cost_coeff(model.config)[0] if balance == "compute" else None
    sampler = PackedBatchSampler(lengths, W.BUDGET, num_replicas=2, rank="all", seed=W.SEED, cost_coeff=cost)
    sampler.set_epoch(0)
    bins = list(sampler)  # interleaved: bin i goes to rank i % 2
    if balance == "compute":  # measured: the compute deal is another deal here, so this case tests something
        by_tokens = list(PackedBatchSampler(lengths, W.BUDGET, num_replicas=2, rank="all", seed=W.SEED))
        assert bins != by_tokens
    per_window = W.GA * 2
    model.load_state_dict(ranks[0]["init"])
    assert len(ranks[0]["grads"]) == len(bins) // per_window >= 2
    tokens = [[sum(len(samples[i]["input_ids"]) for b in bins[k * per_window + r : (k + 1) * per_window : 2] for i in b) for r in (0, 1)]
              for k in range(len(ranks[0]["grads"]))]
    for k, g in enumerate(ranks[0]["grads"]):
        window = [samples[i] for b in bins[k * per_window : (k + 1) * per_window] for i in b]
        gt_loss, gt = H.ground_truth(model, window, "causal")
        assert H.rel_err(g, gt) <= GRAD_TOL, f"step {k}: {H.rel_err(g, gt):.3e} (tokens per rank {tokens[k]})"
        assert H.rel_err(ranks[1]["grads"][k], gt) <= GRAD_TOL
        assert abs(ranks[0]["logged"][k] - gt_loss) / gt_loss <= LOSS_TOL
    # the logs carry each window's imbalance (logging_steps=1): max / mean over the ranks of the tokens (and of the
    # compute cost) the plan put on them, computed here from the sampler's bins
    from hf_gradfix.packing.balance import document_cost, imbalance

    coeff = cost if cost is not None else attention_cost_coeff(model.config)[0]
    for k in range(len(ranks[0]["grads"])):
        costs = [sum(float(document_cost([len(samples[i]["input_ids"])], coeff)[0])
                     for b in bins[k * per_window + r: (k + 1) * per_window: 2] for i in b) for r in (0, 1)]
        for r in (0, 1):
            logged = ranks[r]["imbalance"][k]
            assert abs(logged["packing/imbalance_tokens"] - imbalance(tokens[k])) <= 1e-4, (k, logged, tokens[k])
            assert abs(logged["packing/imbalance_compute"] - imbalance(costs)) <= 1e-4, (k, logged, costs)
    assert any(imbalance(t) > 1.0 for t in tokens)  # control: a window that is not perfectly even was measured


@pytest.mark.parametrize("balance", ["tokens", "compute"])
def test_resume_from_a_checkpoint_continues_exactly(tmp_path, balance):
    """Train 6 steps in one go, or 3 steps + resume from the checkpoint: the same final weights (rows dealt by tokens
    or by compute; the multi-rank deal's resume is checked on the sampler, tests/packing/test_packing_balance.py)."""
    samples = H.make_samples("causal", n=24, seed=2)

    def train(out, max_steps, resume=None):
        model = H.build_model("llama", attn_implementation="sdpa")
        args = transformers.TrainingArguments(
            output_dir=str(out), optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, gradient_accumulation_steps=2,
            per_device_train_batch_size=1, max_steps=max_steps, num_train_epochs=3, report_to="none", use_cpu=True,
            save_strategy="steps", save_steps=3, disable_tqdm=True, seed=3, remove_unused_columns=False, logging_steps=1,
        )
        trainer = Trainer(model=model, args=args, train_dataset=H.TokenDataset(samples))
        trainer.train(resume_from_checkpoint=resume)
        return model

    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET, "balance": balance}})
    try:
        straight = train(tmp_path / "a", 6)
        train(tmp_path / "b", 3)
        resumed = train(tmp_path / "b", 6, resume=str(tmp_path / "b" / "checkpoint-3"))
    finally:
        hf_gradfix.unpatch()
    moved = H.build_model("llama", attn_implementation="sdpa").state_dict()
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert any(not torch.equal(v, moved[k]) for k, v in straight.state_dict().items())  # training did move the weights


def test_lifecycle_epochs_short_last_window_second_train_and_second_trainer():
    """Map-style packing over a run's lifecycle (issue 25): 3 epochs whose packed rows do not divide by GA 3 (the
    last window of every epoch is shorter), train() again on the same trainer, and a second Trainer on the same
    model: every optimizer step against the unpacked ground truth of the samples its bins hold."""
    samples = H.make_samples("causal", n=14, seed=4, prompt_mask_frac=0.3)
    model = H.build_model("llama", attn_implementation="sdpa")
    ga, epochs = 3, 3
    windows = _windows(samples, ga, epochs=epochs)
    assert [len(w) for w in windows] == [3, 2] * epochs  # 5 rows per epoch: the last window of each is shorter
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": BUDGET}})
    try:
        first, grads = _train(model, samples, ga=ga, epochs=epochs)
        capture = next(c for c in first.callback_handler.callbacks if isinstance(c, H.GradCapture))
        capture.grads.clear()
        first.train()
        second_train = list(capture.grads)
        _, second_trainer = _train(model, samples, ga=ga, epochs=epochs)
    finally:
        hf_gradfix.unpatch()
    cache = {}
    for name, run in (("first train()", grads), ("second train()", second_train), ("second Trainer", second_trainer)):
        assert len(run) == len(windows), (name, len(run), len(windows))
        for k, (window, g) in enumerate(zip(windows, run)):
            if k not in cache:
                cache[k] = H.ground_truth(model, [samples[i] for b in window for i in b], "causal")[1]
            err = H.rel_err(g, cache[k])
            assert err <= GRAD_TOL, f"{name} step {k} ({len(window)} rows): {err:.3e}"


def test_balance_log_docstring_examples_run():
    import doctest

    from hf_gradfix.integration.packing import balance_log as packing_balance_log

    result = doctest.testmod(packing_balance_log)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("head,packing,trainer,words", [
    ("seq2seq", "map", "Trainer", "is an encoder-decoder"),
    ("seq2seq", "stream", "Trainer", "is an encoder-decoder"),
    ("seqcls", "map", "Trainer", "one int64 value per sample, not one per token"),
    ("seqcls", "stream", "Trainer", "not one vector per token"),
    ("causal", "map", "GRPOTrainer", "trains on completions it generates"),
])
def test_what_packing_cannot_hold_is_refused_in_one_line_saying_why(head, packing, trainer, words):
    """An encoder-decoder, a sequence-level head and an RL trainer's prompts cannot be packed; each was refused by a
    line about something else ('labels has 6 entries but input_ids has 22', 'tokenize the dataset first') or, for a
    streamed sequence classifier, crashed in the guard with a tensor-size error (found by the composition matrix).
    Each is one line now, before any step, saying why and to remove packing.enabled."""
    if trainer == "GRPOTrainer":
        pytest.importorskip("trl")
    import composition as C

    row = dict(C.DEFAULTS, head=head, packing=packing, trainer=trainer)
    run = C.run(row, "patch")
    assert run.error is not None and not run.grads, "trained"
    line = str(run.error)
    assert "\n" not in line and words in line and "packing.enabled" in line, line
