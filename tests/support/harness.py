"""Ground-truth harness for exact loss normalization tests (gradient accumulation, DDP, every head).

How a check works (see /work/shared/research/loss-normalization.md, sections 0, 1.3 and 5):

* Tiny fp32 random-init models built from configs (:func:`build_model`), every dropout 0, checked deterministic.
* Samples of very different lengths (:func:`make_samples`), each with an integer ``"idx"``.
* :func:`run_trainer` trains with SGD, ``learning_rate=0`` and ``max_grad_norm=0``: the weights never change, so every
  optimizer step can be compared with the ground truth at the *initial* weights.  A callback clones every parameter's
  ``.grad`` in ``on_pre_optimizer_step`` (after accumulation and the DDP all-reduce) together with the idx lists of the
  micro-batches consumed since the previous optimizer step (recorded by :class:`RecordingCollator`).
* :func:`ground_truth` is independent of transformers' loss code: plain PyTorch, one process, the whole optimizer window
  at once, each sample run unpadded (batch of 1, no attention mask, no labels passed to the model), the loss computed from
  the model's logits with ``F.cross_entropy(reduction="sum")`` by the task's rule, summed over every sample of the window
  (all ranks) and divided by the total target count; one backward.
* :func:`check_against_gt` compares each recorded step with the GT over that step's samples (:func:`rel_err`,
  :func:`norm_ratio`, logged loss relative error).
* :func:`run_ddp` launches ``tests/support/ddp_worker.py`` with ``torch.distributed.run`` (gloo, CPU) and loads the per-rank
  records; :func:`check_ddp_against_gt` compares window k with the GT over the union of all ranks' k-th windows.

Only plain PyTorch + the model's logits are trusted for the GT.  Weights are compared against the state recorded before
training, so a run that changed the weights is detected rather than silently compared at the wrong point.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100
VOCAB = 97
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
MASK_ID = 3  # [MASK] for the MLM task; inside the vocab, never a pad/bos/eos/decoder-start id
FIRST_CONTENT_ID = 4  # sample tokens are drawn from [FIRST_CONTENT_ID, vocab): no special ids in the data
DEFAULT_NUM_LABELS = {"seqcls": 3, "tokcls": 5}
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[1]

# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

#: arch -> task.  Every arch here is buildable tiny on transformers 4.57 and 5.23 (see :func:`build_model`).
TASKS: dict[str, str] = {
    "llama": "causal",
    "qwen2": "causal",
    "mistral": "causal",
    "gpt2": "causal",
    "mixtral": "causal",
    "qwen2_5_vl": "causal",
    "nokwargs": "causal",
    "llama_seqcls": "seqcls",
    "bert_seqcls": "seqcls",
    "llama_tokcls": "tokcls",
    "bert_tokcls": "tokcls",
    "bert_mlm": "mlm",
    "roberta_mlm": "mlm",
    "t5": "seq2seq",
    "bart": "seq2seq",
}

#: archs that could not be built on the running transformers version: arch -> reason (filled by build_model).
SKIPPED_ARCHS: dict[str, str] = {}

_SPECIAL = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    use_cache=False,
    **_SPECIAL,
)
#: the tiny GQA Llama the multi-process workers share (nd_worker, optim_dist_worker): 4 query / 2 K-V heads, so
#: tp=2 splits both, and vocabulary 128 so the workers' random ids need no special-token care
TINY_GQA_LLAMA = dict(_DECODER, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128)
_BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    classifier_dropout=0.0,
    type_vocab_size=1,
    pad_token_id=PAD_ID,
)


class NoKwargsWrapper(nn.Module):
    """A user wrapper whose ``forward`` has no ``**kwargs`` (so the Trainer sees ``model_accepts_loss_kwargs=False``).

    Returns the inner model's output unchanged; ``.config`` points to the inner config (the Trainer needs it).
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _from_config(cls, config, attn_implementation: str):
    return cls._from_config(config, attn_implementation=attn_implementation)


def _build(arch: str, attn: str, moe_aux: bool, num_labels: int | None):
    import transformers as tf

    if arch in ("llama", "llama_seqcls", "llama_tokcls", "nokwargs"):
        extra = {}
        if arch == "llama_seqcls":
            extra = dict(num_labels=num_labels or DEFAULT_NUM_LABELS["seqcls"])
        if arch == "llama_tokcls":
            # GenericForTokenClassification falls back to dropout 0.1 unless classifier_dropout is set
            extra = dict(num_labels=num_labels or DEFAULT_NUM_LABELS["tokcls"], classifier_dropout=0.0)
        cfg = tf.LlamaConfig(**_DECODER, **extra)
        cls = {
            "llama": tf.LlamaForCausalLM,
            "nokwargs": tf.LlamaForCausalLM,
            "llama_seqcls": tf.LlamaForSequenceClassification,
            "llama_tokcls": tf.LlamaForTokenClassification,
        }[arch]
        model = _from_config(cls, cfg, attn)
        return NoKwargsWrapper(model) if arch == "nokwargs" else model
    if arch == "qwen2":
        return _from_config(tf.Qwen2ForCausalLM, tf.Qwen2Config(**_DECODER), attn)
    if arch == "mistral":
        return _from_config(tf.MistralForCausalLM, tf.MistralConfig(**_DECODER, sliding_window=None), attn)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(
            **_DECODER,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            sliding_window=None,
            output_router_logits=moe_aux,
            router_aux_loss_coef=0.5 if moe_aux else 0.001,
        )
        return _from_config(tf.MixtralForCausalLM, cfg, attn)
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            use_cache=False,
            **_SPECIAL,
        )
        return _from_config(tf.GPT2LMHeadModel, cfg, attn)
    if arch in ("bert_seqcls", "bert_tokcls", "bert_mlm"):
        extra = {}
        if arch == "bert_seqcls":
            extra = dict(num_labels=num_labels or DEFAULT_NUM_LABELS["seqcls"])
        if arch == "bert_tokcls":
            extra = dict(num_labels=num_labels or DEFAULT_NUM_LABELS["tokcls"])
        cls = {
            "bert_seqcls": tf.BertForSequenceClassification,
            "bert_tokcls": tf.BertForTokenClassification,
            "bert_mlm": tf.BertForMaskedLM,
        }[arch]
        return _from_config(cls, tf.BertConfig(**_BERT, **extra), attn)
    if arch == "roberta_mlm":
        cfg = tf.RobertaConfig(**{**_BERT, "max_position_embeddings": 130}, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
        return _from_config(tf.RobertaForMaskedLM, cfg, attn)
    if arch == "t5":
        cfg = tf.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            dropout_rate=0.0,
            classifier_dropout=0.0,
            use_cache=False,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            decoder_start_token_id=PAD_ID,
        )
        return _from_config(tf.T5ForConditionalGeneration, cfg, attn)
    if arch == "bart":
        cfg = tf.BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=128,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            classifier_dropout=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            use_cache=False,
            decoder_start_token_id=EOS_ID,
            forced_eos_token_id=None,
            **_SPECIAL,
        )
        return _from_config(tf.BartForConditionalGeneration, cfg, attn)
    if arch == "qwen2_5_vl":
        text = dict(_DECODER)
        text.pop("tie_word_embeddings")
        # head_dim 16 -> 8 rotary frequencies, split over (temporal, height, width)
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3], "rope_type": "default"}
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            fullatt_block_indexes=[0],
            window_size=28,
        )
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **_SPECIAL)
        cfg.use_cache = False
        return _from_config(tf.Qwen2_5_VLForConditionalGeneration, cfg, attn)
    raise KeyError(f"unknown arch {arch!r}; known: {sorted(TASKS)}")


