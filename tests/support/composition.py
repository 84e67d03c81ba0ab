"""The composition matrix (``tests/trainer/test_composition_matrix.py``, issue 50): every opt-in setting crossed pairwise with
the others, the head families and the trainers, each cell trained for real and held to an independent ground truth.

Why: every capability passed its own checks, yet two of them together trained the wrong objective without a word
(TRL's packing re-packed by the plugin's; the lean head on a masked LM). A cell of this matrix is one training run
(transformers' or TRL's own trainer, collator and ``datasets`` object, a tiny random-init model, GA 2, 2 optimizer
steps, AdamW at a learning rate that moves the weights), and its verdict is one of

* **exact**: at every optimizer step the accumulated gradient is within :data:`GRAD_TOL` (relative) of the ground
  truth computed here, in float64, one process, on the micro-batches the trainer trained on, at the weights that
  window started from;
* **stock**: not exact, but every step's gradient equals the stock run's (no hf_gradfix) within :data:`STOCK_TOL`,
  and hf_gradfix said so in exactly one warning;
* **refused**: ``train()`` (or the trainer's construction) stopped before any optimizer step with one line from
  hf_gradfix;

and anything else is a failure: a silent difference from the ground truth, several warnings for one fallback, a
crash or a multi-line error, a run that stock trains and the patched run cannot finish.

The ground truth knows nothing of the plugin: documents are found by their content (every sample starts with
``[BOS]``, a token no sample contains elsewhere; a document ends at the next ``[BOS]`` or at the first ``[PAD]``), so
a row the plugin (or TRL) packed, padded or flattened is cut into its documents and each runs alone with the model's
default positions. Each head's objective is written here from its definition: causal (next-token CE), masked and
token classification (CE per labelled position), seq2seq (CE of the decoder against its labels), sequence
classification (CE per row), transformers' label smoothing, the MoE router loss by the declared convention
(``docs/moe.md``), and the policy-gradient objective of ``tests/support/rl_reference.py``.

Pairwise covering (:func:`covering_rows`): every pair of values of two factors appears in at least one cell, not the
full product (which would be ~1e6 runs). Pairs that cannot be built (:func:`unbuildable`: TRL's packing outside
TRL's SFTTrainer, ...) are listed with their reason; pairs that make hf_gradfix refuse a run by design
(:data:`SOLO_PAIRS`: a setting that does nothing in that combination) get a cell of their own with every other factor
at its default, so that a refusal never hides the other settings of a covering row.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import ecosystem as E
import harness as H
from hf_gradfix.config import ENV_VAR

GRAD_TOL = 1e-5  # exact: relative gradient error against the ground truth, per optimizer step
STOCK_TOL = 1e-6  # stock: relative difference from the stock run's gradient, per optimizer step
WEIGHT_TOL = 1e-6  # lowrank_grads: relative weight difference from the same cell with full gradients
LEARNING_RATE = 1e-2  # AdamW at this rate moves every weight: the second window's truth is at moved weights
N_SAMPLES = 16
TOKEN_BUDGET = 48  # packed row length (plugin and TRL packing); the longest sample has 31 tokens
DOC_START, PAD = H.BOS_ID, H.PAD_ID
LABEL_SMOOTHING = 0.1

#: the factors and their levels; the first level of each is its default (off)
FACTORS: dict[str, tuple] = {
    "trainer": ("Trainer", "SFTTrainer", "GRPOTrainer"),
    "head": ("causal", "masked", "seq2seq", "tokcls", "seqcls"),
    # the plugin's packing: a map-style dataset (varlen mode), the same in rows mode, or a stream (IterableDataset)
    "packing": ("off", "map", "rows", "stream"),
    "trl_packing": ("off", "bfd", "padding_free"),  # TRL's own: SFTConfig(packing=True) / SFTConfig(padding_free=True)
    "lean": (False, True),  # loss.head: lean
    "balance": ("tokens", "compute"),  # packing.balance
    "aux": ("off", "micro", "global", "none"),  # a MoE model, its router loss under loss.aux_loss (off: a dense model)
    "rl_forwards": (False, True),  # packing.rl_forwards
    "optimizer": ("adamw", "galore", "apollo"),  # the Trainer's AdamW, or optimizer.name galore_adamw / apollo_adamw
    "lowrank_grads": (False, True),  # optimizer.lowrank_grads
    "label_smoothing": (0.0, LABEL_SMOOTHING),  # TrainingArguments.label_smoothing_factor
    "grad_ckpt": (False, True),  # TrainingArguments.gradient_checkpointing
    "peft": (False, True),  # a PEFT LoRA model
    # how the settings reach the trainer: hf_gradfix.patch(settings) before it is built, the YAML file named by
    # $HF_GRADFIX_CONFIG with patch(), GradFixCallback(settings) passed to the constructor, or added to the built
    # trainer (add_callback: too late for the data loader and the optimizer, refused for those by design)
    "way": ("patch", "config", "callback", "add_callback"),
}
DEFAULTS = {factor: levels[0] for factor, levels in FACTORS.items()}
TRL_TRAINERS = ("SFTTrainer", "GRPOTrainer")


def unbuildable(a: tuple[str, Any], b: tuple[str, Any]) -> str | None:
    """Why no run can hold both ``(factor, value)`` pairs, or None."""
    pair = dict((a, b))
    trainer, head = pair.get("trainer"), pair.get("head")
    if trainer in TRL_TRAINERS and head not in (None, "causal"):
        return f"TRL's {trainer} trains causal LMs only"
    if pair.get("trl_packing", "off") != "off" and trainer not in (None, "SFTTrainer"):
        return "packing / padding_free are settings of TRL's SFTConfig (SFTTrainer)"
    if pair.get("trl_packing", "off") != "off" and head not in (None, "causal"):
        return "TRL's packing belongs to SFTTrainer, which trains causal LMs only"
    if pair.get("aux", "off") != "off" and head in ("masked", "seq2seq"):
        return "no mixture-of-experts model with a masked-LM or seq2seq head among transformers' families here"
    if pair.get("rl_forwards") and head not in (None, "causal"):
        return "packing.rl_forwards packs policy forwards of TRL's RL trainers, which train causal LMs only"
    return None


#: pairs that make hf_gradfix refuse the run by design (a setting that does nothing in that combination): each gets a
#: cell of its own, the other factors at their defaults (in a covering row the refusal would hide the rest of the row)
SOLO_PAIRS: dict[frozenset, str] = {
    frozenset({("balance", "compute"), ("packing", "off")}): "packing.balance with packing off",
    frozenset({("lowrank_grads", True), ("optimizer", "adamw")}): "optimizer.lowrank_grads without GaLore",
    frozenset({("lowrank_grads", True), ("optimizer", "apollo")}): "optimizer.lowrank_grads is GaLore-only",
    frozenset({("rl_forwards", True), ("trainer", "Trainer")}): "packing.rl_forwards on a plain Trainer",
    frozenset({("rl_forwards", True), ("trainer", "SFTTrainer")}): "packing.rl_forwards on SFTTrainer",
    frozenset({("aux", "global"), ("head", "tokcls")}): "aux_loss: global on a head that adds no router loss",
    frozenset({("aux", "global"), ("head", "seqcls")}): "aux_loss: global on a head that adds no router loss",
    frozenset({("optimizer", "galore"), ("peft", True)}): "a low-rank optimizer on a LoRA model (adapters only)",
    frozenset({("optimizer", "apollo"), ("peft", True)}): "a low-rank optimizer on a LoRA model (adapters only)",
    frozenset({("packing", "map"), ("head", "seq2seq")}): "packing an encoder-decoder's samples",
    frozenset({("packing", "rows"), ("head", "seq2seq")}): "packing an encoder-decoder's samples",
    frozenset({("packing", "rows"), ("head", "seqcls")}): "packing samples with one label each",
    frozenset({("packing", "rows"), ("trainer", "GRPOTrainer")}): "packing.enabled on an RL trainer's prompts",
    **{frozenset({("way", "add_callback"), ("packing", p)}): "GradFixCallback added after the data loader was built"
       for p in ("map", "rows", "stream")},
    **{frozenset({("way", "add_callback"), ("optimizer", o)}): "GradFixCallback added after the optimizer was built"
       for o in ("galore", "apollo")},
    frozenset({("aux", "none"), ("head", "tokcls")}): "aux_loss: none on a head that adds no router loss",
    frozenset({("aux", "none"), ("head", "seqcls")}): "aux_loss: none on a head that adds no router loss",
    frozenset({("aux", "none"), ("trainer", "GRPOTrainer")}): "aux_loss: none on an RL trainer (TRL's micro term)",
    frozenset({("packing", "stream"), ("head", "seq2seq")}): "packing an encoder-decoder's samples",
    frozenset({("packing", "map"), ("head", "seqcls")}): "packing samples with one label each",
    frozenset({("packing", "stream"), ("head", "seqcls")}): "packing samples with one label each",
    frozenset({("aux", "global"), ("trainer", "GRPOTrainer")}): "aux_loss: global on an RL trainer (TRL's micro term)",
    frozenset({("packing", "map"), ("trainer", "GRPOTrainer")}): "packing.enabled on an RL trainer's prompts",
    frozenset({("packing", "stream"), ("trainer", "GRPOTrainer")}): "packing.enabled on an RL trainer's prompts",
}


def solo_reason(a: tuple[str, Any], b: tuple[str, Any]) -> str | None:
    return SOLO_PAIRS.get(frozenset({a, b}))


# ----------------------------------------------------------------------------------------------------------------------
# Pairwise covering
# ----------------------------------------------------------------------------------------------------------------------


def all_pairs() -> list[tuple[tuple[str, Any], tuple[str, Any]]]:
    names = list(FACTORS)
    out = []
    for i, f in enumerate(names):
        for g in names[i + 1:]:
            for v in FACTORS[f]:
                for w in FACTORS[g]:
                    out.append(((f, v), (g, w)))
    return out


def _allowed(a, b) -> bool:
    return unbuildable(a, b) is None and solo_reason(a, b) is None


def _row_pairs(row: Mapping[str, Any]):
    items = list(row.items())
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            yield (a, b) if list(FACTORS).index(a[0]) < list(FACTORS).index(b[0]) else (b, a)


def _why_impossible(pair) -> str:
    """The factor none of whose values goes with both settings of ``pair``, and why."""
    for f, levels in FACTORS.items():
        if f in (pair[0][0], pair[1][0]):
            continue
        if not any(_allowed((f, v), pair[0]) and _allowed((f, v), pair[1]) for v in levels):
            why = {unbuildable((f, v), p) or solo_reason((f, v), p) for v in levels for p in pair
                   if not _allowed((f, v), p)}
            return f"no value of {f} goes with both: " + "; ".join(sorted(why))
    return "no allowed row holds it"


def covering_rows() -> tuple[list[dict[str, Any]], dict[tuple, str]]:
    """(rows, pairs no allowed row can hold: pair -> reason). Greedy and deterministic (AETG's idea): each row starts
    from the first pair not yet covered and takes, factor by factor, the value that covers the most pairs not yet
    covered, among those that keep every pair of the row allowed."""
    names = list(FACTORS)
    uncovered = {p for p in all_pairs() if _allowed(*p)}
    impossible: dict[tuple, str] = {}
    rows: list[dict[str, Any]] = []
    while uncovered:
        seed = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), str(p)))
        row = {seed[0][0]: seed[0][1], seed[1][0]: seed[1][1]}
        for f in names:
            if f in row:
                continue
            best, best_gain = None, -1
            for v in FACTORS[f]:
                if not all(_allowed((f, v), (g, w)) for g, w in row.items()):
                    continue
                gain = sum(1 for g, w in row.items()
                           if (((f, v), (g, w)) if names.index(f) < names.index(g) else ((g, w), (f, v))) in uncovered)
                if gain > best_gain:
                    best, best_gain = v, gain
            if best is None:
                break
            row[f] = best
        if len(row) < len(names):  # the seed pair cannot be completed into an allowed row
            impossible[seed] = _why_impossible(seed)
            uncovered.discard(seed)
            continue
        row = {f: row[f] for f in names}
        rows.append(row)
        uncovered -= set(_row_pairs(row))
    return rows, impossible


def solo_rows() -> list[dict[str, Any]]:
    rows = []
    for pair in SOLO_PAIRS:
        row = dict(DEFAULTS)
        row.update(dict(pair))
        rows.append(row)
    return rows


def cell_id(row: Mapping[str, Any]) -> str:
    """The non-default settings of a cell, e.g. ``Trainer-masked-lean``."""
    parts = [str(row["trainer"]), str(row["head"])]
    for f, v in row.items():
        if f in ("trainer", "head") or v == DEFAULTS[f]:
            continue
        parts.append(f if v is True else f"{f}={v}")
    return "-".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# Building a cell
# ----------------------------------------------------------------------------------------------------------------------


def plugin_config(row: Mapping[str, Any]) -> dict:
    """The hf_gradfix configuration of the cell's settings (what a user would write)."""
    loss: dict[str, Any] = {}
    if row["lean"]:
        loss["head"] = "lean"
    if row["aux"] in ("global", "none"):
        loss["aux_loss"] = row["aux"]
    packing: dict[str, Any] = {}
    if row["packing"] != "off":
        packing.update(enabled=True, token_budget=TOKEN_BUDGET)
    if row["packing"] == "rows":
        packing["mode"] = "rows"
    if row["balance"] != "tokens":
        packing["balance"] = row["balance"]
    if row["rl_forwards"]:
        packing["rl_forwards"] = True
    optimizer: dict[str, Any] = {}
    if row["optimizer"] != "adamw":
        optimizer.update(name={"galore": "galore_adamw", "apollo": "apollo_adamw"}[row["optimizer"]], rank=4)
    if row["lowrank_grads"]:
        optimizer["lowrank_grads"] = True
    config: dict[str, Any] = {"log_fixes": False}
    for key, section in (("loss", loss), ("packing", packing), ("optimizer", optimizer)):
        if section:
            config[key] = section
    return config


@functools.lru_cache(maxsize=None)
def tokenizer():
    return E.build_tokenizer()


def _task(head: str) -> str:
    return {"causal": "causal", "masked": "mlm", "seq2seq": "seq2seq", "tokcls": "tokcls", "seqcls": "seqcls"}[head]


def build_model(row: Mapping[str, Any], seed: int = 0):
    """The tiny model of the cell's head (a MoE one where ``aux`` is on), LoRA on it where ``peft`` is on."""
    import transformers as tf

    head, moe = row["head"], row["aux"] != "off"
    arch = {"causal": "llama", "seq2seq": "t5", "tokcls": "llama_tokcls", "seqcls": "llama_seqcls"}.get(head)
    if head == "masked":
        # ModernBERT: its masked-LM loss goes through loss_function (unshifted), what the lean head must measure; BERT
        # computes it inline (the lean head keeps the stock head there, said once: tests/loss/test_lean_head.py)
        cfg = tf.ModernBertConfig(
            vocab_size=H.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=128, local_attention=16, global_attn_every_n_layers=2, embedding_dropout=0.0,
            attention_dropout=0.0, mlp_dropout=0.0, classifier_dropout=0.0, reference_compile=False,
            pad_token_id=H.PAD_ID, bos_token_id=H.BOS_ID, eos_token_id=H.EOS_ID, cls_token_id=5, sep_token_id=6,
        )
        torch.manual_seed(seed)
        model = tf.ModernBertForMaskedLM._from_config(cfg, attn_implementation="eager").float()
        model._hgf_task = "mlm"
    elif moe:
        cfg = tf.Qwen3MoeConfig(
            **{k: v for k, v in H._DECODER.items() if k != "intermediate_size"}, intermediate_size=64,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, head_dim=16,
            router_aux_loss_coef=0.3, output_router_logits=True, num_labels=H.DEFAULT_NUM_LABELS.get(_task(head), 2),
            classifier_dropout=0.0,  # the generic classification heads fall back to dropout 0.1 otherwise
        )
        cls = {"causal": tf.Qwen3MoeForCausalLM, "tokcls": tf.Qwen3MoeForTokenClassification,
               "seqcls": tf.Qwen3MoeForSequenceClassification}[head]
        torch.manual_seed(seed)
        model = cls._from_config(cfg, attn_implementation="eager").float()
        model._hgf_task = _task(head)
    else:
        model = H.build_model(arch, seed=seed)
    if row["peft"]:
        import peft

        targets = {"masked": ["Wqkv"], "seq2seq": ["q", "v"]}.get(head, ["q_proj", "v_proj"])
        task_type = {"causal": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM", "tokcls": "TOKEN_CLS",
                     "seqcls": "SEQ_CLS"}.get(head)
        torch.manual_seed(seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=targets, task_type=task_type))
        with torch.no_grad():  # LoRA's B starts at zero (A's gradient would be zero): give it a value
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    return model


