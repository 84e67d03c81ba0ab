"""MoE router load-balancing loss conventions (``loss.aux_loss``) against a float64 reference written here.

The reference is plain PyTorch on a float64 copy of the model at the trainer's initial weights, on the micro-batches the
trainer recorded (re-collated from their sample ids, padding and attention mask as trained): the token-mean
cross-entropy over the whole window plus ``coef *`` the Switch load-balancing loss, written out here from its
definition (softmax over each layer's router logits, top-k one-hot, padding rows dropped, every layer's rows
together):

- ``global``: expert frequencies ``f`` and mean probabilities ``P`` over every row of the whole window;
- ``micro``: the mean over micro-batches of each micro-batch's own ``E * sum f P``.

Families: Qwen3-MoE, Mixtral, OLMoE (each a transformers family with a load-balancing aux loss and an ep plan), tiny
random-init, fp32, samples of 3-40 tokens in padded micro-batches of 2, GA 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harness as H

COEF = 0.5
TOL = 1e-5


def _lb_terms(router_logits, attention_mask, top_k):
    """(per-expert selection counts, per-expert probability sums, rows) of one forward, padding rows dropped."""
    keep = attention_mask.reshape(-1).bool()
    counts, probs, rows = 0.0, 0.0, 0
    for gate in router_logits:
        p = torch.softmax(gate[keep].double(), dim=-1)
        sel = torch.topk(p, top_k, dim=-1).indices
        counts = counts + F.one_hot(sel, p.shape[-1]).sum(dim=(0, 1)).double()
        probs = probs + p.sum(0)
        rows += p.shape[0]
    return counts, probs, rows


def _float64_copy(model, initial_state):
    """The model at ``initial_state`` in float64, its experts as plain per-expert matmuls (torch's grouped GEMM, the
    default of transformers 5, has no float64)."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg._experts_implementation = "eager"
    ref = type(model)(cfg).double()
    ref.load_state_dict({k: v.double() for k, v in initial_state.items()})
    return ref.train()


def reference(model, initial_state, micro_batches, convention, label_smoothing=0.0):
    """(loss, grads) of one optimizer window in float64, from the definitions above; with ``label_smoothing`` eps the
    token term is transformers' label-smoothed cross entropy per target, ``(1 - eps) * NLL + eps * mean over the
    vocabulary of -log p``, summed over the window's targets and divided by their count."""
    ref = _float64_copy(model, initial_state)
    top_k, ce, targets, terms = model.config.num_experts_per_tok, 0.0, 0, []
    for mb in micro_batches:
        out = ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True)
        logits, labels = out.logits[:, :-1], mb["labels"][:, 1:]
        mask = labels.ne(-100)
        ce = ce + (1 - label_smoothing) * F.cross_entropy(logits[mask], labels[mask], reduction="sum")
        if label_smoothing:
            ce = ce - label_smoothing * F.log_softmax(logits[mask], dim=-1).mean(-1).sum()
        targets += int(mask.sum())
        terms.append(_lb_terms(out.router_logits, mb["attention_mask"], top_k))
    experts = terms[0][0].numel()
    if convention == "global":
        counts = sum(t[0] for t in terms)
        probs = sum(t[1] for t in terms)
        rows = sum(t[2] for t in terms)
        lb = experts * (counts / rows * probs / rows).sum()
    else:
        lb = torch.stack([experts * (c / r * p / r).sum() for c, p, r in terms]).mean()
    loss = ce / targets + float(model.config.router_aux_loss_coef) * lb
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def _run(family, convention, *, ga=2, n=8, batch=2):
    import hf_gradfix

    hf_gradfix.patch({"loss": {"aux_loss": convention}, "log_fixes": False})
    try:
        model = H.build_moe(family)
        samples = H.make_samples("causal", n=n, seed=1)
        record = H.run_trainer(model, samples, "causal", gradient_accumulation_steps=ga,
                               per_device_train_batch_size=batch)
    finally:
        hf_gradfix.unpatch()
    return model, samples, record


