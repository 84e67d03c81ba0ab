"""Padding-free policy forwards for TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (``packing.rl_forwards``).

TRL 1.16 computes every policy log-probability through one method, ``_get_per_token_logps_and_entropies(model,
input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, compute_aux_loss=False, ...)``:
the training forward in ``_compute_loss``, ``old_per_token_logps`` and ``ref_per_token_logps`` in
``_generate_and_score_completions``. Its rows are left-padded prompts followed by right-padded completions, padded
to the longest prompt and the longest completion of the *generation batch*, and every padded position runs through
every layer (and, off Triton devices, through TRL's fused LM head).

:func:`attach` replaces that method **on the trainer instance** by :func:`_forward`, which keeps TRL's chunking
(``batch_size``) and, per chunk, builds ONE packed row (:func:`pack_chunk`): each sample's real prompt tokens and
its completion tokens up to the end of its attention mask are one document, ``position_ids`` restart at every
document (at the first position the model uses on its own, as the guard measures), int32 ``cu_seq_lens_q/k`` and
``max_length_q/k`` delimit the documents, no ``attention_mask``; labels are the completion tokens (``-100``
elsewhere and at every document start). The model runs it with TRL's own fused head (``fused_lm_head=True``, the
same temperature, the same kernel), and the per-token log-probabilities / entropies are put back in TRL's
``(B, logits_to_keep)`` layout (0 where masked, as TRL's head writes them); a MoE aux loss is the chunk's over its
real tokens, which is what TRL's masked one is. Nothing else in TRL changes.

The model is prepared at its first packed call (the policy, and a separate reference model on its own): with
``packing.attention: auto`` a model not on a FlashAttention-style implementation is switched to the varlen one
(:func:`hf_gradfix.packing.attention.select_varlen_attention`: flash-attn 2, else torch's varlen kernel on CUDA,
else the pure-PyTorch reference on CPU) for the rest of the run (generation then runs it with its padding mask, as
``attn_implementation="flash_attention_2"`` does; switching only around the log-prob forwards would let gradient
checkpointing's recomputation run another attention), then the packing guard
(:func:`hf_gradfix.packing.guard.check_model_packs_correctly`) runs a packed-vs-separate probe on it. A model the
guard refuses keeps its attention and its padded forwards, with one warning naming why. Batches that cannot be
packed exactly stay padded for that call (one warning per reason): multimodal inputs of a layout :mod:`.multimodal`
does not pack (Gemma 3's ``token_type_ids``, tiles, ...), an attention mask with a hole inside a sample, a completion
with no prompt token in front of it. Images of the layouts it knows (patches + grids with 4-row mRoPE positions per
document, one row per image, per-sample stacks) are packed with the chunk, in document order.

Version-gated like :mod:`.policy_gradient`: TRL 1.16 and the method as TRL's GRPO / RLOO code defines it; a subclass with its
own log-prob forward, another TRL release, or context parallelism keeps TRL's padded forwards (one warning).

>>> import torch
>>> ids = torch.tensor([[0, 5, 6, 7, 8, 0], [3, 4, 5, 9, 0, 0]])
>>> mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
>>> chunk = pack_chunk(ids, mask, logits_to_keep=3)
>>> chunk.inputs["input_ids"].tolist(), chunk.inputs["position_ids"].tolist()
([[5, 6, 7, 8, 3, 4, 5, 9]], [[0, 1, 2, 3, 0, 1, 2, 3]])
>>> chunk.inputs["labels"].tolist(), chunk.inputs["cu_seq_lens_q"].tolist()
([[-100, -100, 7, 8, -100, -100, -100, 9]], [0, 4, 8])
>>> chunk.rows.tolist(), chunk.cols.tolist(), chunk.source.tolist()  # log-prob of token f is read at f - 1
([0, 0, 1], [0, 1, 0], [1, 2, 6])
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("hf_gradfix")

__all__ = ["PackedChunk", "RLPacking", "attach", "pack_chunk", "packed_per_token_logps", "rl_packing_of",
           "unpackable_reason"]

_ATTR = "_hf_gradfix_rl_packing"
_METHOD = "_get_per_token_logps_and_entropies"
IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------ packing one chunk
@dataclass
class PackedChunk:
    """One TRL chunk as a packed row: ``inputs`` for the model (batch size 1) and where each completion token's
    log-probability goes: row ``rows[i]``, completion column ``cols[i]`` of TRL's ``(B, logits_to_keep)`` output,
    read from position ``source[i]`` of the fused head's shifted output (the token before it)."""

    inputs: dict[str, Any]
    rows: torch.Tensor
    cols: torch.Tensor
    source: torch.Tensor
    real_tokens: int
    padded_tokens: int