def samples(head: str) -> list[dict]:
    """:data:`N_SAMPLES` samples of 3-30 tokens, each starting with ``[BOS]`` (the ground truth's document marker; no
    other token of a sample is ``[BOS]`` or ``[PAD]``). Masked-LM samples are plain token ids: transformers' MLM
    collator masks them."""
    task = _task(head)
    out = []
    for s in H.make_samples("causal" if task == "mlm" else task, n=N_SAMPLES, lo=3, hi=30, seed=3):
        s = {k: v for k, v in s.items() if k != "idx"}
        s["input_ids"] = [DOC_START] + s["input_ids"]
        if task == "tokcls":
            s["labels"] = [H.IGNORE_INDEX] + s["labels"]
        if task in ("causal", "mlm"):
            s.pop("labels")  # transformers' DataCollatorForLanguageModeling makes them
        out.append(s)
    return out


def texts() -> list[str]:
    """The SFT / causal texts: ``[BOS] w.. w..`` (TRL appends ``[EOS]``)."""
    return ["[BOS] " + t for t in E.sentences(N_SAMPLES, seed=31, lo=3, hi=30)]


def _collator(head: str, model):
    import transformers as tf

    tok = tokenizer()
    if head == "causal":
        return tf.DataCollatorForLanguageModeling(tok, mlm=False)
    if head == "masked":  # every chosen position becomes [MASK] (a random replacement could draw [BOS])
        return tf.DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3, mask_replace_prob=1.0,
                                                  random_replace_prob=0.0, seed=0)
    if head == "seq2seq":
        return tf.DataCollatorForSeq2Seq(tok, model=model)
    if head == "tokcls":
        return tf.DataCollatorForTokenClassification(tok)
    return tf.DataCollatorWithPadding(tok)