def build_model(
    arch: str,
    seed: int = 0,
    *,
    attn_implementation: str = "eager",
    moe_aux: bool = False,
    num_labels: int | None = None,
) -> nn.Module:
    """Tiny fp32 random-init model for ``arch`` (vocab 97, hidden 32, 2 layers, every dropout 0).

    ``moe_aux`` (mixtral only): build with ``output_router_logits=True, router_aux_loss_coef=0.5``.
    The task is recorded on the model as ``model._hgf_task`` (and in :data:`TASKS`; see :func:`task_of`).
    Raises ``RuntimeError`` (and records the arch in :data:`SKIPPED_ARCHS`) if the arch cannot be built tiny on the
    installed transformers version; tests should ``pytest.skip`` on that.
    """
    if arch not in TASKS:
        raise KeyError(f"unknown arch {arch!r}; known: {sorted(TASKS)}")
    torch.manual_seed(seed)
    try:
        model = _build(arch, attn_implementation, moe_aux, num_labels)
    except (AttributeError, ImportError, TypeError, ValueError) as e:  # class or config field missing in this version
        import transformers

        SKIPPED_ARCHS[arch] = f"transformers {transformers.__version__}: {type(e).__name__}: {e}"
        raise RuntimeError(f"cannot build arch {arch!r}: {SKIPPED_ARCHS[arch]}") from e
    model = model.float()
    for m in model.modules():  # belt and braces: any dropout module left non-zero is a harness bug
        if isinstance(m, nn.Dropout) and m.p != 0.0:
            raise AssertionError(f"{arch}: dropout {m} left at p={m.p}")
    model._hgf_task = TASKS[arch]
    model._hgf_arch = arch
    model.train()
    return model


def task_of(arch_or_model) -> str:
    """Task of an arch name or of a model built by :func:`build_model`."""
    if isinstance(arch_or_model, str):
        return TASKS[arch_or_model]
    task = getattr(arch_or_model, "_hgf_task", None)
    if task is None:
        raise ValueError("model was not built by harness.build_model; pass the task explicitly")
    return task