def unpackable_reason(attention_mask: torch.Tensor, logits_to_keep: int) -> str | None:
    """Why this batch cannot be packed with log-probs identical to TRL's padded forward (None: it can).

    Each row must hold real tokens, as one contiguous run (TRL's left-padded prompt then its completion), and a row
    with completion tokens must have the prompt's last column real (the completion's first token is predicted from
    it).

    >>> unpackable_reason(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]), 2) is None
    True
    >>> unpackable_reason(torch.tensor([[1, 0, 1, 1]]), 2)
    'a row whose attention mask has a hole (real tokens that are not one contiguous run)'
    """
    mask = attention_mask.bool()
    _, width = mask.shape
    prompt = width - int(logits_to_keep)
    if prompt < 1:
        return "no prompt column in front of the completions"
    lengths = mask.sum(1)
    if not bool((lengths > 0).all()):
        return "a sample without a single real token"
    idx = torch.arange(width, device=mask.device)
    first = torch.where(mask, idx, width).amin(1)
    last = torch.where(mask, idx, -1).amax(1)
    if not bool(((lengths == 0) | (last - first + 1 == lengths)).all()):
        return "a row whose attention mask has a hole (real tokens that are not one contiguous run)"
    completion = mask[:, prompt:].sum(1)
    if not bool(((completion == 0) | mask[:, prompt - 1]).all()):
        return "a completion with no real prompt token in front of it"
    return None


def pack_chunk(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *,
               position_ids_start: int = 0, restart_positions: bool = True, document_mask: bool = True) -> PackedChunk:
    """Pack the rows of one TRL chunk (``input_ids`` / ``attention_mask`` of shape ``(B, T)``, the last
    ``logits_to_keep`` columns the completions) into one varlen row, as
    :class:`~hf_gradfix.packing.collator.PackedCollator` would collate the documents (``mode="varlen"``: restarted ``position_ids``, int32 ``cu_seq_lens_q/k``, Python-int
    ``max_length_q/k``, labels ``-100`` at every document start), built on the batch's device without a copy to the
    host. Rows without a real token are no document. ``restart_positions=False`` / ``document_mask=False`` build the
    wrong rows the tests use as controls (positions running on across documents / no ``cu_seq_lens``)."""
    mask = attention_mask.bool()
    batch, width = mask.shape
    prompt = width - int(logits_to_keep)
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: every sample's tokens in order, samples in order
    ids = input_ids[rows, cols]
    total = int(ids.numel())
    lengths = mask.sum(1)
    lens = lengths[lengths > 0].to(torch.int32)
    cu = F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    starts = cu[:-1].long()
    offsets = torch.arange(total, device=ids.device)
    if restart_positions:
        positions = offsets - torch.repeat_interleave(starts, lens.long()) + position_ids_start
    else:
        positions = offsets + position_ids_start
    completion = cols >= prompt
    labels = torch.where(completion, ids, torch.full_like(ids, IGNORE_INDEX))
    labels[starts] = IGNORE_INDEX  # never predicted from the previous document's last token
    inputs: dict[str, Any] = {"input_ids": ids[None], "position_ids": positions[None], "labels": labels[None]}
    if document_mask:
        longest = int(lens.max()) if lens.numel() else 0
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
    source = completion.nonzero(as_tuple=True)[0]
    return PackedChunk(inputs, rows[source], cols[source] - prompt, source - 1, total, batch * width)


