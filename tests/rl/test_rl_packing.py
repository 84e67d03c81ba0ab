"""Padding-free policy forwards for TRL's GRPO / RLOO (issue 35, item 2; ``packing.rl_forwards``,
``hf_gradfix/integration/rl/packing.py``).

- TRL's own ``_get_per_token_logps_and_entropies`` (padded, sdpa) vs the packed one (one varlen row per chunk, the
  reference varlen attention): log-probs, entropies, the MoE aux loss and the gradient equal within fp32 rounding,
  tiny Qwen2, Llama and Mixtral, with and without TRL's chunking; the packed row is what ``PackedCollator`` builds;
- a control that must fail: the same row without restarted positions and without ``cu_seq_lens`` (the documents see
  each other);
- the hook: a GRPO run (dapo + entropy bonus, old log-probs computed) and an RLOO run with packed forwards give the
  gradient of the padded run and stay exact against ``tests/support/rl_reference.py``'s window reference; a model the guard
  refuses (OPT on sdpa mixes packed sequences), multimodal inputs and a subclass's own forward stay padded with one
  warning; a separate reference model gets its own verdict.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

trl = pytest.importorskip("trl")

import harness as H  # noqa: E402
import rl_runs  # noqa: E402
from test_rl import assert_exact  # noqa: E402

from hf_gradfix.config import config_from_dict  # noqa: E402
from hf_gradfix.integration.rl import packing as RP  # noqa: E402
from hf_gradfix.integration.state import GradFixState  # noqa: E402
from hf_gradfix.packing.attention import (  # noqa: E402
    register_reference_varlen_attention,
    reference_branch_counts,
    reset_reference_branch_counts,
    use_attention_implementation,
)
from hf_gradfix.packing.collator import PackedCollator, check_packed_batch  # noqa: E402

FP32_TOL = 2e-6  # max |packed - padded| of a log-prob / entropy: fp32 rounding (measured 4.8e-7)
GRAD_TOL = 1e-5
VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def _model(kind: str):
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**SMALL, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    else:
        raise KeyError(kind)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # as GRPOTrainer adds it
    return model


def _batch(prompt_lengths, completion_lengths, seed=1):
    """TRL's layout: prompts left-padded to the longest, completions right-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    prompt, width = max(prompt_lengths), max(completion_lengths)
    ids = torch.zeros(len(prompt_lengths), prompt + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[i, prompt - p : prompt + c] = torch.randint(3, VOCAB, (p + c,), generator=gen)
        mask[i, prompt - p : prompt + c] = 1
    return ids, mask, width


PROMPTS, COMPLETIONS = [1, 12, 5, 3, 9, 7], [16, 0, 4, 1, 9, 13]  # an empty completion, a 1-token prompt


def _padded(model, ids, mask, keep, **kw):
    """TRL 1.16's own method (the padded forward), on an object that has what it reads."""
    from accelerate import Accelerator

    fake = types.SimpleNamespace(accelerator=Accelerator(cpu=True))
    return trl.GRPOTrainer._get_per_token_logps_and_entropies(fake, model, ids, mask, keep, **kw)


def _packed(model, ids, mask, keep, **kw):
    with use_attention_implementation(model, register_reference_varlen_attention()):
        return RP.packed_per_token_logps(model, ids, mask, keep, **kw)


def _maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


def _grads(model, logps, entropies, mask, keep):
    model.zero_grad(set_to_none=True)
    completion = mask[:, -keep:].float()
    ((logps * completion).sum() + 0.1 * (entropies * completion).sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_packed_log_probs_entropies_and_gradient_equal_the_padded_forward(kind):
    model = _model(kind)
    ids, mask, keep = _batch(PROMPTS, COMPLETIONS)
    for batch_size in (None, 4):  # TRL's chunks: one packed row each
        lp, en, _ = _padded(model, ids, mask, keep, batch_size=batch_size, compute_entropy=True)
        padded_grads = _grads(model, lp, en, mask, keep)
        reset_reference_branch_counts()
        lp2, en2, _ = _packed(model, ids, mask, keep, batch_size=batch_size, compute_entropy=True)
        assert reference_branch_counts() == {"cu_seq_lens": 2 * (1 if batch_size is None else 2)}  # varlen, per layer
        assert lp2.shape == lp.shape and en2.shape == en.shape
        assert _maxdiff(lp, lp2) <= FP32_TOL, (kind, batch_size, _maxdiff(lp, lp2))
        assert _maxdiff(en, en2) <= FP32_TOL, (kind, batch_size, _maxdiff(en, en2))
        outside = ~mask[:, -keep:].bool()
        assert float(lp2.detach()[outside].abs().max()) == 0.0 and float(en2.detach()[outside].abs().max()) == 0.0
        assert H.rel_err(_grads(model, lp2, en2, mask, keep), padded_grads) <= GRAD_TOL


def test_the_packed_row_is_the_collators_and_the_moe_aux_loss_is_kept():
    ids, mask, keep = _batch(PROMPTS, COMPLETIONS)
    chunk = RP.pack_chunk(ids, mask, keep)
    prompt = ids.shape[1] - keep
    docs = []
    for i in range(ids.shape[0]):
        row = ids[i][mask[i].bool()]
        labels = row.clone()
        labels[: int(mask[i, :prompt].sum())] = -100
        docs.append({"input_ids": row, "labels": labels})
    expected = PackedCollator()(docs)
    check_packed_batch(chunk.inputs)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q"):
        got, want = chunk.inputs[key], expected[key]
        assert (torch.equal(got, want) if torch.is_tensor(want) else got == want), key
    assert chunk.real_tokens == int(mask.sum()) < chunk.padded_tokens == mask.numel()
    # a MoE policy: TRL's masked load-balancing loss over the real tokens is the packed row's
    model = _model("mixtral")
    lp, _, aux = _padded(model, ids, mask, keep, compute_aux_loss=True)
    lp2, _, aux2 = _packed(model, ids, mask, keep, compute_aux_loss=True)
    assert _maxdiff(lp, lp2) <= FP32_TOL and _maxdiff(aux, aux2) <= FP32_TOL


def test_control_without_restarted_positions_and_document_boundaries_differs():
    model = _model("qwen2")
    ids, mask, keep = _batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        lp, _, _ = _padded(model, ids, mask, keep)
        right, _, _ = _packed(model, ids, mask, keep)
        wrong, _, _ = _packed(model, ids, mask, keep, restart_positions=False, document_mask=False)
    assert _maxdiff(right, lp) <= FP32_TOL
    assert _maxdiff(wrong, lp) > 1e-2  # later samples attend to earlier ones


def test_unpackable_batches():
    assert RP.unpackable_reason(torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]), 3) is None
    assert "without a single real token" in RP.unpackable_reason(torch.tensor([[0, 0, 0, 0, 0]]), 3)
    assert "hole" in RP.unpackable_reason(torch.tensor([[1, 1, 0, 1, 1]]), 3)
    assert "no real prompt token" in RP.unpackable_reason(torch.tensor([[0, 0, 1, 1, 0]]), 3)