def build_moe(family: str, coef: float = 0.5):
    """A tiny random-init MoE causal LM with a load-balancing aux loss (``output_router_logits=True``, ``coef``):
    ``qwen3_moe`` (6 experts; ``qwen3_moe_kv2``: 2 KV heads, for tp 2), ``mixtral`` (4), ``olmoe`` (6); top-2, 2
    layers, every layer sparse, seed 0.
    ``deepseek_v3``: 8 routed experts in 2 groups (1 chosen), a shared expert, a correction bias, no aux loss."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128, output_router_logits=True,
                  router_aux_loss_coef=coef, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family in ("qwen3_moe", "qwen3_moe_kv2"):  # kv2: 2 KV heads, for tensor parallelism 2
        if family == "qwen3_moe_kv2":
            common["num_key_value_heads"] = 2
        cfg = tf.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=6, decoder_sparse_step=1,
                                mlp_only_layers=[], norm_topk_prob=True, head_dim=16)
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, router_jitter_noise=0.0, sliding_window=None)
        return tf.MixtralForCausalLM(cfg)
    if family == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=6)
        return tf.OlmoeForCausalLM(cfg)
    if family == "deepseek_v3":  # aux-loss-free: sigmoid scores + a correction bias, group-limited top-k, no aux loss
        cfg = tf.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, routed_scaling_factor=1.0,
            max_position_embeddings=128, tie_word_embeddings=False)
        return tf.DeepseekV3ForCausalLM(cfg)
    raise KeyError(family)


def pad_id_of(model) -> int:
    cfg = getattr(model, "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(cfg, "text_config", None), "pad_token_id", None)
    return PAD_ID if pad is None else int(pad)


def check_deterministic(model: nn.Module, task: str, seed: int = 0) -> float:
    """Run one sample twice in train mode; returns max |logit diff| (must be 0: no dropout, no router noise)."""
    s = make_samples(task, n=1, seed=seed, lo=7, hi=7)[0]
    with torch.no_grad():
        a = _logits(model, s, task)
        b = _logits(model, s, task)
    return float((a - b).abs().max())


# ----------------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------------


def _lengths(n: int, lo: int, hi: int, g: torch.Generator) -> list[int]:
    """n lengths spread evenly over [lo, hi] (both ends included), in a seeded random order."""
    if n == 1:
        return [lo]
    base = [round(lo + (hi - lo) * i / (n - 1)) for i in range(n)]
    perm = torch.randperm(n, generator=g).tolist()
    return [base[p] for p in perm]


def make_samples(
    task: str,
    n: int = 12,
    lo: int = 3,
    hi: int = 41,
    vocab: int = VOCAB,
    seed: int = 0,
    num_labels: int | None = None,
    prompt_mask_frac: float = 0.0,
    target_lo: int = 1,
    target_hi: int | None = None,
) -> list[dict]:
    """``n`` samples of very different lengths (evenly spread over [lo, hi], shuffled by ``seed``).

    Every sample has an int ``"idx"`` (its position in the returned list) and python-int lists.  Tokens are drawn from
    ``[4, vocab)`` (0 pad, 1 bos, 2 eos, 3 mask never appear except as the MLM mask).

    * causal:  ``input_ids``, ``labels`` = input_ids; with ``prompt_mask_frac`` the first ``round(frac*L)`` labels are
      -100 (capped so the last token always stays a target, i.e. ``labels[1:]`` has >= 1 target).
    * seqcls:  ``input_ids``, ``labels`` = one int in ``[0, num_labels)``.
    * tokcls:  ``input_ids``, per-token ``labels`` in ``[0, num_labels)`` with ~20% -100 (>= 1 target).
    * mlm:     ``labels`` -100 except ~30% of positions (>= 1); those input positions are replaced by ``MASK_ID``.
    * seq2seq: ``input_ids`` and target ``labels`` of a different length in ``[target_lo, target_hi]`` (>= 1 token).
    """
    if task not in ("causal", "seqcls", "tokcls", "mlm", "seq2seq"):
        raise ValueError(f"unknown task {task!r}")
    g = torch.Generator().manual_seed(seed)
    lens = _lengths(n, lo, hi, g)
    nl = num_labels or DEFAULT_NUM_LABELS.get(task)
    if task == "seq2seq":
        t_hi = target_hi if target_hi is not None else max(target_lo + 1, hi // 2)
        tlens = _lengths(n, target_lo, t_hi, g)
    out = []
    for i, L in enumerate(lens):
        ids = torch.randint(FIRST_CONTENT_ID, vocab, (L,), generator=g)
        s: dict[str, Any] = {"idx": i}
        if task == "causal":
            labels = ids.clone()
            k = min(round(prompt_mask_frac * L), L - 1)
            if k > 0:
                labels[:k] = IGNORE_INDEX
            s["input_ids"], s["labels"] = ids.tolist(), labels.tolist()
        elif task == "seqcls":
            s["input_ids"] = ids.tolist()
            s["labels"] = int(torch.randint(0, nl, (1,), generator=g))
        elif task == "tokcls":
            labels = torch.randint(0, nl, (L,), generator=g)
            drop = torch.rand(L, generator=g) < 0.2
            drop[int(torch.randint(0, L, (1,), generator=g))] = False
            labels[drop] = IGNORE_INDEX
            s["input_ids"], s["labels"] = ids.tolist(), labels.tolist()
        elif task == "mlm":
            pick = torch.rand(L, generator=g) < 0.3
            pick[int(torch.randint(0, L, (1,), generator=g))] = True
            labels = torch.full((L,), IGNORE_INDEX, dtype=torch.long)
            labels[pick] = ids[pick]
            inp = ids.clone()
            inp[pick] = MASK_ID
            s["input_ids"], s["labels"] = inp.tolist(), labels.tolist()
        else:  # seq2seq
            tgt = torch.randint(FIRST_CONTENT_ID, vocab, (tlens[i],), generator=g)
            s["input_ids"], s["labels"] = ids.tolist(), tgt.tolist()
        out.append(s)
    return out


def arrange_for_ranks(samples: Sequence[dict], world_size: int = 2, batch_size: int = 1) -> list[dict]:
    """Reorder samples so that rank r of a sequential, rank-interleaved sharding gets the r-th length quantile.

    accelerate shards a sequential loader batch-wise: batch b (dataset positions ``b*bs .. b*bs+bs-1``) goes to rank
    ``b % world_size``.  This puts the shortest samples on rank 0 and the longest on the last rank (very different
    token counts per rank).  ``idx`` values are kept, so records still name the original samples.
    """
    n = len(samples)
    per_rank = n // world_size
    order = sorted(samples, key=lambda s: (len(s["input_ids"]), s["idx"]))
    buckets = [order[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
    buckets[-1].extend(order[world_size * per_rank :])
    out: list[dict] = []
    pos = [0] * world_size
    b = 0
    while len(out) < n:
        r = b % world_size
        take = buckets[r][pos[r] : pos[r] + batch_size]
        pos[r] += len(take)
        out.extend(take)
        b += 1
        if all(pos[q] >= len(buckets[q]) for q in range(world_size)):
            break
    assert sorted(s["idx"] for s in out) == sorted(s["idx"] for s in samples)
    return out


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, samples: Sequence[dict]):
        self.samples = list(samples)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return dict(self.samples[i])


def _pad(seqs: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out


class RecordingCollator:
    """Right-pads a list of samples and records which samples each micro-batch contained.

    ``input_ids`` padded with ``pad_id``, ``attention_mask`` built (1 = real token), ``labels`` padded with -100
    (seqcls: a ``(B,)`` tensor; seq2seq: padded to the longest target).  Any other list-valued key is right-padded with
    -100 (label-like, e.g. ``shift_labels``), scalar keys become a ``(B,)`` tensor.  ``"idx"`` is stripped and the list of
    idx of the batch is appended to :attr:`batches` (in the order batches are produced, per process).
    """

    def __init__(self, task: str, pad_id: int = PAD_ID):
        self.task = task
        self.pad_id = pad_id
        self.batches: list[list[int]] = []

    def collate(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Collate without recording."""
        feats = [dict(f) for f in features]
        for f in feats:
            f.pop("idx", None)
        batch: dict[str, torch.Tensor] = {}
        ids = [f.pop("input_ids") for f in feats]
        batch["input_ids"] = _pad(ids, self.pad_id)
        batch["attention_mask"] = _pad([[1] * len(s) for s in ids], 0)
        keys = list(feats[0].keys())
        for k in keys:
            vals = [f[k] for f in feats]
            if isinstance(vals[0], (int, float)) or (torch.is_tensor(vals[0]) and vals[0].dim() == 0):
                batch[k] = torch.as_tensor([int(v) if not isinstance(v, float) else v for v in vals])
            else:
                batch[k] = _pad(vals, IGNORE_INDEX)
        return batch

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        self.batches.append([int(f["idx"]) for f in features])
        return self.collate(features)