def _scatter(values: torch.Tensor, chunk: PackedChunk, shape: tuple[int, int]) -> torch.Tensor:
    """The fused head's ``(1, N - 1)`` per-token values in TRL's ``(B, logits_to_keep)`` layout, 0 elsewhere."""
    flat = values[0]
    out = flat.new_zeros(shape)
    if chunk.source.numel():
        return out.index_put((chunk.rows, chunk.cols), flat[chunk.source])
    # no completion token: a zero that stays connected to the model, as TRL's head keeps an all-masked micro-batch
    return out + flat.sum() * 0 if flat.requires_grad else out


def packed_per_token_logps(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                           batch_size: int | None = None, compute_entropy: bool = False,
                           compute_aux_loss: bool = False, *, position_ids_start: int = 0,
                           autocast: Any = None, counts: Counter | None = None,
                           multimodal: dict[str, Any] | None = None, rope_fn: Any = None, mrope: bool = True,
                           **controls: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's ``_get_per_token_logps_and_entropies`` on packed rows: the same ``(logps, entropies, aux_loss)`` for a
    model TRL gave its fused LM head (``trl.trainer.utils.add_fused_lm_head``), one packed row per TRL chunk of
    ``batch_size`` samples. ``autocast``: a context manager factory (TRL runs the forward under
    ``accelerator.autocast()``); ``counts`` receives the real and padded token counts; ``controls``: the wrong rows of
    :func:`pack_chunk` for the tests. ``multimodal``: the batch's image inputs as TRL passes them (``.multimodal``
    lays each chunk's out in its row; ``rope_fn``: the model's per-document rope index, 4-row positions;
    ``mrope=False``: 2-D positions instead, a control)."""
    batch_size = batch_size or input_ids.size(0)
    if multimodal:
        from .multimodal import varlen_kwargs_allowed

        if not varlen_kwargs_allowed(multimodal):  # the tower would read them: positions delimit the documents
            controls = {**controls, "document_mask": False}
    logps, entropies, aux_losses = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        chunk = pack_chunk(input_ids[start:end], attention_mask[start:end], logits_to_keep,
                           position_ids_start=position_ids_start, **controls)
        inputs = dict(chunk.inputs)
        if multimodal:
            from .multimodal import pack_multimodal

            inputs = pack_multimodal(inputs, input_ids, attention_mask, multimodal, start, end, rope_fn=rope_fn,
                                     text_start=position_ids_start, mrope=mrope)
        if compute_aux_loss:
            inputs["output_router_logits"] = True
        with (autocast() if autocast is not None else contextlib.nullcontext()):
            outputs = model(**inputs, fused_lm_head=True)
        shape = (end - start, int(logits_to_keep))
        logps.append(_scatter(outputs.log_probs, chunk, shape))
        if compute_entropy:
            entropies.append(_scatter(outputs.entropy, chunk, shape))
        if compute_aux_loss:
            aux_losses.append(outputs.aux_loss)
        if counts is not None:
            counts["real_tokens"] += chunk.real_tokens
            counts["padded_tokens"] += chunk.padded_tokens
    return (torch.cat(logps, dim=0), torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None)


# ------------------------------------------------------------------------------------------ the trainer hook
@dataclass
class _Verdict:
    packs: bool
    position_ids_start: int = 0
    attention: str | None = None
    reason: str | None = None


@dataclass
class RLPacking:
    """One trainer's packed log-prob forwards: each model's verdict, the warnings given, and counts (``calls``:
    packed and padded calls by reason; ``tokens``: ``real_tokens`` run packed and the ``padded_tokens`` TRL's padded
    forward would have run for them)."""

    verdicts: "weakref.WeakKeyDictionary[Any, _Verdict]" = field(default_factory=weakref.WeakKeyDictionary)
    warned: set = field(default_factory=set)
    calls: Counter = field(default_factory=Counter)
    tokens: Counter = field(default_factory=Counter)
    lines: list = field(default_factory=list)

    @property
    def padding_saved(self) -> float:
        """The fraction of the padded forwards' tokens the packed rows did not run."""
        padded = self.tokens["padded_tokens"]
        return 1.0 - self.tokens["real_tokens"] / padded if padded else 0.0


def rl_packing_of(trainer: Any) -> RLPacking | None:
    """The trainer's :class:`RLPacking` (None: its log-prob forwards are TRL's own)."""
    return trainer.__dict__.get(_ATTR)