def _args_overrides(row: Mapping[str, Any]) -> dict:
    out = dict(optim="adamw_torch", learning_rate=LEARNING_RATE, max_steps=2, gradient_accumulation_steps=2,
               per_device_train_batch_size=2)
    if row["label_smoothing"]:
        out["label_smoothing_factor"] = row["label_smoothing"]
    if row["grad_ckpt"]:
        out["gradient_checkpointing"] = True
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return out


def make_trainer(row: Mapping[str, Any], output_dir: str, callbacks: list | None = None):
    """The cell's trainer, as a user builds it (the plugin's settings come from ``patch()``, a file, or
    ``callbacks``)."""
    import datasets
    import transformers as tf

    trainer, head = row["trainer"], row["head"]
    model = build_model(row)
    overrides = _args_overrides(row)
    if trainer == "Trainer":
        if head == "causal":
            tok = tokenizer()
            data = datasets.Dataset.from_dict({"text": texts()}).map(
                lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        else:
            data = datasets.Dataset.from_list(samples(head))
        if row["packing"] == "stream":
            data = data.to_iterable_dataset()
        args_cls = tf.Seq2SeqTrainingArguments if head == "seq2seq" else tf.TrainingArguments
        cls = tf.Seq2SeqTrainer if head == "seq2seq" else tf.Trainer
        return cls(model=model, args=E.training_args(output_dir, args_cls=args_cls, **overrides), train_dataset=data,
                   data_collator=_collator(head, model), processing_class=tokenizer(), callbacks=callbacks)
    import trl

    if trainer == "SFTTrainer":
        data = datasets.Dataset.from_dict({"text": texts()})
        if row["packing"] == "stream":
            data = data.to_iterable_dataset()
        sft = dict(dataset_text_field="text", max_length=None, dataset_num_proc=None)
        if row["trl_packing"] == "bfd":
            sft.update(packing=True, max_length=TOKEN_BUDGET)
        elif row["trl_packing"] == "padding_free":
            sft.update(padding_free=True)
        args = E.training_args(output_dir, args_cls=trl.SFTConfig, bf16=False, **sft, **overrides)
        return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(),
                              callbacks=callbacks)
    import trainer_matrix as M

    cfg = M.training_args(trl.GRPOConfig, output_dir, **overrides)
    return trl.GRPOTrainer(model=model, args=cfg, train_dataset=M.dataset("prompt"), processing_class=tokenizer(),
                           reward_funcs=M.reward_parity, callbacks=callbacks)


