"""What the ecosystem ships, for the conformance tests: real tokenizers built offline, transformers' and TRL's own
collators and trainers, ``datasets`` objects, and an independent ground truth computed on the batches the Trainer
actually drew.

How a case works (``run_case``):

* The trainer is built the way a user builds it (``processing_class=tokenizer``, a transformers / TRL collator or none,
  a ``datasets.Dataset`` / ``IterableDataset``), then its ``data_collator`` is wrapped by :class:`BatchRecorder`, which
  keeps a copy of every batch the collator produced (with its type: ``BatchEncoding``, dict, ...). Batches are consumed
  in the order they are collated (``dataloader_num_workers=0``), so optimizer step k used batches ``k*GA .. k*GA+GA-1``.
* SGD with ``learning_rate=0`` and ``max_grad_norm=0``: the weights never move, so every step is compared with the
  ground truth at the initial weights. A callback clones the accumulated gradient at ``on_pre_optimizer_step``.
* :func:`window_ground_truth`: plain PyTorch, one process. Each recorded batch is run through the model as the Trainer
  fed it (same padded tensors, attention mask, position ids), *without labels*; the cross entropy of every target is
  computed from the logits by the task's rule (causal: ``logits[:, :-1]`` vs ``labels[:, 1:]``, or the collator's
  ``shift_labels``; masked LM, token classification, seq2seq: unshifted; sequence classification: one per row), summed
  over the whole window and divided by the window's target count; one backward.
"""

from __future__ import annotations

import copy
import random
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

import harness as H

IGNORE_INDEX = -100
SPECIAL_TOKENS = ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]", "[CLS]", "[SEP]"]
ROLE_WORDS = ["user", "assistant", "system", ":"]
#: 97 - 7 special - 4 role words = 86 content words: the vocabulary is exactly the harness models' 97, with
#: [PAD]=0, [BOS]=1, [EOS]=2, [MASK]=3 matching harness.PAD_ID / BOS_ID / EOS_ID / MASK_ID.
CONTENT_WORDS = [f"w{i}" for i in range(H.VOCAB - len(SPECIAL_TOKENS) - len(ROLE_WORDS))]

#: A chat template with generation markers, so TRL's ``assistant_only_loss`` can find the assistant tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ 'assistant : ' }}{% generation %}{{ message['content'] + ' [EOS]' }}{% endgeneration %}{{ ' ' }}"
    "{% else %}{{ message['role'] + ' : ' + message['content'] + ' ' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant : ' }}{% endif %}"
)