def _trl_owner(trainer: Any) -> str | None:
    """Why the trainer's log-prob forward is not TRL 1.16's GRPO / RLOO one (None: it is)."""
    from .policy_gradient import _TRL_LOSS_MODULES, SUPPORTED_TRL, _trl_version

    owner = next((k for k in type(trainer).__mro__ if _METHOD in k.__dict__
                  and not k.__module__.startswith("hf_gradfix.")), None)
    if owner is None or owner.__module__ not in _TRL_LOSS_MODULES:
        where = f"{owner.__module__}.{owner.__qualname__}" if owner is not None else "nowhere"
        return f"its {_METHOD} is its own ({where})"
    version = _trl_version()
    if version is None or version not in SUPPORTED_TRL:
        return f"hf_gradfix knows TRL {SUPPORTED_TRL}'s log-prob forward only (installed: {version})"
    return None


def _is_rl_trainer(trainer: Any) -> bool:
    return callable(getattr(type(trainer), _METHOD, None)) and callable(
        getattr(type(trainer), "_generate_and_score_completions", None))


def attach(trainer: Any, config: Any) -> RLPacking | None:
    """Run ``trainer``'s log-prob forwards packed when ``config.packing.rl_forwards`` is on and it is a TRL
    GRPO / RLOO trainer whose forward is TRL 1.16's (idempotent; called where ``patch()`` and ``GradFixCallback``
    install the fixes). Returns the trainer's :class:`RLPacking`, or None. A trainer without TRL's policy log-prob
    forward (a plain Trainer, SFTTrainer, AsyncGRPOTrainer) is refused: the setting would do nothing on it."""
    if not getattr(config.packing, "rl_forwards", False):
        return None
    if not _is_rl_trainer(trainer):  # the setting would do nothing on this trainer: refused before any step
        from ...errors import GradFixError

        raise GradFixError(
            f"hf_gradfix.packing.rl_forwards: invalid value True; it packs the policy log-prob forwards of TRL's "
            f"GRPOTrainer / RLOOTrainer ({_METHOD} and _generate_and_score_completions), which "
            f"{type(trainer).__name__} has not, so it would do nothing here: remove packing.rl_forwards (or give it "
            f"to the GRPO / RLOO trainer alone: GradFixCallback({{'packing': {{'rl_forwards': True}}}})); "
            "packing.enabled packs a dataset")
    packing = trainer.__dict__.get(_ATTR)
    if packing is not None:
        return packing
    name = type(trainer).__name__
    why = _trl_owner(trainer)
    if why is None:
        from ..state import _nd_dims

        dims = _nd_dims(trainer)
        if dims is not None and dims.cp > 1:
            why = (f"context parallelism (cp={dims.cp}) splits every row over ranks, which these packed rows do not "
                   "support")
    if why is not None:
        logger.warning("hf_gradfix: packing.rl_forwards on %s: %s, so its log-prob forwards stay TRL's padded "
                       "ones.", name, why)
        return None
    packing = RLPacking()
    trainer.__dict__[_ATTR] = packing

    def forward(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                compute_aux_loss=False, **extra):
        return _forward(trainer, packing, model, input_ids, attention_mask, logits_to_keep, batch_size,
                        compute_entropy, compute_aux_loss, **extra)

    trainer.__dict__[_METHOD] = forward
    return packing


def _warn_once(trainer: Any, packing: RLPacking, key: str, message: str) -> None:
    if key not in packing.warned:
        packing.warned.add(key)
        logger.warning("hf_gradfix: %s: %s", type(trainer).__name__, message)