# ----------------------------------------------------------------------------------------------------------------------
# Running a cell
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: per optimizer step k, the weights its window started from (``starts[k]``), the micro-batches
    as trained on (``windows[k]``), the accumulated gradient (``grads[k]``) and the weights after the step."""

    mode: str
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    windows: list[list[Any]] = field(default_factory=list)
    starts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    after: list[dict[str, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None
    warnings: list[str] = field(default_factory=list)  # hf_gradfix's, from its logger and Python warnings
    trainer: Any = None
    seconds: float = 0.0


def _write_config(settings: Mapping[str, Any], folder: str) -> str:
    """The settings as a user's YAML file (the ``hf_gradfix:`` section)."""
    import yaml

    path = f"{folder}/hf_gradfix.yaml"
    with open(path, "w") as f:
        yaml.safe_dump({"hf_gradfix": dict(settings)}, f)
    return path


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def is_plugin_warning(message: warnings.WarningMessage) -> bool:
    return "hf_gradfix" in str(message.message)[:40] or message.filename.replace("\\", "/").find("/hf_gradfix/") >= 0


def run(row: Mapping[str, Any], mode: str, *, patch_config: dict | None = None) -> Run:
    """Train the cell stock (``mode="stock"``: the settings stock has, none of the plugin's) or patched (``"patch"``:
    built under ``hf_gradfix.patch(plugin_config(row))``)."""
    import hf_gradfix
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trainer_matrix as M

    started = time.perf_counter()
    result = Run(mode)
    gc.freeze()  # see trainer_matrix.run: the collector's walks of the imported modules cost more than the run
    records = M._Records()
    logger = logging.getLogger("hf_gradfix")
    logger.addHandler(records)
    output_dir = tempfile.mkdtemp(prefix="hgf_composition_")
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            settings = patch_config if patch_config is not None else plugin_config(row)
            way = row.get("way", "patch") if mode == "patch" else None
            try:  # a configuration refused here is a refusal before any step
                if way == "patch":
                    hf_gradfix.patch(settings)
                elif way == "config":
                    config_file = _write_config(settings, output_dir)
                    os.environ[ENV_VAR] = config_file
                    hf_gradfix.patch()
                callbacks = [hf_gradfix.GradFixCallback(settings)] if way == "callback" else None
                trainer = make_trainer(row, output_dir, callbacks=callbacks)
                if way == "add_callback":
                    trainer.add_callback(hf_gradfix.GradFixCallback(settings))
            except Exception as err:  # noqa: BLE001 (a refusal at construction: the verdict reads it)
                result.error = err
                return result
            finally:
                if way in ("patch", "config"):
                    hf_gradfix.unpatch()
                os.environ.pop(ENV_VAR, None)
            result.trainer = trainer
            trainer.remove_callback(PrinterCallback)
            window: list[Any] = []

            def compute_loss(model, inputs, *args, **kwargs):
                if model.training:
                    window.append(M._clone(inputs))
                # the class's method at call time: GradFixCallback added late swaps the class at on_train_begin
                return type(trainer).compute_loss(trainer, model, inputs, *args, **kwargs)

            trainer.compute_loss = compute_loss
            model = trainer.model

            class Record(TrainerCallback):
                def on_pre_optimizer_step(self, args, state, control, **kwargs):
                    result.grads.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                         for n, p in model.named_parameters() if p.requires_grad})
                    result.windows.append(list(window))
                    window.clear()

                def on_step_end(self, args, state, control, **kwargs):
                    result.after.append(_params(model))

            trainer.add_callback(Record())
            result.starts.append(_params(model))
            try:
                trainer.train()
            except Exception as err:  # noqa: BLE001 (the verdict reads it)
                result.error = err
            result.starts.extend(result.after[:-1])
    finally:
        gc.unfreeze()
        logger.removeHandler(records)
        shutil.rmtree(output_dir, ignore_errors=True)
        result.warnings = [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
        result.warnings += [str(w.message) for w in caught if is_plugin_warning(w)]
        result.seconds = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------------------------------------------------
# Ground truth (float64, one process, from the definitions; nothing of hf_gradfix)
# ----------------------------------------------------------------------------------------------------------------------


def documents(batch: Mapping) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of a recorded batch, found by content: a document starts at ``[BOS]``
    and ends before the next ``[BOS]``, the first ``[PAD]``, a masked-out position or the row's end."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    out = []
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        valid = mask[r].tolist() if torch.is_tensor(mask) and mask.dim() == 2 else [1] * len(row)
        starts = [i for i, t in enumerate(row) if t == DOC_START and valid[i]]
        for k, s in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else len(row)
            for i in range(s + 1, end):
                if row[i] == PAD or not valid[i]:
                    end = i
                    break
            out.append((r, s, end))
    return out


def _float64_copy(model, weights: Mapping[str, torch.Tensor]):
    ref = copy.deepcopy(model)
    for module in ref.modules():  # a forward patched on the instance (TRL's fused head) is bound to the original
        module.__dict__.pop("forward", None)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(weights[n])
    ref = ref.double().train()
    for config in {id(m.config): m.config for m in ref.modules() if hasattr(m, "config")}.values():
        if hasattr(config, "_experts_implementation"):  # torch's grouped GEMM has no float64
            config._experts_implementation = "eager"
    disable = getattr(ref, "gradient_checkpointing_disable", None)
    if callable(disable) and getattr(ref, "is_gradient_checkpointing", False):
        disable()
    return ref


def _ce_terms(logits: torch.Tensor, targets: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(NLL sum, smoothing sum: -log p summed over the vocabulary, count) of the labelled positions."""
    logp = F.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
    t = targets.reshape(-1)
    keep = t.ne(H.IGNORE_INDEX)
    nll = -logp[keep].gather(-1, t[keep].unsqueeze(-1)).sum()
    smooth = -logp[keep].sum() if eps else logp.new_zeros(())
    return nll, smooth, int(keep.sum())


def _router_rows(router_logits, top_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(per-expert top-k selection counts, per-expert probability sums, rows) of one forward's router logits."""
    counts, probs, rows = 0.0, 0.0, 0
    for gate in router_logits:
        p = torch.softmax(gate.reshape(-1, gate.shape[-1]), dim=-1)
        sel = torch.topk(p, top_k, dim=-1).indices
        counts = counts + F.one_hot(sel, p.shape[-1]).sum(dim=(0, 1)).double()
        probs = probs + p.sum(0)
        rows += p.shape[0]
    return counts, probs, rows


def window_truth(model, weights, window: list[Mapping], row: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The gradient of the window's objective at ``weights`` (float64)."""
    ref = _float64_copy(model, weights)
    head, eps = row["head"], float(row["label_smoothing"])
    moe = row["aux"] in ("micro", "global") and head == "causal"  # aux_loss: none trains no router term
    nll, smooth, count, vocab = 0.0, 0.0, 0, None
    router_terms = []
    for mb in window:
        mb_router = []
        if head in ("causal", "masked", "tokcls"):
            for r, s, e in documents(mb):
                ids = mb["input_ids"][r:r + 1, s:e]
                out = ref(input_ids=ids, output_router_logits=True) if moe else ref(input_ids=ids)
                logits = out.logits
                labels = mb["labels"][r:r + 1, s:e]
                if torch.is_tensor(mb.get("shift_labels")):
                    targets = mb["shift_labels"][r:r + 1, s:e]
                elif head == "causal":
                    logits, targets = logits[:, :-1], labels[:, 1:]
                else:
                    targets = labels
                a, b, c = _ce_terms(logits, targets, eps)
                nll, smooth, count, vocab = nll + a, smooth + b, count + c, logits.shape[-1]
                if moe:
                    mb_router.append(_router_rows(out.router_logits, ref.config.num_experts_per_tok))
        elif head == "seqcls":
            for r in range(mb["input_ids"].shape[0]):
                keep = mb["attention_mask"][r].bool()
                logits = ref(input_ids=mb["input_ids"][r:r + 1][:, keep]).logits
                a, b, c = _ce_terms(logits, mb["labels"][r:r + 1], eps)
                nll, smooth, count, vocab = nll + a, smooth + b, count + c, logits.shape[-1]
        else:  # seq2seq: each row alone, the decoder against its labels
            for r in range(mb["input_ids"].shape[0]):
                keep = mb["attention_mask"][r].bool()
                labels = mb["labels"][r:r + 1]
                labels = labels[:, :int(labels.ne(H.IGNORE_INDEX).nonzero().max()) + 1]
                logits = ref(input_ids=mb["input_ids"][r:r + 1][:, keep],
                             decoder_input_ids=H._decoder_input_ids(ref, labels)).logits
                a, b, c = _ce_terms(logits, labels, eps)
                nll, smooth, count, vocab = nll + a, smooth + b, count + c, logits.shape[-1]
        if mb_router:
            router_terms.append(tuple(sum(t[i] for t in mb_router) for i in range(3)))
    loss = (1 - eps) * nll / count + (eps * smooth / (count * vocab) if eps else 0.0)
    if router_terms:
        experts, coef = router_terms[0][0].numel(), float(ref.config.router_aux_loss_coef)
        if row["aux"] == "global":
            c, p, n = (sum(t[i] for t in router_terms) for i in range(3))
            lb = experts * (c / n * p / n).sum()
        else:
            lb = torch.stack([experts * (c / n * p / n).sum() for c, p, n in router_terms]).mean()
        loss = loss + coef * lb
    loss.backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in ref.named_parameters() if p.requires_grad}


def rl_truth(trainer, weights, window, row) -> dict[str, torch.Tensor]:
    """The policy-gradient objective of ``tests/support/rl_reference.py`` over the window (float64), plus, on a MoE model, TRL's
    router term: the mean over micro-batches of each forward's load-balancing loss over its real tokens."""
    import rl_reference

    fresh = copy.deepcopy(trainer.model)
    for module in fresh.modules():  # TRL fused its log-prob head into the trained model's forward (bound to it)
        module.__dict__.pop("forward", None)
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(weights[n])
    for config in {id(m.config): m.config for m in fresh.modules() if hasattr(m, "config")}.values():
        # sdpa: the plugin's packing attention is unregistered once unpatched, and eager attention in float64 turns
        # a left-padded prompt's fully masked rows into NaN, which the backward spreads to the weights
        config._attn_implementation = "sdpa"
        if hasattr(config, "_experts_implementation"):  # the reference runs in float64: no grouped GEMM there
            config._experts_implementation = "eager"
    fresh = fresh.double().train()
    state = getattr(trainer, "_hgf_state", None)
    loss_type = getattr(getattr(state, "rl", None), "loss_type", None) or trainer.loss_type
    coef = float(trainer.entropy_coef) if getattr(trainer, "_entropy_bonus_enabled", False) else 0.0
    loss = rl_reference.window_objective(fresh, window, loss_type, rl_reference.trl_config(trainer), entropy_coef=coef)
    if row["aux"] != "off" and getattr(trainer, "aux_loss_enabled", False):
        lbs = []
        for mb in window:
            ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
            mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
            out = fresh(input_ids=ids, attention_mask=mask, output_router_logits=True)
            keep = mask.reshape(-1).bool()
            c, p, n = _router_rows([g[keep] for g in out.router_logits], fresh.config.num_experts_per_tok)
            lbs.append(c.numel() * (c / n * p / n).sum())
        loss = loss + float(trainer.router_aux_loss_coef) * torch.stack(lbs).mean()
    loss.backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in fresh.named_parameters() if p.requires_grad}


def truth_errors(result: Run, row: Mapping[str, Any]) -> list[float]:
    errors = []
    for k, (got, window) in enumerate(zip(result.grads, result.windows)):
        if row["trainer"] == "GRPOTrainer":
            want = rl_truth(result.trainer, result.starts[k], window, row)
        else:
            want = window_truth(result.trainer.model, result.starts[k], window, row)
        errors.append(H.rel_err(got, want))
    return errors


# ----------------------------------------------------------------------------------------------------------------------
# The verdict
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    row: dict
    kind: str  # "exact" | "stock" | "refused" | "FAIL"
    detail: str
    warnings: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.kind != "FAIL"


def _one_line(err: BaseException) -> str | None:
    """The error as one line from hf_gradfix, or None when it is not that (a traceback of someone's code, several
    lines, an exception that does not come from hf_gradfix)."""
    from hf_gradfix.errors import HfGradfixError

    text = str(err).strip()
    if not isinstance(err, HfGradfixError) and not text.startswith("hf_gradfix"):
        return None
    return text if text and "\n" not in text else None


def _rel(a: dict, b: dict) -> float:
    return H.rel_err(a, b) if any(float(v.abs().max()) > 0 for v in b.values()) else 0.0


def judge(row: Mapping[str, Any]) -> Verdict:
    """Run the cell patched (and stock where the verdict needs it) and classify it."""
    row = dict(row)
    patched = run(row, "patch")
    seconds = patched.seconds
    warned = patched.warnings

    def verdict(kind, detail):
        return Verdict(row, kind, detail, warned, seconds)

    if patched.error is not None and not patched.grads:
        line = _one_line(patched.error)
        if line is not None:
            return verdict("refused", line)
        stock = run(row, "stock")
        seconds += stock.seconds
        what = f"{type(patched.error).__name__}: {str(patched.error)[:300]}"
        if stock.error is not None and not stock.grads:
            return verdict("refused", f"stock fails too ({type(stock.error).__name__}); patched: {what}")
        return verdict("FAIL", f"stock trains, the patched run raised {what}")
    if patched.error is not None:
        return verdict("FAIL", f"raised after {len(patched.grads)} step(s): {type(patched.error).__name__}: "
                               f"{str(patched.error)[:300]}")
    if len(patched.grads) != 2:
        return verdict("FAIL", f"{len(patched.grads)} optimizer steps, not 2")
    if row["lowrank_grads"]:
        judged = _judge_lowrank(row, patched, seconds)
        return _said(judged, patched)
    errors = truth_errors(patched, row)
    if max(errors) <= GRAD_TOL:
        return _said(verdict("exact", f"max relative gradient error {max(errors):.1e}"), patched)
    stock = run(row, "stock")
    seconds += stock.seconds
    if stock.error is not None or len(stock.grads) != len(patched.grads):
        return verdict("FAIL", f"not exact ({max(errors):.1e}) and stock did not train alike "
                               f"({type(stock.error).__name__ if stock.error else len(stock.grads)})")
    # weights move by the optimizer: where the plugin's optimizer replaced AdamW only the first step can equal stock
    steps = 1 if row["optimizer"] != "adamw" else len(stock.grads)
    diffs = [_rel(p, s) for p, s in zip(patched.grads[:steps], stock.grads[:steps])]
    if max(diffs) <= STOCK_TOL and len(warned) == 1:
        return _said(verdict("stock", f"equal to stock ({max(diffs):.1e}), not exact ({max(errors):.1e}): "
                                      f"{warned[0]}"), patched)
    return verdict("FAIL", f"silently wrong: relative gradient error {max(errors):.1e} against the ground truth, "
                           f"{max(diffs):.1e} from stock, {len(warned)} hf_gradfix warning(s) {warned[:3]}")


#: how a warning names each opt-in setting (lower case): a setting not in force must be named by one
SETTING_WORDS = {"packing": "pack", "lean": "lean", "balance": "balance", "aux": "aux_loss",
                 "rl_forwards": "rl_forwards", "optimizer": "optimizer", "lowrank_grads": "lowrank_grads"}


def settings_not_in_force(row: Mapping[str, Any], result: Run) -> list[str]:
    """The cell's opt-in settings of hf_gradfix that did nothing in the run, by what the run held: the lean head's
    model calls, the packed rows' documents, the optimizer's class."""
    import hf_gradfix
    from hf_gradfix.optim.lowrank import LowRankAdamW

    state = hf_gradfix.state_of(result.trainer) if result.trainer is not None else None
    idle = []
    if row["lean"] and not getattr(getattr(state, "lean", None), "calls", 0):
        idle.append("lean")
    if row["packing"] != "off" and row["head"] in ("causal", "masked", "tokcls") and row["trainer"] != "GRPOTrainer":
        rows = [[d for d in documents(mb) if d[0] == r] for w in result.windows for mb in w
                for r in range(mb["input_ids"].shape[0])]
        if getattr(state, "packing_line", None) is None or not any(len(docs) > 1 for docs in rows):
            idle.append("packing")
    if row["optimizer"] != "adamw":
        opt = getattr(result.trainer, "optimizer", None)
        if not isinstance(getattr(opt, "optimizer", opt), LowRankAdamW):
            idle.append("optimizer")
    return idle


def _said(judged: Verdict, result: Run) -> Verdict:
    """A verdict reached on the numbers is kept only if every opt-in setting was in force or a warning named it (a
    setting that does nothing without a word is what this matrix exists to catch); a solo cell (a combination that
    makes a setting do nothing by design) must be refused or say so."""
    said = " ".join(judged.warnings).lower()
    unsaid = [f for f in settings_not_in_force(judged.row, result) if SETTING_WORDS[f] not in said]
    solo = [reason for pair, reason in SOLO_PAIRS.items() if all(judged.row[f] == v for f, v in pair)]
    if solo and judged.kind != "refused":
        keys = [SETTING_WORDS.get(f, f) for pair in SOLO_PAIRS for f, v in pair
                if all(judged.row[g] == w for g, w in pair) and v != DEFAULTS[f]]
        if not any(k in said for k in keys):
            unsaid.append(f"{solo[0]} (trained without a word)")
    if unsaid:
        return Verdict(judged.row, "FAIL", f"{judged.detail}, but silently not in force: {', '.join(unsaid)}",
                       judged.warnings, judged.seconds)
    return judged


def _judge_lowrank(row, patched: Run, seconds: float) -> Verdict:
    """lowrank_grads frees the projected weights' gradients: the run's updates are held to the same cell with full
    gradients, whose gradients are held to the ground truth."""
    full_row = dict(row, lowrank_grads=False)
    full = run(full_row, "patch", patch_config=plugin_config(full_row))
    seconds += full.seconds
    warned = patched.warnings
    if full.error is not None or len(full.grads) != 2:
        return Verdict(row, "FAIL", f"the full-gradient twin did not train ({full.error!r})", warned, seconds)
    errors = truth_errors(full, row)
    weight = max(max(float((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(1e-30))
                     for n in b) for a, b in zip(patched.after, full.after))
    if max(errors) <= GRAD_TOL and weight <= WEIGHT_TOL:
        return Verdict(row, "exact", f"full-gradient twin {max(errors):.1e} from the truth, weights {weight:.1e} "
                                     "from the twin", warned, seconds)
    return Verdict(row, "FAIL", f"low-rank accumulation: twin {max(errors):.1e} from the truth, weights {weight:.1e} "
                                "from the twin", warned, seconds)


def rows_with(pair: Mapping[str, Any], rows: list[dict]) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in pair.items())]


def summary(verdicts: list[Verdict]) -> str:
    counts = {k: sum(v.kind == k for v in verdicts) for k in ("exact", "stock", "refused", "FAIL")}
    lines = [f"{len(verdicts)} cells: " + ", ".join(f"{n} {k}" for k, n in counts.items())]
    for v in verdicts:
        lines.append(f"  {v.kind:7s} {cell_id(v.row)} ({v.seconds:.1f}s): {v.detail[:200]}")
    return "\n".join(lines)