def build_tokenizer(padding_side: str = "right", *, style: str = "causal"):
    """A real fast tokenizer built offline with the ``tokenizers`` library (word level, 97 tokens).

    ``style="causal"``: no special tokens added (TRL appends EOS itself); ``style="bert"``: ``[CLS] ... [SEP]``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ROLE_WORDS + CONTENT_WORDS)}
    assert len(vocab) == H.VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if style == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 5), ("[SEP]", 6)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        mask_token="[MASK]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        padding_side=padding_side,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def sentences(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[str]:
    """``n`` sentences of content words with lengths spread over ``[lo, hi]`` (very different token counts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(1, n - 1)
        out.append(" ".join(rng.choice(CONTENT_WORDS) for _ in range(length)))
    rng.shuffle(out)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Recording what the Trainer drew
# ----------------------------------------------------------------------------------------------------------------------


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    return copy.deepcopy(value)


class BatchRecorder:
    """Wraps a data collator; keeps a copy of every batch it produced, and the batch's type."""

    def __init__(self, collator: Callable):
        self.collator = collator
        self.batches: list[dict[str, Any]] = []
        self.types: list[type] = []

    def __call__(self, features):
        batch = self.collator(features)
        self.types.append(type(batch))
        self.batches.append({k: _clone(v) for k, v in batch.items()})
        return batch


def _grad_recorder(steps: list):
    from transformers import TrainerCallback

    class GradRecorder(TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            steps.append({n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                          for n, p in self.trainer.model.named_parameters() if p.requires_grad})

    return GradRecorder()


# ----------------------------------------------------------------------------------------------------------------------
# Ground truth
# ----------------------------------------------------------------------------------------------------------------------

#: what the ground truth passes to the model from a recorded batch (everything but the targets)
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def batch_targets(batch: Mapping, logits: torch.Tensor, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) aligned by the task's rule; targets -100 where ignored."""
    if task == "seqcls":
        return logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)
    labels = batch["labels"]
    if torch.is_tensor(batch.get("shift_labels")):
        return logits, batch["shift_labels"]
    if task == "causal":
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


def packed_segments(batch: Mapping) -> list[tuple[int, int]] | None:
    """[(start, end)] of the sequences in a padding-free row (one row, no attention mask, position_ids restarting at 0),
    or None for an ordinary batch."""
    pos = batch.get("position_ids")
    if batch.get("attention_mask") is not None or not torch.is_tensor(pos) or pos.shape[0] != 1:
        return None
    starts = (pos[0] == 0).nonzero().flatten().tolist()
    if len(starts) < 2:
        return None
    return list(zip(starts, starts[1:] + [pos.shape[1]]))


def batch_loss_sum(model, batch: Mapping, task: str) -> tuple[torch.Tensor, int]:
    """(sum of per-target CE, target count) of one recorded batch, from the model's logits (no labels passed).

    A padding-free row (concatenated sequences, restarted position ids) is cut into its sequences and each runs alone
    with the model's default positions: no sequence can see another in the ground truth.
    """
    segments = packed_segments(batch)
    if segments is not None:
        total, count = None, 0
        for start, end in segments:
            part = {"input_ids": batch["input_ids"][:, start:end], "labels": batch["labels"][:, start:end]}
            if torch.is_tensor(batch.get("shift_labels")):
                part["shift_labels"] = batch["shift_labels"][:, start:end]
            ce, c = batch_loss_sum(model, part, task)
            total = ce if total is None else total + ce
            count += c
        return total, count
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if task == "seq2seq" and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = H._decoder_input_ids(model, batch["labels"])
    out = model(**inputs)
    logits = (out["logits"] if isinstance(out, Mapping) else out.logits).float()
    lg, tg = batch_targets(batch, logits, task)
    count = int(tg.ne(IGNORE_INDEX).sum())
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, count


def window_ground_truth(model, batches: list[Mapping], task: str) -> tuple[float, dict[str, torch.Tensor], int]:
    """(token-mean loss, gradient, target count) over one optimizer window of recorded batches."""
    model.zero_grad(set_to_none=True)
    total, count = None, 0
    for batch in batches:
        ce, c = batch_loss_sum(model, batch, task)
        total = ce if total is None else total + ce
        count += c
    loss = total / count
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads, count


def eval_ground_truth(model, batches: list[Mapping], task: str) -> float:
    """Exact token mean of the loss over a whole eval set's recorded batches."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            ce, c = batch_loss_sum(model, batch, task)
            total += float(ce)
            count += c
    return total / count


# ----------------------------------------------------------------------------------------------------------------------
# Running a case, stock and patched
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    grad_errors: list[float]
    loss_errors: list[float]
    eval_error: float | None
    batch_types: set[str]
    steps: int
    trainer: Any = None
    logs: list[dict] = field(default_factory=list)
    eval_metrics: dict = field(default_factory=dict)

    @property
    def worst(self) -> float:
        return max(self.grad_errors)


def training_args(output_dir: str, *, args_cls=None, **overrides):
    """The TrainingArguments (or TRL config) of a conformance case: SGD at lr 0, no clipping, CPU, quiet."""
    import transformers

    base = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        optim="sgd",
        learning_rate=0.0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    base.update(overrides)
    return (args_cls or transformers.TrainingArguments)(**base)


def run_case(
    make_trainer: Callable[[str], Any],
    task: str,
    *,
    mode: str,
    evaluate: bool = False,
) -> CaseResult:
    """Build a trainer with ``make_trainer(output_dir)``, train it, and compare every optimizer step with the ground
    truth computed on the batches it drew.

    ``mode``: ``"stock"`` (no plugin), ``"patch"`` (``hf_gradfix.patch()`` around the construction) or ``"callback"``
    (``GradFixCallback`` passed... added to the trainer's callbacks after construction, which the plugin supports for
    the loss fix).
    """
    import hf_gradfix
    from transformers.trainer_callback import PrinterCallback

    output_dir = tempfile.mkdtemp(prefix="hgf_eco_")
    steps: list[dict] = []
    try:
        if mode == "patch":
            hf_gradfix.patch()
        try:
            trainer = make_trainer(output_dir)
        finally:
            if mode == "patch":
                hf_gradfix.unpatch()
        if mode == "callback":
            trainer.add_callback(hf_gradfix.GradFixCallback())
        trainer.remove_callback(PrinterCallback)
        recorder = BatchRecorder(trainer.data_collator)
        trainer.data_collator = recorder
        grads = _grad_recorder(steps)
        grads.trainer = trainer
        trainer.add_callback(grads)
        model = trainer.model
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.train()
        train_batches = list(recorder.batches)
        eval_loss, metrics = None, {}
        if evaluate:
            recorder.batches.clear()
            metrics = trainer.evaluate()
            eval_loss = metrics["eval_loss"]
            eval_batches = list(recorder.batches)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        ga = trainer.args.gradient_accumulation_steps
        # ground truth at the initial weights, in train mode (every dropout of these models is 0)
        model.load_state_dict(initial)
        model.train()
        grad_errors, loss_errors = [], []
        for k, got in enumerate(steps):
            window = train_batches[k * ga : (k + 1) * ga]
            gt_loss, gt_grads, _ = window_ground_truth(model, window, task)
            grad_errors.append(H.rel_err(got, gt_grads))
            if k < len(logged):
                loss_errors.append(abs(logged[k] - gt_loss) / abs(gt_loss))
        eval_error = None
        if evaluate:
            model.eval()
            gt_eval = eval_ground_truth(model, eval_batches, task)
            eval_error = abs(eval_loss - gt_eval) / abs(gt_eval)
        return CaseResult(
            grad_errors=grad_errors,
            loss_errors=loss_errors,
            eval_error=eval_error,
            batch_types={t.__name__ for t in recorder.types},
            steps=len(steps),
            trainer=trainer,
            logs=list(trainer.state.log_history),
            eval_metrics=metrics,
        )
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