# --------------------------------------------------------------------------------------------- the trainer hook
class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _trainer(cls=None, **packing):
    """A TRL GRPOTrainer instance with only what the hook reads (no generation needed)."""
    from accelerate import Accelerator

    config = config_from_dict({"packing": {"rl_forwards": True, **packing}, "log_fixes": False})
    trainer = object.__new__(cls or trl.GRPOTrainer)
    trainer.accelerator = Accelerator(cpu=True)
    trainer.__dict__["_gradfix"] = GradFixState(config=config, source="test")
    return trainer, config


def test_hook_packs_each_model_refuses_a_mixing_model_and_keeps_multimodal_padded():
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    logger, keep_ = logging.getLogger("hf_gradfix"), _Keep()
    logger.addHandler(keep_)
    try:
        trainer, config = _trainer()
        packing = RP.attach(trainer, config)
        assert packing is not None and RP.attach(trainer, config) is packing  # idempotent
        ids, mask, keep = _batch(PROMPTS, COMPLETIONS)
        policy, ref = _model("qwen2"), _model("qwen2")
        lp, _, _ = _padded(policy, ids, mask, keep)
        for model in (policy, ref):  # the policy and a separate reference model: each prepared once
            out, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=4)
            assert _maxdiff(out, lp) <= FP32_TOL
            assert model.config._attn_implementation == "flash_varlen_reference"
        trainer._get_per_token_logps_and_entropies(policy, ids, mask, keep)
        assert packing.calls == {"packed": 3} and len(packing.lines) == 2, packing.calls
        assert packing.tokens["real_tokens"] == 3 * int(mask.sum()) and 0 < packing.padding_saved < 1
        # images stay padded (one warning), the model untouched
        trainer._get_per_token_logps_and_entropies(policy, ids, mask, keep, pixel_values=None)
        trainer._get_per_token_logps_and_entropies(policy, ids, mask, keep, token_type_ids=torch.zeros_like(ids))
        trainer._get_per_token_logps_and_entropies(policy, ids, mask, keep, token_type_ids=torch.zeros_like(ids))
        assert packing.calls["padded: multimodal inputs"] == 2
        assert not keep_.messages[:-1] and "token_type_ids" in keep_.messages[-1]
        keep_.messages.clear()

        # OPT on sdpa (packing.attention: keep) lets packed sequences see each other: refused, padded, one warning
        trainer, config = _trainer(attention="keep")
        packing = RP.attach(trainer, config)
        torch.manual_seed(0)
        opt = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1,
            word_embed_proj_dim=32, max_position_embeddings=128, dropout=0.0))  # TRL disables dropout
        add_fused_lm_head(opt, outputs=("log_probs", "entropy"))
        want, _, _ = _padded(opt, ids, mask, keep)
        for _ in range(2):
            got, _, _ = trainer._get_per_token_logps_and_entropies(opt, ids, mask, keep)
            assert torch.equal(got, want)
        assert packing.calls == {"padded: model refused by the packing guard": 2}
        assert len(keep_.messages) == 1 and "attend to each other" in keep_.messages[0], keep_.messages
        assert opt.config._attn_implementation == "sdpa"
        keep_.messages.clear()

        # a subclass with its own log-prob forward, and the setting off: TRL's forward stays
        class Own(trl.GRPOTrainer):
            def _get_per_token_logps_and_entropies(self, *args, **kwargs):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        trainer, config = _trainer(Own)
        assert RP.attach(trainer, config) is None and "_get_per_token_logps_and_entropies" not in trainer.__dict__
        assert len(keep_.messages) == 1 and "is its own" in keep_.messages[0]
        trainer, _ = _trainer()
        assert RP.attach(trainer, config_from_dict({})) is None
    finally:
        logger.removeHandler(keep_)