def _forward(trainer, packing: RLPacking, model, input_ids, attention_mask, logits_to_keep, batch_size,
             compute_entropy, compute_aux_loss, **extra):
    # TRL's own method, looked up on the class at call time (a later class swap is honoured)
    original = getattr(type(trainer), _METHOD).__get__(trainer)

    def padded(reason: str):
        packing.calls[f"padded: {reason}"] += 1
        return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                        compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)

    given = {k: v for k, v in extra.items() if v is not None}
    if given:
        from .multimodal import multimodal_reason

        mm_why = multimodal_reason(given, int(input_ids.size(0)))
        if mm_why is not None:
            _warn_once(trainer, packing, f"multimodal {mm_why}", f"log-prob forwards with {', '.join(sorted(given))} "
                       f"stay padded: {mm_why}.")
            return padded("multimodal inputs")
    why = unpackable_reason(attention_mask, logits_to_keep)
    if why is not None:
        _warn_once(trainer, packing, why, f"a log-prob forward with {why} stays padded (packing it would change "
                   "its log-probs).")
        return padded(why)
    unwrapped = trainer.accelerator.unwrap_model(model)
    verdict = packing.verdicts.get(unwrapped)
    if verdict is None:
        rows = min(batch_size or input_ids.size(0), input_ids.size(0))
        verdict = _prepare(trainer, packing, unwrapped, width=int(input_ids.size(1)), rows=rows)
        packing.verdicts[unwrapped] = verdict
    if not verdict.packs:
        return padded("model refused by the packing guard")
    packing.calls["packed"] += 1
    rope_fn = None
    if given:
        from ...packing.multimodal import rope_index_fn

        packing.calls["packed multimodal"] += 1
        rope_fn = rope_index_fn(unwrapped)  # an mRoPE family: its own rope index per document (4-row positions)
    try:
        from trl.extras.profiling import profiling_context

        profiled = profiling_context(trainer, _METHOD)
    except Exception:  # noqa: BLE001 - profiling is TRL's nicety, never a reason to fail
        profiled = contextlib.nullcontext()
    with profiled:
        return packed_per_token_logps(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
            position_ids_start=verdict.position_ids_start, autocast=trainer.accelerator.autocast,
            counts=packing.tokens, multimodal=given or None, rope_fn=rope_fn,
        )


def _configs(model: Any) -> list[Any]:
    config = getattr(model, "config", None)
    found = [config, getattr(config, "text_config", None)]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        found.append(get_text())
    out = []
    for c in found:
        if c is not None and all(c is not o for o in out):
            out.append(c)
    return out


def _prepare(trainer, packing: RLPacking, model, *, width: int, rows: int) -> _Verdict:
    """The model's attention (``packing.attention``), then the guard (``packing.guard``), once per model."""
    from ...packing.attention import select_varlen_attention, set_attention_implementation
    from ...packing.guard import PackingCheckError, check_model_packs_correctly
    from ..state import state_of

    state = state_of(trainer)
    cfg = state.config.packing
    name, model_name = type(trainer).__name__, type(model).__name__
    previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
    attention = previous
    if cfg.attention == "auto" and not (isinstance(previous, str) and "flash" in previous):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        attention = select_varlen_attention(device)
        set_attention_implementation(model, attention)
    line = (f"{name}'s log-prob forwards on {model_name} packed (one varlen row per TRL chunk, prompt + completion "
            f"one document per sample), attention {attention}")
    start = 0
    if not cfg.guard:
        logger.warning("hf_gradfix: packing.guard is false, so %s is not checked for letting packed sequences attend "
                       "to each other; a model that mixes them trains on wrong log-probs with no error.", model_name)
        line += ", guard off"
    else:
        caches = [(c, c.use_cache) for c in _configs(model) if hasattr(c, "use_cache")]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            # on the model as its forwards run (TRL's autocast), without moving any random stream (generation)
            with torch.random.fork_rng(devices=devices), trainer.accelerator.autocast():
                report = check_model_packs_correctly(
                    model, mode="varlen", token_budget=max(16, min(int(cfg.token_budget), rows * width)),
                    max_sequence_length=width,
                )
        except PackingCheckError as exc:
            if attention != previous:
                set_attention_implementation(model, previous)
            _warn_once(trainer, packing, f"guard {id(model)}", f"packing.rl_forwards: {exc} Its log-prob forwards "
                       "stay TRL's padded ones.")
            return _Verdict(False, attention=previous, reason=str(exc))
        finally:
            for c, value in caches:  # the guard turns the cache off; generation keeps the model's own setting
                c.use_cache = value
        start = report.position_ids_start
        line += ", guard passed" + (f" (positions start at {start})" if start else "")
    packing.lines.append(line)
    if state.config.log_fixes:
        logger.info("hf_gradfix: %s.", line)
    return _Verdict(True, position_ids_start=start, attention=attention)