def _errors(model, samples, record, convention):
    by_idx = {s["idx"]: s for s in samples}
    rows = []
    for k, step in enumerate(record.steps):
        mbs = [record.collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
        loss, grads = reference(model, record.initial_state, mbs, convention)
        logged = record.logged_losses[k]
        rows.append((H.rel_err(step["grads"], grads), abs(logged - loss) / abs(loss)))
    return rows


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_global_router_loss_is_the_window_loss(family):
    import hf_gradfix

    model, samples, record = _run(family, "global")
    rows = _errors(model, samples, record, "global")
    assert len(rows) == 2
    assert hf_gradfix.state_of(record.trainer).moe.prepass_forwards == 4  # one routing forward per micro-batch
    for grad_err, loss_err in rows:
        assert grad_err <= TOL and loss_err <= TOL, rows
    # the control: the same trainer gradients against the micro-batch-mean definition must fail
    micro = _errors(model, samples, record, "micro")
    assert max(g for g, _ in micro) > 100 * TOL, micro


def test_micro_router_loss_is_the_mean_of_micro_batch_losses():
    model, samples, record = _run("qwen3_moe", "micro")
    rows = _errors(model, samples, record, "micro")
    for grad_err, loss_err in rows:
        assert grad_err <= TOL and loss_err <= TOL, rows
    assert max(g for g, _ in _errors(model, samples, record, "global")) > 100 * TOL  # micro is not global


def test_none_drops_the_router_loss_and_previous_approximates_global():
    model, samples, record = _run("qwen3_moe", "none")
    by_idx = {s["idx"]: s for s in samples}
    for k, step in enumerate(record.steps):
        mbs = [record.collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
        with_lb_loss, with_lb = reference(model, record.initial_state, mbs, "global")
        # the reference without the router term: coefficient 0
        ref = _float64_copy(model, record.initial_state)
        ce, targets = 0.0, 0
        for mb in mbs:
            logits = ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
            labels = mb["labels"][:, 1:]
            mask = labels.ne(-100)
            ce = ce + F.cross_entropy(logits[mask], labels[mask], reduction="sum")
            targets += int(mask.sum())
        (ce / targets).backward()
        plain = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert H.rel_err(step["grads"], plain) <= TOL
        assert H.rel_err(step["grads"], with_lb) > 100 * TOL
    # previous: window 1 as micro, window 2 with window 1's frequencies: close to global, not equal
    model, samples, record = _run("qwen3_moe", "previous", n=12)
    errs = _errors(model, samples, record, "global")
    assert errs[1][0] > TOL  # an approximation
    assert errs[1][0] < _errors(model, samples, record, "micro")[1][0] * 10


def test_router_health_counts_equal_the_router_logits():
    """RouterHealthCallback's numbers equal counts recomputed here from the router logits of the trained batches."""
    import hf_gradfix
    from hf_gradfix.integration.moe import RouterHealthCallback

    hf_gradfix.patch({"loss": {"aux_loss": "micro"}, "log_fixes": False})
    try:
        model = H.build_moe("qwen3_moe")
        samples = H.make_samples("causal", n=8, seed=1)
        record = H.run_trainer(model, samples, "causal", gradient_accumulation_steps=2, per_device_train_batch_size=2,
                               callbacks=[RouterHealthCallback()])
    finally:
        hf_gradfix.unpatch()
    logs = [h for h in record.trainer.state.log_history if "loss" in h]
    by_idx = {s["idx"]: s for s in samples}
    ref = type(model)(model.config)
    ref.load_state_dict(record.initial_state)  # lr 0: the weights never change
    with torch.no_grad():
        for log, step in zip(logs, record.steps):
            per_layer = None
            for b in step["idx_batches"]:
                mb = record.collator.collate([by_idx[i] for i in b])
                out = ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], output_router_logits=True)
                keep = mb["attention_mask"].reshape(-1).bool()
                c = torch.stack([F.one_hot(torch.topk(torch.softmax(g[keep], -1), 2).indices, g.shape[-1]).sum((0, 1))
                                 for g in out.router_logits]).double()
                per_layer = c if per_layer is None else per_layer + c
            for layer, c in enumerate(per_layer):
                assert log[f"router/layer{layer}/max_load"] == pytest.approx(float(c.max() / c.mean()), abs=1e-4)
                assert log[f"router/layer{layer}/dead"] == float((c == 0).sum())
            assert log["router/dead_experts"] == float((per_layer == 0).sum())