@pytest.mark.parametrize("kind,loss_type,extra", [
    ("grpo", "dapo", {"entropy_coef": 0.05}),  # old log-probs (steps_per_generation 4 = 2 x GA), entropy bonus
    ("rloo", "rloo", {}),
])
def test_a_run_with_packed_forwards_is_the_padded_run_and_exact(kind, loss_type, extra):
    on = {"packing": {"rl_forwards": True, "token_budget": 64}}
    packed = rl_runs.run_rl(kind, loss_type=loss_type, ga=2, spg=4, steps=2, n_prompts=8, extra=extra,
                            patch_config=on)
    padded = rl_runs.run_rl(kind, loss_type=loss_type, ga=2, spg=4, steps=2, n_prompts=8, extra=extra)
    packing = RP.rl_packing_of(packed.trainer)
    # TRL's default: the backward recomputes every layer, on the varlen attention the forward ran
    assert packed.trainer.args.gradient_checkpointing
    # every forward packed: one old-log-prob forward per generation batch, one per micro-batch
    assert packing.calls == {"packed": 1 + len(packed.micro_batches)}, packing.calls
    assert RP.rl_packing_of(padded.trainer) is None
    assert not packed.warnings, packed.warnings
    for a, b in zip(packed.micro_batches, padded.micro_batches):
        assert torch.equal(a["completion_ids"], b["completion_ids"])  # the same generations
        old = "old_per_token_logps" if kind == "grpo" else "old_logps"  # RLOO keeps each sequence's sum
        assert _maxdiff(a[old], b[old]) <= FP32_TOL * a["completion_ids"].shape[1]
    assert len(packed.grads) == len(padded.grads) == 2
    for a, b in zip(packed.grads, padded.grads):
        assert H.rel_err(a, b) <= GRAD_TOL
    assert_exact(packed, loss_type, entropy_coef=extra.get("entropy_coef", 0.0), what=f"{kind} packed")