# ----------------------------------------------------------------------------------------------------------------------
# Ground truth
# ----------------------------------------------------------------------------------------------------------------------


def _decoder_input_ids(model, labels: torch.Tensor) -> torch.Tensor:
    inner = getattr(model, "get_base_model", None)
    base = inner() if callable(inner) else model
    for m in (model, base):
        fn = getattr(m, "prepare_decoder_input_ids_from_labels", None)
        if callable(fn):
            return fn(labels=labels)
    for m in (model, base):
        fn = getattr(m, "_shift_right", None)
        if callable(fn):
            return fn(labels)
    raise ValueError(f"{type(model).__name__}: no way to shift labels into decoder_input_ids")


def _logits(model: nn.Module, sample: dict, task: str) -> torch.Tensor:
    """Forward one sample unpadded (batch of 1, no attention mask, no labels); returns the logits."""
    ids = torch.as_tensor(sample["input_ids"], dtype=torch.long).unsqueeze(0)
    if task == "seq2seq":
        labels = torch.as_tensor(sample["labels"], dtype=torch.long).unsqueeze(0)
        out = model(input_ids=ids, decoder_input_ids=_decoder_input_ids(model, labels))
    else:
        out = model(input_ids=ids)
    return out["logits"] if isinstance(out, dict) else out.logits


def sample_loss_sum(model: nn.Module, sample: dict, task: str) -> tuple[torch.Tensor, int]:
    """(sum of per-target CE of one sample, number of targets) by the task's rule, from the model's logits.

    causal: ``logits[:, :-1]`` vs ``labels[:, 1:]``; tokcls / mlm / seq2seq: unshifted; seqcls: CE of the row's logits
    vs its label, count 1.  If the model returns V more positions than the sample has tokens (PEFT prompt learning
    prepends V virtual tokens), the labels are left-padded with V x -100 first, as PEFT does: for a causal LM the last
    virtual token then predicts ``labels[0]``, which becomes a target (count = non -100 labels, unshifted).
    """
    logits = _logits(model, sample, task).float()
    if task == "seqcls":
        label = torch.as_tensor([int(sample["labels"])], dtype=torch.long)
        return F.cross_entropy(logits.reshape(1, -1), label, reduction="sum"), 1
    if task not in ("causal", "tokcls", "mlm", "seq2seq"):
        raise ValueError(f"unknown task {task!r}")
    labels = torch.as_tensor(sample["labels"], dtype=torch.long).unsqueeze(0)
    extra = logits.shape[1] - labels.shape[1]
    if extra > 0 and task != "seq2seq":  # virtual tokens in front (prompt learning)
        labels = torch.cat([torch.full((1, extra), IGNORE_INDEX, dtype=torch.long), labels], dim=1)
    if task == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"{task}: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    count = int((labels != IGNORE_INDEX).sum())
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    return ce, count


def loss_honours_num_items(model: nn.Module, samples: Sequence[dict], task: str) -> bool:
    """Measured, never assumed from a release: does the model's own loss divide its sum by ``num_items_in_batch``
    when the Trainer passes it? (Stock transformers' gradient accumulation is exact only for such a model.)

    The model is called on one collated batch with ``num_items_in_batch`` = 1 and = 2: a loss that honours it
    halves. A forward that refuses the keyword, or ignores it, does not."""
    batch = RecordingCollator(task, pad_id_of(model)).collate(samples)
    losses = []
    with torch.no_grad():
        for k in (1, 2):
            try:
                out = model(**batch, num_items_in_batch=torch.tensor(k))
            except TypeError:  # forward without **kwargs: the Trainer cannot pass the count at all
                return False
            losses.append(float(out.loss))
    return abs(losses[0] - 2 * losses[1]) <= 1e-5 * abs(losses[0])


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: grad clone} for every trainable parameter (a missing grad counts as zeros)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    return out


def _zero_grads(model: nn.Module):
    for p in model.parameters():
        p.grad = None


def router_aux_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own router aux (load-balancing) loss on one collated micro-batch (padding mask included)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    aux = out["aux_loss"] if isinstance(out, dict) else out.aux_loss
    if aux is None:
        raise ValueError(f"{type(model).__name__} returned no aux_loss")
    return aux


def ground_truth_details(
    model: nn.Module,
    samples: Iterable[dict],
    task: str,
    micro_batches: Sequence[dict[str, torch.Tensor]] | None = None,
    coef: float | None = None,
    aux_scale: float = 1.0,
) -> dict:
    """Shared GT core.  Returns dict(loss, grads, ce_loss, n_targets, aux (mean aux or None)).

    With ``micro_batches`` (MoE), adds ``coef * aux_scale * mean_k aux(micro_batch_k)`` (see
    :func:`ground_truth_with_aux`).  One backward; ``.grad`` is zeroed before and after; train mode.
    """
    samples = list(samples)
    _zero_grads(model)
    model.train()
    total, count = None, 0
    for s in samples:
        ce, c = sample_loss_sum(model, s, task)
        total = ce if total is None else total + ce
        count += c
    if count == 0:
        raise ValueError("window has no targets")
    ce_loss = total / count
    loss, aux = ce_loss, None
    if micro_batches is not None:
        if coef is None:
            cfg = model.config
            coef = float(getattr(cfg, "router_aux_loss_coef", None) or cfg.get_text_config().router_aux_loss_coef)
        aux = torch.stack([router_aux_loss(model, mb) for mb in micro_batches]).mean()
        loss = ce_loss + coef * aux_scale * aux
    loss.backward()
    grads = _grads(model)
    _zero_grads(model)
    return dict(loss=float(loss.detach()), grads=grads, ce_loss=float(ce_loss.detach()), n_targets=count,
                aux=None if aux is None else float(aux.detach()))