def test_config_rejects_an_unknown_convention():
    from hf_gradfix.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="aux_loss"):
        load_config({"loss": {"aux_loss": "globl"}})


@pytest.mark.parametrize("convention", ["global", "micro"])
def test_trl_sft_trainer_on_a_moe_model(convention, tmp_path, monkeypatch):
    """TRL's SFTTrainer adds the router loss itself (``router_aux_loss_coef * aux / GA``, through its fused log-prob
    forward, which drops ``router_logits`` from the outputs): ``global`` reads the router logits from the modules the
    model declares as routers and corrects the trainer's term; exact against the reference on the trained batches."""
    pytest.importorskip("trl")
    import trainer_matrix as M
    from hf_gradfix.config import ENV_VAR

    config = tmp_path / "gradfix.yaml"
    config.write_text(f"hf_gradfix:\n  loss:\n    aux_loss: {convention}\n")
    monkeypatch.setenv(ENV_VAR, str(config))
    run = M.run(M.sft_variants()["trl.SFTTrainer[qwen3_moe]"].make, "patch")
    assert run.error is None and len(run.grads) == 2
    model = run.trainer.model
    other = "micro" if convention == "global" else "global"
    for grads, window in zip(run.grads, run.windows):
        assert H.rel_err(grads, reference(model, run.initial, window, convention)[1]) <= TOL
        assert H.rel_err(grads, reference(model, run.initial, window, other)[1]) > 100 * TOL
    assert not run.warnings


@pytest.mark.parametrize("convention", ["micro", "global"])
@pytest.mark.parametrize("trainer", ["Trainer", "SFTTrainer"])
def test_label_smoothing_keeps_the_router_loss(trainer, convention, tmp_path, monkeypatch):
    """Label smoothing computes the token loss from the logits (transformers' LabelSmoother; TRL's SFTTrainer calls it
    with the model's plain outputs), so the router loss the model computes beside them was dropped, stock and patched,
    without a word (found by the composition matrix). It is the declared convention's router term now: exact against
    the reference with label smoothing; the control: the same gradients without the router term are far off."""
    import hf_gradfix

    eps = 0.1
    if trainer == "Trainer":
        hf_gradfix.patch({"loss": {"aux_loss": convention}, "log_fixes": False})
        try:
            model = H.build_moe("qwen3_moe")
            samples = H.make_samples("causal", n=8, seed=1)
            record = H.run_trainer(model, samples, "causal", gradient_accumulation_steps=2,
                                   per_device_train_batch_size=2, extra_args={"label_smoothing_factor": eps})
        finally:
            hf_gradfix.unpatch()
        by_idx = {s["idx"]: s for s in samples}
        steps = [(step["grads"], [record.collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]])
                 for step in record.steps]
        initial = record.initial_state
    else:
        pytest.importorskip("trl")
        import trainer_matrix as M
        from hf_gradfix.config import ENV_VAR

        config = tmp_path / "gradfix.yaml"
        config.write_text(f"hf_gradfix:\n  loss:\n    aux_loss: {convention}\n")
        monkeypatch.setenv(ENV_VAR, str(config))
        import trl

        make = M._trainer_factory(trl.SFTTrainer, M.config_class(trl.SFTTrainer), model="qwen3_moe", data=("text",),
                                  args={"label_smoothing_factor": eps})
        run = M.run(make, "patch")
        assert run.error is None and len(run.grads) == 2, run.error
        model, initial, steps = run.trainer.model, run.initial, list(zip(run.grads, run.windows))
    assert len(steps) == 2
    for grads, window in steps:
        assert H.rel_err(grads, reference(model, initial, window, convention, eps)[1]) <= TOL
        saved = model.config.router_aux_loss_coef
        model.config.router_aux_loss_coef = 0.0  # the control: the token loss alone (what stock trained)
        try:
            assert H.rel_err(grads, reference(model, initial, window, convention, eps)[1]) > 100 * TOL
        finally:
            model.config.router_aux_loss_coef = saved


