"""Prove, on the user's own model, that a packed row computes exactly what separate runs compute.

Support flags say nothing about packing: Falcon and OPT claim sdpa and FlashAttention support but never pass
``position_ids`` to their mask, so on sdpa/eager every packed sequence silently attends to the ones before it;
other models ignore ``cu_seq_lens`` on the FlashAttention path, or keep a recurrent state across sequences.
:func:`check_model_packs_correctly` runs a tiny probe (a few short random sequences, packed by
:class:`~hf_gradfix.packing.collator.PackedCollator` exactly as in training, versus each sequence alone) in eval
mode without gradients, and raises :class:`PackingCheckError` naming the model class and the reason when the
logits differ. It also sets ``model.config.use_cache = False``: a cache created inside ``forward`` switches
packed-sequence detection off on sdpa/eager.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .attention import REFERENCE_VARLEN_ATTENTION, register_reference_varlen_attention, use_attention_implementation
from .collator import PackedCollator
from ..errors import HfGradfixError, InvalidArgumentError

__all__ = ["PackingCheckError", "PackingCheckReport", "check_model_packs_correctly"]


class PackingCheckError(HfGradfixError, RuntimeError):
    """The model mixes packed sequences (or cannot run packed inputs); the message names the class and the reason.

    >>> issubclass(PackingCheckError, RuntimeError)
    True
    """


@dataclass
class PackingCheckReport:
    """Outcome of :func:`check_model_packs_correctly` (also attached to a :class:`PackingCheckError` as ``.report``).

    ``max_diff``: largest |packed - separate| over real tokens; ``first_sequence_diff``: the same for the first
    sequence of the (first) row alone; ``control_diff``: the same for a packed row WITHOUT restarted positions
    (what mixing looks like; the probe is only conclusive if it is far above ``max_diff``).

    >>> PackingCheckReport("LlamaForCausalLM", "sdpa", "varlen", (5, 7, 4), 1e-6, 0.0, 2.5, 4e-4, True).passed
    True
    """

    model_class: str
    attn_implementation: str | None
    mode: str
    lengths: tuple[int, ...]
    max_diff: float
    first_sequence_diff: float
    control_diff: float
    tolerance: float
    passed: bool
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _output_tensor(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, torch.Tensor):
        return out
    raise PackingCheckError(f"cannot find logits or hidden states in the model output ({type(out).__name__})")


def _accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _vocab_size(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if n is None:
        n = getattr(getattr(model, "config", None), "vocab_size", None)
    if not n:
        raise PackingCheckError(f"{type(model).__name__}: cannot find the vocabulary size for the probe")
    return int(n)


def _device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_model_packs_correctly(
    model: torch.nn.Module,
    attn_implementation: str | None = None,
    *,
    mode: Literal["varlen", "rows"] = "varlen",
    lengths: tuple[int, ...] = (5, 7, 4),
    tolerance: float | None = None,
    position_ids_start: int = 0,
    seed: int = 0,
    raise_on_failure: bool = True,
) -> PackingCheckReport:
    """Packed-vs-separate forward on ``model``; raise :class:`PackingCheckError` if packing changes the logits.

    Args:
        model: a transformers model (causal LM or base model); run in eval mode under ``no_grad``, then restored.
        attn_implementation: run the probe with this implementation (restored afterwards); ``None``: the model's
            current one. :data:`~hf_gradfix.packing.attention.REFERENCE_VARLEN_ATTENTION` is registered on demand.
        mode: pack as :class:`~hf_gradfix.packing.collator.PackedCollator` will in training: ``"varlen"`` (one
            row, ``position_ids`` + ``cu_seq_lens``) or ``"rows"`` (two rows, the shorter one tail-padded).
        lengths: probe sequence lengths (at least 2 sequences).
        tolerance: max allowed |packed - separate| logit difference; default ``1e-4`` (fp32/fp64) or ``3e-2``
            (half precision) times ``max(1, max |logit|)``.
        position_ids_start: first position of every sequence (as given to the collator).
        seed: seed of the probe's own generator (the global RNG is not touched).
        raise_on_failure: ``False`` returns the failing report instead of raising.

    Always sets ``model.config.use_cache = False`` (and passes ``use_cache=False``): a cache built in ``forward``
    disables packed-sequence detection on sdpa/eager. The error message names the model class, the attention
    implementation and the reason, e.g. "its attention ignores position_ids-based packing: sequences attend to
    each other".

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...                   num_key_value_heads=2, vocab_size=64, initializer_range=0.2, attn_implementation="sdpa")
    >>> model = LlamaForCausalLM(cfg)
    >>> report = check_model_packs_correctly(model)
    >>> report.passed, report.max_diff < 1e-5 < 1e-2 < report.control_diff, model.config.use_cache
    (True, True, False)
    """
    if mode not in ("varlen", "rows"):
        raise InvalidArgumentError(f"mode must be 'varlen' or 'rows', got {mode!r}")
    lengths = tuple(int(n) for n in lengths)
    if len(lengths) < 2 or min(lengths) < 1:
        raise InvalidArgumentError(f"lengths must hold at least 2 positive sequence lengths, got {lengths}")
    if attn_implementation == REFERENCE_VARLEN_ATTENTION:
        register_reference_varlen_attention()
    cls_name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False

    vocab = _vocab_size(model)
    device = _device(model)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    pad_id = getattr(config, "pad_token_id", None)
    collator = PackedCollator(
        mode=mode, pad_token_id=int(pad_id) if isinstance(pad_id, int) else 0, position_ids_start=position_ids_start
    )
    if mode == "varlen":
        index_bins = [list(range(len(seqs)))]
    else:  # two rows, the second one shorter so that it gets a padded tail
        half = max(1, len(seqs) - 1)
        index_bins = [list(range(half)), list(range(half, len(seqs)))]
        if sum(lengths[half:]) >= sum(lengths[:half]):
            index_bins = index_bins[::-1]
    bins = [[{"input_ids": seqs[i]} for i in b] for b in index_bins]
    # (row, offset) of every sequence in the packed batch
    placement: dict[int, tuple[int, int]] = {}
    for r, b in enumerate(index_bins):
        off = 0
        for i in b:
            placement[i] = (r, off)
            off += lengths[i]
    packed = collator(bins)
    packed.pop("labels")
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}

    def run(**inputs: Any) -> torch.Tensor:
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        return _output_tensor(model(**inputs, **extra)).float()

    was_training = model.training
    impl_used = getattr(config, "_attn_implementation", None)
    details: dict[str, Any] = {}
    try:
        model.eval()
        with use_attention_implementation(model, attn_implementation) as impl_used, torch.no_grad():
            stage = "a single unpacked sequence"
            try:
                separate = [
                    run(
                        input_ids=s.unsqueeze(0),
                        position_ids=torch.arange(position_ids_start, position_ids_start + s.numel()).unsqueeze(0),
                    )[0]
                    for s in seqs
                ]
                stage = "packed inputs"
                out = run(**packed)
            except Exception as e:  # a model that cannot run this attention implementation or packed inputs
                first = str(e).splitlines()[0][:200] if str(e) else ""
                reason = (
                    f"it raised {type(e).__name__} on {stage} ({first}); it does not support this attention "
                    "implementation / packed format"
                )
                report = PackingCheckReport(
                    cls_name, impl_used, mode, lengths, float("inf"), float("inf"), float("nan"),
                    float("nan"), False, reason, {"exception": repr(e)},
                )
                return _fail(report, raise_on_failure, e)
            # The same row WITHOUT restarted positions (and without cu_seq_lens): what mixing looks like.
            width = packed["input_ids"].shape[1]
            plain = torch.arange(position_ids_start, position_ids_start + width).expand_as(packed["input_ids"])
            try:
                control = run(input_ids=packed["input_ids"], position_ids=plain)
            except Exception as e:  # pragma: no cover - arange positions always work
                control = None
                details["control_exception"] = repr(e)
    finally:
        model.train(was_training)

    # Real tokens of the packed output, in the order of `seqs`.
    packed_parts = [out[r, off : off + lengths[i]] for i, (r, off) in sorted(placement.items())]
    control_parts = (
        [control[r, off : off + lengths[i]] for i, (r, off) in sorted(placement.items())] if control is not None else []
    )
    diffs = [float((p - q).abs().max()) for p, q in zip(packed_parts, separate)]
    max_diff = max(diffs)
    first_diff = diffs[index_bins[0][0]]
    control_diff = packed_vs_control = float("nan")
    if control is not None:
        control_diff = max(float((c - q).abs().max()) for c, q in zip(control_parts, separate))
        packed_vs_control = max(float((p - c).abs().max()) for p, c in zip(packed_parts, control_parts))
    scale = max(1.0, max(float(q.abs().max()) for q in separate))
    if tolerance is None:
        half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
        tolerance = (3e-2 if half else 1e-4) * scale
    details.update(per_sequence_diff=diffs, packed_vs_control=packed_vs_control, logit_scale=scale)

    reason = None
    if max_diff > tolerance:
        flash = isinstance(impl_used, str) and "flash" in impl_used
        where = "cu_seq_lens / position_ids" if flash else "position_ids"
        if first_diff > tolerance:
            reason = (
                f"even the first packed sequence differs from its separate run (max diff {first_diff:.3g}): the model "
                "does not process a packed row token by token like separate rows"
            )
        elif control is not None and packed_vs_control <= tolerance:
            reason = (
                "its forward ignores position_ids (restarting them changes nothing), so nothing can separate packed "
                "sequences: sequences attend to each other"
            )
        else:
            reason = f"its attention ignores {where}-based packing: sequences attend to each other"
        if mode == "rows" and flash:
            reason += (
                " (FlashAttention separates packed sequences only in ONE row with cu_seq_lens; use mode='varlen')"
            )
    elif not (control_diff > 10 * max_diff) or not (control_diff > tolerance):
        reason = (
            f"inconclusive: the probe cannot tell packed from mixed sequences (control diff {control_diff:.3g} vs "
            f"packed diff {max_diff:.3g}); use longer probe lengths or a trained model"
        )
    report = PackingCheckReport(
        cls_name, impl_used, mode, lengths, max_diff, first_diff, control_diff, float(tolerance), reason is None,
        reason, details,
    )
    if reason is not None:
        return _fail(report, raise_on_failure, None)
    return report


def _fail(report: PackingCheckReport, raise_on_failure: bool, cause: BaseException | None) -> PackingCheckReport:
    if not raise_on_failure:
        return report
    numbers = (
        f" (max |packed - separate| logit diff {report.max_diff:.3g} > tolerance {report.tolerance:.3g}; "
        f"first sequence {report.first_sequence_diff:.3g}; without restarted positions {report.control_diff:.3g})"
        if report.max_diff != float("inf")
        else ""
    )
    err = PackingCheckError(
        f"{report.model_class} cannot be trained on packed sequences with attn_implementation="
        f"{report.attn_implementation!r} (mode={report.mode!r}): {report.reason}{numbers}. Train it unpacked "
        "(padded batches), or with an attention implementation that passes this check."
    )
    err.report = report  # type: ignore[attr-defined]
    if cause is not None:
        raise err from cause
    raise err