def ground_truth(model: nn.Module, samples: Iterable[dict], task: str) -> tuple[float, dict[str, torch.Tensor]]:
    """GT (token-mean loss, gradient) over ``samples`` (one optimizer window, all ranks; duplicates count each time).

    Plain PyTorch in one process: each sample alone, unpadded, no labels and no attention mask passed to the model;
    CE sum by the task rule (:func:`sample_loss_sum`: causal logits[:, :-1] vs labels[:, 1:]; tokcls/mlm/seq2seq
    unshifted, the seq2seq decoder fed the model's own shift-right of the labels; seqcls one CE per sample), summed
    over all samples in the same graph, divided by the total target count, one backward (fp32).  Returns
    ``(loss, {name: grad})`` for every parameter with ``requires_grad`` (a missing grad is zeros).  The model is left
    in train mode with ``.grad`` cleared.
    """
    d = ground_truth_details(model, samples, task)
    return d["loss"], d["grads"]


def ground_truth_with_aux(
    model: nn.Module,
    samples: Iterable[dict],
    task: str,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    coef: float | None = None,
    aux_scale: float = 1.0,
) -> tuple[float, dict[str, torch.Tensor]]:
    """GT for MoE with a router aux loss (target convention = TRL's, research doc P1-4):

        total = (sum of token CE over the window) / N  +  coef * aux_scale * mean_k aux(micro_batch_k)

    ``micro_batches``: every collated micro-batch of the window on every rank (``input_ids`` + ``attention_mask``, as
    the Trainer saw them; rebuild them with ``RecordingCollator.collate`` from recorded idx lists); the aux term is the
    model's own ``aux_loss`` on each of them (``output_router_logits=True``, padding masked as the model does),
    averaged over micro-batches and ranks.  ``coef`` defaults to ``config.router_aux_loss_coef``.  ``aux_scale``
    expresses a known-wrong convention: the stock Trainer adds ``coef * aux`` per micro-batch, never divided by GA, and
    the DDP loss is multiplied by W, so stock matches ``aux_scale = GA * W`` (measured exact, 1.4e-7).
    The CE part is the same as :func:`ground_truth`.
    """
    d = ground_truth_details(model, samples, task, micro_batches=micro_batches, coef=coef, aux_scale=aux_scale)
    return d["loss"], d["grads"]


# ----------------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------------