def _deepseek_selection(hidden, weight, bias, groups, topk_group, top_k):
    """DeepSeek-V3's routing written from the paper (arXiv 2412.19437 sec. 2.1.2): sigmoid affinities; the bias only
    for choosing; groups ranked by the sum of their two best biased scores, the best ``topk_group`` kept; top-k."""
    scores = torch.sigmoid(hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T)
    biased = scores + bias.double()
    rows, experts = biased.shape
    per_group = biased.view(rows, groups, experts // groups)
    group_score = per_group.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros(rows, groups, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    biased = biased.masked_fill(~keep.repeat_interleave(experts // groups, dim=1), float("-inf"))
    return biased.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bias_balancing_uses_the_windows_counts(checkpointing):
    """``aux_loss: bias`` on DeepSeek-V3: after each window every router's bias moved by rate * sign(mean - load) with
    the load counted over the window's micro-batches (padding masked), recomputed here from the router inputs of
    the trained batches; gradient checkpointing (the router runs again in backward) counts nothing twice."""
    import hf_gradfix

    from hf_gradfix.integration.moe import RouterHealthCallback

    rate = 0.01
    hf_gradfix.patch({"loss": {"aux_loss": "bias", "aux_bias_rate": rate}, "log_fixes": False})
    try:
        model = H.build_moe("deepseek_v3")
        samples = H.make_samples("causal", n=8, seed=1)
        record = H.run_trainer(model, samples, "causal", gradient_accumulation_steps=2, per_device_train_batch_size=2,
                               extra_args={"gradient_checkpointing": checkpointing}, callbacks=[RouterHealthCallback()])
    finally:
        hf_gradfix.unpatch()
    cfg = model.config
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    ref = type(model)(cfg)
    ref.load_state_dict(record.initial_state)
    ref_routers = [m for m in ref.modules() if hasattr(m, "e_score_correction_bias")]
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append((m, a[0]))) for r in ref_routers]
    by_idx = {s["idx"]: s for s in samples}
    bias = [torch.zeros(cfg.n_routed_experts, dtype=torch.float64) for _ in ref_routers]
    per_micro_batch_bias = [b.clone() for b in bias]  # the control: updated from one micro-batch's counts
    last_counts, window_loads = None, []
    with torch.no_grad():
        for step in record.steps:
            loads = [torch.zeros(cfg.n_routed_experts, dtype=torch.float64) for _ in ref_routers]
            for b in step["idx_batches"]:
                mb = record.collator.collate([by_idx[i] for i in b])
                seen.clear()
                ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
                keep = mb["attention_mask"].reshape(-1).bool()
                for layer, (router, hidden) in enumerate(seen):
                    chosen = _deepseek_selection(hidden, router.weight, bias[layer], cfg.n_group, cfg.topk_group,
                                                 cfg.num_experts_per_tok)[keep]
                    c = F.one_hot(chosen, cfg.n_routed_experts).sum((0, 1)).double()
                    loads[layer] += c
                    per_micro_batch_bias[layer] += rate * torch.sign(c.mean() - c)
            for layer, load in enumerate(loads):
                bias[layer] += rate * torch.sign(load.mean() - load)
                ref_routers[layer].e_score_correction_bias.copy_(bias[layer])
            last_counts = torch.cat(loads)
            window_loads.append(loads)
    for h in hooks:
        h.remove()
    state = hf_gradfix.state_of(record.trainer).moe
    assert state.bias_windows == len(record.steps) == 2
    assert torch.equal(state.last_bias_counts, last_counts)  # not doubled by the recomputation
    for router, want, control in zip(routers, bias, per_micro_batch_bias):
        got = router.e_score_correction_bias.double()
        assert torch.allclose(got, want, atol=1e-7), (got, want)
        assert not torch.allclose(got, control, atol=1e-7)
    assert any(b.abs().sum() > 0 for b in bias)
    # router health on bias routers: each window's selections as recomputed here (logging_steps 1)
    logs = [h for h in record.trainer.state.log_history if "loss" in h]
    assert len(logs) == len(window_loads)
    for log, loads in zip(logs, window_loads):
        for layer, c in enumerate(loads):
            assert log[f"router/layer{layer}/max_load"] == pytest.approx(float(c.max() / c.mean()), abs=1e-4)
            assert log[f"router/layer{layer}/dead"] == float((c == 0).sum())


def test_bias_is_refused_on_a_model_without_a_correction_bias():
    import hf_gradfix
    from hf_gradfix.errors import GradFixError

    hf_gradfix.patch({"loss": {"aux_loss": "bias"}, "log_fixes": False})
    try:
        with pytest.raises(GradFixError, match="loss.aux_loss='bias'.*no router correction bias"):
            H.run_trainer(H.build_moe("qwen3_moe"), H.make_samples("causal", n=4, seed=1), "causal",
                          gradient_accumulation_steps=2)
    finally:
        hf_gradfix.unpatch()


def test_previous_resumes_exactly(tmp_path):
    """``previous`` carries the last window's counts: a run resumed from a checkpoint trains its next windows with
    the gradients of the uninterrupted run."""
    import hf_gradfix

    samples = H.make_samples("causal", n=12, seed=1)

    def run(max_steps, out, resume=None):
        hf_gradfix.patch({"loss": {"aux_loss": "previous"}, "log_fixes": False})
        try:
            record = H.run_trainer(H.build_moe("qwen3_moe"), samples, "causal", gradient_accumulation_steps=2,
                                   per_device_train_batch_size=2, output_dir=str(out),
                                   extra_args={"max_steps": max_steps, "save_strategy": "steps", "save_steps": 1,
                                               "learning_rate": 0.0},
                                   resume_from_checkpoint=resume)
        finally:
            hf_gradfix.unpatch()
        return record

    whole = run(3, tmp_path / "whole")
    first = run(1, tmp_path / "part")
    assert (tmp_path / "part" / "checkpoint-1" / "hf_gradfix_moe_rank0.pt").is_file()
    resumed = run(3, tmp_path / "part", resume=str(tmp_path / "part" / "checkpoint-1"))
    assert len(first.steps) == 1 and len(resumed.steps) == 2
    for k in (0, 1):  # windows 2 and 3
        assert H.rel_err(resumed.steps[k]["grads"], whole.steps[k + 1]["grads"]) <= 1e-6
    # the control: the same checkpoint without the counts (a checkpoint of an older version) is not exact
    import shutil

    shutil.copytree(tmp_path / "part" / "checkpoint-1", tmp_path / "bare" / "checkpoint-1")
    (tmp_path / "bare" / "checkpoint-1" / "hf_gradfix_moe_rank0.pt").unlink()
    (tmp_path / "bare" / "checkpoint-1" / "hf_gradfix_checkpoint.json").unlink()  # whose save listed no files either
    bare = run(3, tmp_path / "bare", resume=str(tmp_path / "bare" / "checkpoint-1"))
    assert H.rel_err(bare.steps[0]["grads"], whole.steps[1]["grads"]) > 1e-4


@pytest.mark.parametrize("convention", [None, "micro", "global"])
def test_verify_holds_a_moe_run_to_its_declared_router_convention(convention, tmp_path):
    """``verify_trainer`` on Qwen3-MoE: a patched run is EXACT against its own convention's router term; a stock
    run (transformers adds the term per micro-batch, x GA x W) is NOT EXACT, named ``router_as_is``."""
    import transformers

    import hf_gradfix

    samples = H.make_samples("causal", n=8, seed=1)
    if convention is not None:
        hf_gradfix.patch({"loss": {"aux_loss": convention}, "log_fixes": False})
    try:
        model = H.build_moe("qwen3_moe")
        args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, report_to="none", use_cpu=True,
                                              save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=H.ListDataset(samples),
                                       data_collator=H.RecordingCollator("causal", H.pad_id_of(model)))
        report = hf_gradfix.verify_trainer(trainer, steps=1)
    finally:
        if convention is not None:
            hf_gradfix.unpatch()
    step = report.steps[0]
    if convention is None:
        # transformers 5: router_as_is; 4.57 also counts the causal targets unshifted: router_as_is+count_unshifted
        assert not report.exact and step.verdict.startswith("router_as_is"), (step.verdict, step.candidates)
    else:
        assert report.exact, (step.verdict, step.grad_rel_err, step.candidates)
        other = "router_global" if convention == "micro" else "router_micro"
        assert step.candidates[other] > 1e-3, step.candidates  # held to its own convention, not the other one


def test_micro_under_cp_counts_the_micro_batch_over_its_shards_and_falls_back_once(monkeypatch):
    """``micro`` under cp without processes: the cp all-reduce replaced by one that doubles (two cp ranks holding
    the same shard). The share is rebuilt from the shard's router logits with the padding rows masked; a model whose
    aux_loss is not the Switch loss of its logits trains the per-shard mean instead, with one warning and no more
    all-reduces. The 2-process exactness run is tests/parallel/test_context_parallel.py::test_moe_micro_under_cp_*."""
    from types import SimpleNamespace

    from hf_gradfix.integration import moe as M
    from hf_gradfix.loss.moe import load_balancing

    torch.manual_seed(0)
    logits = tuple(torch.randn(8, 4, requires_grad=True) for _ in range(2))  # 2 layers, 8 rows, 4 experts
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0])  # the last 2 rows: padding (the batch's, or the pad cp added)
    groups, warnings = [], []

    def all_reduce(t, group=None):
        groups.append(group)
        t.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(M.logger, "warning", lambda *a, **k: warnings.append(a[0] % a[1:]))
    plan = SimpleNamespace(dims=SimpleNamespace(cp=2), cp_mesh=SimpleNamespace(get_group=lambda: "cp"))
    trainer = SimpleNamespace(model=torch.nn.Linear(1, 1), args=SimpleNamespace(device=torch.device("cpu")))
    state = SimpleNamespace(aux_coef=COEF)
    own = COEF * load_balancing(logits, 4, 2)  # what the model returns on its shard: no mask under cp
    moe = M.MoEState(top_k=2)
    share = M._cp_micro_share(trainer, state, moe, plan, own, logits, mask, micro_batches=2)
    # two equal shards: C and N double, the micro-batch's loss is the shard's masked loss; this rank's part of
    # coef * LB * cp / GA is half of it
    want = COEF * load_balancing(logits, 4, 2, mask) * 2 / 2 / 2
    assert torch.allclose(share, want, rtol=1e-6) and share.requires_grad
    assert not torch.allclose(share, own * 2 / 2 / 2, rtol=1e-3)  # not the unmasked shard loss
    assert groups == ["cp"] and moe.cp_checked and not moe.cp_fallback and not warnings
    moe = M.MoEState(top_k=2)
    assert M._cp_micro_share(trainer, state, moe, plan, own * 1.1, logits, mask, micro_batches=2) is None
    assert M._cp_micro_share(trainer, state, moe, plan, own, logits, mask, micro_batches=2) is None
    assert moe.cp_fallback and len(groups) == 2 and len(warnings) == 1  # every cp rank joined the flag, once
    assert "parallel.cp > 1" in warnings[0] and "not the Switch load-balancing loss" in warnings[0]