def _flat(g: dict[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor:
    return torch.cat([g[k].detach().reshape(-1).double() for k in keys])


def _common_keys(g: dict, g_ref: dict) -> list[str]:
    if set(g) != set(g_ref):
        raise KeyError(f"parameter sets differ: only in g {sorted(set(g) - set(g_ref))[:5]}, "
                       f"only in ref {sorted(set(g_ref) - set(g))[:5]}")
    return sorted(g_ref)


def rel_err(g: dict[str, torch.Tensor], g_ref: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters concatenated (float64)."""
    keys = _common_keys(g, g_ref)
    a, b = _flat(g, keys), _flat(g_ref, keys)
    return float((a - b).norm() / b.norm())


def norm_ratio(g: dict[str, torch.Tensor], g_ref: dict[str, torch.Tensor]) -> float:
    """||g|| / ||g_ref||."""
    keys = _common_keys(g, g_ref)
    return float(_flat(g, keys).norm() / _flat(g_ref, keys).norm())


def cosine(g: dict[str, torch.Tensor], g_ref: dict[str, torch.Tensor]) -> float:
    keys = _common_keys(g, g_ref)
    a, b = _flat(g, keys), _flat(g_ref, keys)
    return float(a @ b / (a.norm() * b.norm()))


# ----------------------------------------------------------------------------------------------------------------------
# Trainer runs
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunRecord:
    """What :func:`run_trainer` observed.

    steps[k]: ``idx_batches`` (list of idx lists, one per micro-batch consumed by this process in optimizer step k),
    ``grads`` ({name: grad} at ``on_pre_optimizer_step``, after accumulation and all-reduce), ``local_loss`` (sum of
    the values ``training_step`` returned on this process in step k: exactly what the Trainer adds to its logged
    loss; in DDP the logged loss is the mean over ranks).
    logged_losses: the ``"loss"`` entries of ``trainer.state.log_history`` (one per step with ``logging_steps=1``;
    transformers 4.x rounds them to 4 decimals, see ``logged_loss_decimals``).
    initial_state: a copy of the model's state_dict before training (GT is computed at these weights).
    """

    steps: list[dict]
    logged_losses: list[float]
    trainer: Any
    initial_state: dict[str, torch.Tensor]
    task: str
    collator: RecordingCollator | None = None
    logged_loss_decimals: int | None = None


def _make_recorder():
    """The recording TrainerCallback (built lazily so importing this module does not import transformers)."""
    from transformers import TrainerCallback

    class GradRecorder(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.collator: RecordingCollator | None = None
            self.steps: list[dict] = []
            self._consumed_at_last_step = 0

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            tr = self.trainer
            model = tr.model  # the unwrapped model: its parameters are the DDP module's parameters
            n = tr._hgf_consumed
            batches = self.collator.batches[self._consumed_at_last_step : n]
            if len(batches) != n - self._consumed_at_last_step:
                raise RuntimeError("collator recorded fewer batches than training_step consumed")
            self._consumed_at_last_step = n
            self.steps.append(
                dict(idx_batches=[list(b) for b in batches], grads=_grads(model), local_loss=tr._hgf_step_loss)
            )
            tr._hgf_step_loss = 0.0

    return GradRecorder()


class _HarnessMixin:
    """Mixed in front of any Trainer class: sequential sampler, counts micro-batches consumed."""

    _hgf_consumed = 0
    _hgf_step_loss = 0.0

    def _get_train_sampler(self, train_dataset=None, *args, **kwargs):  # 4.57 and 5.23: (self, train_dataset=None)
        ds = train_dataset if train_dataset is not None else self.train_dataset
        return torch.utils.data.SequentialSampler(ds)

    def training_step(self, model, inputs, *args, **kwargs):
        # micro-batches are collated in order and consumed in order (num_workers=0), so the n-th call consumes the
        # n-th recorded batch even though the Trainer / accelerate prefetch ahead.
        self._hgf_consumed += 1
        loss = super().training_step(model, inputs, *args, **kwargs)
        self._hgf_step_loss += float(loss.detach())
        return loss


def _subclass(trainer_cls):
    return type(f"Harness{trainer_cls.__name__}", (_HarnessMixin, trainer_cls), {})


def run_trainer(
    model: nn.Module,
    samples: Sequence[dict],
    task: str | None = None,
    *,
    per_device_train_batch_size: int = 1,
    gradient_accumulation_steps: int = 4,
    num_train_epochs: float = 1,
    trainer_cls=None,
    callbacks: Sequence = (),
    compute_loss_func: Callable | None = None,
    extra_args: dict | None = None,
    trainer_kwargs: dict | None = None,
    output_dir: str | os.PathLike | None = None,
    seed: int = 0,
    args_cls=None,
    before_train: Callable | None = None,
    dataset=None,
    resume_from_checkpoint: str | None = None,
) -> RunRecord:
    """Train ``model`` on ``samples`` (dataset order kept) with SGD lr=0 and record every optimizer step.

    TrainingArguments: optim sgd, lr 0, weight_decay 0, max_grad_norm 0, constant schedule, logging_steps 1,
    report_to none, save_strategy no, use_cpu, dataloader_num_workers 0, remove_unused_columns False (the collator must
    see ``idx``), seed fixed; ``extra_args`` override/extend them (e.g. ``average_tokens_across_devices``,
    ``label_smoothing_factor``).  ``trainer_cls`` (default ``transformers.Trainer``; any subclass, e.g. TRL's) is
    subclassed on the fly with a mixin that returns a ``SequentialSampler`` and counts consumed micro-batches.
    ``callbacks`` are passed to the Trainer (e.g. the plugin's); the recorder is added after them, so it sees the
    gradients after every other ``on_pre_optimizer_step`` (and after clipping if ``max_grad_norm`` is overridden).
    ``trainer_kwargs`` go to the trainer constructor.  ``PrinterCallback`` is removed (quiet logs).
    Must be called in every process under torchrun (DDP is set up by the Trainer).
    """
    import transformers

    task = task or task_of(model)
    trainer_cls = trainer_cls or transformers.Trainer
    own_dir = output_dir is None
    if own_dir:
        output_dir = tempfile.mkdtemp(prefix="hgf_run_")
    args = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_train_epochs=num_train_epochs,
        optim="sgd",
        learning_rate=0.0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        logging_strategy="steps",
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
    )
    args.update(extra_args or {})
    targs = (args_cls or transformers.TrainingArguments)(**args)
    collator = RecordingCollator(task, pad_id_of(model))
    recorder = _make_recorder()
    recorder.collator = collator
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kw = dict(trainer_kwargs or {})
    if compute_loss_func is not None:
        kw["compute_loss_func"] = compute_loss_func
    trainer = _subclass(trainer_cls)(
        model=model,
        args=targs,
        train_dataset=ListDataset(samples) if dataset is None else dataset,
        data_collator=collator,
        callbacks=list(callbacks) + [recorder],
        **kw,
    )
    recorder.trainer = trainer
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # keep test output quiet (log_history still has every log)
    if before_train is not None:
        before_train(trainer)
    try:
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        if own_dir:
            shutil.rmtree(output_dir, ignore_errors=True)
    logged = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    decimals = 4 if int(transformers.__version__.split(".")[0]) < 5 else None
    return RunRecord(
        steps=recorder.steps,
        logged_losses=logged,
        trainer=trainer,
        initial_state=initial_state,
        task=task,
        collator=collator,
        logged_loss_decimals=decimals,
    )


def _model_at_initial_state(model_or_builder, initial_state: dict | None) -> nn.Module:
    model = model_or_builder if isinstance(model_or_builder, nn.Module) else model_or_builder()
    if initial_state is not None:
        model.load_state_dict(initial_state, strict=True)
    return model


def trainer_loss(logged: float | None, unrounded: float | None, decimals: int | None) -> float | None:
    """The per-step loss the Trainer logs, unrounded.

    transformers 5.x logs the exact value; 4.x logs ``round(value, 4)``.  In that case the unrounded value is the sum
    of ``training_step`` returns (single process) or its mean over ranks (DDP), i.e. exactly what the Trainer rounded;
    this is verified against the rounded log (a mismatch returns the logged value, so the error is not hidden).
    """
    if logged is None or decimals is None or unrounded is None:
        return logged
    if abs(round(unrounded, decimals) - logged) <= 1.01 * 10 ** (-decimals):
        return unrounded
    return logged


def check_against_gt(
    model_or_builder,
    samples: Sequence[dict],
    task: str,
    record: RunRecord,
    *,
    aux_coef: float | None = None,
    aux_scale: float = 1.0,
    use_aux: bool = False,
) -> list[tuple[float, float | None]]:
    """For each recorded step: (grad rel_err, logged-loss rel err) vs the GT over that step's samples at the initial
    weights.  ``model_or_builder``: the trained model (its weights are reset to ``record.initial_state``) or a zero-arg
    callable returning a fresh model.  The loss error is that of the Trainer's logged loss (on transformers 4.x, which
    rounds logs to 4 decimals, the unrounded value the Trainer logged, see :func:`trainer_loss`); None if not logged.

    ``use_aux``: GT via :func:`ground_truth_with_aux` on the recorded micro-batches (re-collated from idx).
    Full per-step details (norm_ratio, cosine, gt loss, local loss) are in :func:`compare_steps`.
    """
    rows = compare_steps(model_or_builder, samples, task, record.steps, record.logged_losses,
                         initial_state=record.initial_state, aux_coef=aux_coef, aux_scale=aux_scale, use_aux=use_aux,
                         logged_loss_decimals=record.logged_loss_decimals)
    return [(r["rel_err"], r["loss_rel_err"]) for r in rows]


def compare_steps(
    model_or_builder,
    samples: Sequence[dict],
    task: str,
    steps: Sequence[dict],
    logged_losses: Sequence[float] | None = None,
    *,
    initial_state: dict | None = None,
    aux_coef: float | None = None,
    aux_scale: float = 1.0,
    use_aux: bool = False,
    pad_id: int | None = None,
    logged_loss_decimals: int | None = None,
) -> list[dict]:
    """Per-step comparison dicts: step, rel_err, norm_ratio, cosine, gt_loss, gt_aux, logged_loss (as in
    log_history), trainer_loss (logged, unrounded on 4.x), loss_rel_err (of trainer_loss), local_loss (sum of this
    process' training_step returns; mean over ranks for run_ddp results), local_loss_rel_err, n_samples, n_targets.

    ``steps[k]["idx_batches"]`` must hold every micro-batch of window k on every rank (:func:`run_ddp` merges them);
    duplicates (accelerate ``even_batches`` padding) count as many times as they appear.
    """
    model = _model_at_initial_state(model_or_builder, initial_state)
    by_idx = {int(s["idx"]): s for s in samples}
    collator = RecordingCollator(task, pad_id_of(model) if pad_id is None else pad_id)
    rows = []
    for k, step in enumerate(steps):
        window = [by_idx[i] for b in step["idx_batches"] for i in b]
        mbs = None
        if use_aux:
            mbs = [collator.collate([by_idx[i] for i in b]) for b in step["idx_batches"]]
        d = ground_truth_details(model, window, task, micro_batches=mbs, coef=aux_coef, aux_scale=aux_scale)
        gt_loss, gt = d["loss"], d["grads"]
        logged = logged_losses[k] if logged_losses is not None and k < len(logged_losses) else None
        local = step.get("local_loss")
        tl = trainer_loss(logged, local, logged_loss_decimals)
        rows.append(dict(
            step=k,
            rel_err=rel_err(step["grads"], gt),
            norm_ratio=norm_ratio(step["grads"], gt),
            cosine=cosine(step["grads"], gt),
            gt_loss=gt_loss,
            gt_aux=d["aux"],
            logged_loss=logged,
            trainer_loss=tl,
            loss_rel_err=None if tl is None else abs(tl - gt_loss) / abs(gt_loss),
            local_loss=local,
            local_loss_rel_err=None if local is None else abs(local - gt_loss) / abs(gt_loss),
            n_samples=len(window),
            n_targets=d["n_targets"],
        ))
    return rows


def sample_loss_count(sample: dict, task: str) -> int:
    """Number of targets of one sample by the GT rule (causal: labels[1:] != -100; seqcls: 1; else labels != -100)."""
    if task == "seqcls":
        return 1
    labels = list(sample["labels"])
    if task == "causal":
        labels = labels[1:]
    return sum(1 for x in labels if x != IGNORE_INDEX)


# ----------------------------------------------------------------------------------------------------------------------
# DDP
# ----------------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    from multiproc import free_port

    return free_port()


def run_ddp(
    scenario: str,
    nproc: int = 2,
    patch: bool = True,
    extra: Sequence[str] = (),
    out_dir: str | os.PathLike | None = None,
    python: str | None = None,
) -> dict:
    """Launch ``tests/support/ddp_worker.py --scenario NAME`` under ``torch.distributed.run`` (gloo, CPU, 127.0.0.1).

    ``patch``: pass ``--patch`` (the worker calls ``hf_gradfix.patch()``; if the plugin is missing, the worker exits
    with code 77 and this raises ``PluginMissing`` so a test can skip).  ``extra``: more worker flags, e.g.
    ``["--avg-false"]`` or ``["--set", "gradient_accumulation_steps=2"]``.

    Returns a dict: ``scenario``, ``meta`` (rank 0's ``meta``: task, arch, world_size, flags), ``samples``,
    ``initial_state``, ``ranks`` (each rank's raw record), ``steps`` (merged: window k = k-th optimizer step,
    ``idx_batches`` = rank 0's micro-batches then rank 1's..., ``idx_batches_per_rank``, ``grads`` from rank 0,
    ``local_losses`` per rank, ``rank_grad_max_diff`` between ranks), ``logged_losses`` (rank 0's log history),
    ``stdout``/``stderr``.  Use :func:`check_ddp_against_gt` for the GT comparison.
    """
    own_dir = out_dir is None
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix=f"hgf_ddp_{scenario}_"))
    out.mkdir(parents=True, exist_ok=True)
    from multiproc import run_launch, torchrun, worker_env

    cmd = torchrun(TESTS_DIR / "ddp_worker.py", "--scenario", scenario, "--out", str(out), nproc=nproc, python=python)
    if patch:
        cmd.append("--patch")
    cmd.extend(extra)

    env = worker_env()
    proc = run_launch(cmd, step="ddp_worker.py launch", cwd=str(REPO_ROOT), env=env)  # a hang says HANG: ...
    if (out / "PLUGIN_MISSING").exists():
        raise PluginMissing((out / "PLUGIN_MISSING").read_text())
    if proc.returncode != 0:
        print(proc.stdout[-6000:], file=sys.stderr)
        print(proc.stderr[-20000:], file=sys.stderr)
        raise RuntimeError(f"DDP scenario {scenario!r} failed with return code {proc.returncode} (stderr printed)")
    result = _ddp_result(scenario, out, nproc, proc.stdout, proc.stderr)
    if own_dir:
        shutil.rmtree(out, ignore_errors=True)
        result["out_dir"] = None
    return result


def run_ddp_many(jobs: Sequence[tuple[str, Sequence[str]]], nproc: int = 2, patch: bool = True) -> list[dict]:
    """Several :func:`run_ddp` jobs ``(scenario, extra flags)`` in ONE launch of ``nproc`` processes (the worker's
    ``--jobs``): the imports and the rendezvous are paid once. Returns one :func:`run_ddp` result per job, in order;
    each result's ``stderr`` is that job's ``hf_gradfix`` log (both ranks), not the launch's."""
    base = Path(tempfile.mkdtemp(prefix="hgf_ddp_many_"))
    argv_list = []
    for i, (scenario, extra) in enumerate(jobs):
        argv = ["--scenario", scenario, "--out", str(base / f"job{i}")] + (["--patch"] if patch else []) + list(extra)
        argv_list.append(argv)
    (base / "jobs.json").write_text(json.dumps(argv_list))
    from multiproc import run_launch, torchrun, worker_env

    cmd = torchrun(TESTS_DIR / "ddp_worker.py", "--jobs", str(base / "jobs.json"), nproc=nproc)

    proc = run_launch(cmd, step="ddp_worker.py --jobs launch", cwd=str(REPO_ROOT), env=worker_env())
    try:
        if proc.returncode != 0:
            print(proc.stderr[-20000:], file=sys.stderr)
            raise RuntimeError(f"DDP jobs {[j[0] for j in jobs]} failed with return code {proc.returncode}")
        results = []
        for i, (scenario, _extra) in enumerate(jobs):
            out = base / f"job{i}"
            logs = "".join((out / f"rank{r}.log").read_text() for r in range(nproc) if (out / f"rank{r}.log").exists())
            results.append(_ddp_result(scenario, out, nproc, proc.stdout, logs))
            results[-1]["out_dir"] = None
        return results
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _ddp_result(scenario: str, out: Path, nproc: int, stdout: str, stderr: str) -> dict:
    """The merged record of one DDP job (see :func:`run_ddp`)."""
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
    r0 = ranks[0]
    n_steps = {len(r["steps"]) for r in ranks}
    if len(n_steps) != 1:
        raise RuntimeError(f"ranks recorded different numbers of optimizer steps: {n_steps}")
    steps = []
    for k in range(n_steps.pop()):
        per_rank = [r["steps"][k]["idx_batches"] for r in ranks]
        g0 = r0["steps"][k]["grads"]
        diff = 0.0
        for r in ranks[1:]:
            gr = r["steps"][k]["grads"]
            diff = max(diff, max(float((gr[n] - g0[n]).abs().max()) for n in g0))
        steps.append(dict(
            idx_batches=[b for pr in per_rank for b in pr],
            idx_batches_per_rank=per_rank,
            grads=g0,
            local_losses=[r["steps"][k]["local_loss"] for r in ranks],
            local_loss=sum(r["steps"][k]["local_loss"] for r in ranks) / len(ranks),  # = what the Trainer logs
            rank_grad_max_diff=diff,
        ))
    return dict(
        scenario=scenario,
        meta=r0["meta"],
        samples=r0["samples"],
        initial_state=r0["initial_state"],
        ranks=ranks,
        steps=steps,
        logged_losses=r0["logged_losses"],
        out_dir=str(out),
        stdout=stdout,
        stderr=stderr,
    )


class PluginMissing(RuntimeError):
    """``--patch`` was requested but ``hf_gradfix`` (or its ``patch()``) is not importable yet."""


def check_ddp_against_gt(result: dict, model_or_builder=None, **kw) -> list[dict]:
    """GT comparison of a :func:`run_ddp` result: window k = union of every rank's k-th window.

    ``model_or_builder`` defaults to rebuilding the scenario's model in this process (via the worker's registry) and
    loading rank 0's initial state.  ``kw`` go to :func:`compare_steps` (``use_aux``, ``aux_scale``, ...).
    Returns :func:`compare_steps` rows (``local_loss`` there is the mean over ranks = what the Trainer logs).
    """
    meta = result["meta"]
    if model_or_builder is None:
        import ddp_worker  # tests/support is on sys.path under pytest (rootdir conftest-less: add it if needed)

        model_or_builder = lambda: ddp_worker.build_scenario(result["scenario"], meta["args"])["model"]  # noqa: E731
    return compare_steps(model_or_builder, result["samples"], meta["task"], result["steps"], result["logged_losses"],
                         initial_state=result["initial_state"],
                         logged_loss_decimals=meta.get("logged_loss_decimals"), **kw)


if str(TESTS_DIR) not in sys.path:  # so `import ddp_worker` works from tests importing this module
    sys.path.insert(0, str(TESTS_DIR))


def make_trainer(model: nn.Module, samples: Sequence[dict], task: str, *, trainer_cls=None, extra_args: dict | None = None,
                 callbacks: Sequence = (), output_dir: str | os.PathLike | None = None):
    """A trainer over ``samples`` with the harness's arguments (for evaluation tests; nothing is recorded)."""
    import transformers

    args = dict(output_dir=str(output_dir or tempfile.mkdtemp(prefix="hgf_eval_")), report_to="none", use_cpu=True,
                dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, save_strategy="no")
    args.update(extra_args or {})
    return (trainer_cls or transformers.Trainer)(
        model=model, args=transformers.TrainingArguments(**args), train_dataset=ListDataset(samples),
        data_collator=RecordingCollator(task, pad_id_of(model)), callbacks=list(callbacks))


class GradCapture:
    """A TrainerCallback (duck-typed, so the harness needs no transformers import) keeping a clone of every
    parameter's gradient at each ``on_pre_optimizer_step`` (after accumulation and the DDP all-reduce)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def __getattr__(self, name):  # every other callback event: do nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``{"input_ids", "labels"}`` samples (the ``idx`` bookkeeping key dropped)."""

    def __init__(self, samples: Sequence[dict]):
        self.samples = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]
