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

from .attention import (
    REFERENCE_VARLEN_ATTENTION,
    TORCH_VARLEN_ATTENTION,
    register_reference_varlen_attention,
    register_torch_varlen_attention,
    use_attention_implementation,
)
from .collator import PackedCollator
from ..errors import HfGradfixError, InvalidArgumentError
from ..probe_mode import probe_mode

__all__ = ["PackingCheckError", "PackingCheckReport", "check_model_packs_correctly", "check_model_packs_under_cp",
           "probe_lengths"]


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
    (what mixing looks like; the probe is only conclusive if it is far above ``max_diff``);
    ``position_ids_start``: the first position the model uses for a sequence alone (packed rows must use it too).

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
    position_ids_start: int = 0


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


def _position_table(config: Any) -> int | None:
    """The position-table size the config states (only used to size the default probe)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def probe_lengths(token_budget: int, max_sequence_length: int | None = None) -> tuple[int, ...]:
    """The guard's probe row: ``token_budget`` tokens, laid out to expose what packing can get wrong.

    A short sequence first (nothing precedes it, so any change in it can only come from what FOLLOWS it in the
    row, i.e. length-dependent behaviour such as dynamic RoPE scaling), then the longest sequence training can
    hold (``token_budget`` minus the short ones, at most ``max_sequence_length``), then two short sequences
    (they see the long one if the model lets packed sequences attend to each other).

    >>> probe_lengths(4096)
    (7, 4069, 11, 9)
    >>> probe_lengths(4096, max_sequence_length=1000)
    (7, 1000, 11, 9)
    >>> probe_lengths(16)
    (3, 6, 4, 3)
    """
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 4:
        raise InvalidArgumentError(f"token_budget must be an int >= 4 for the packing probe, got {token_budget!r}")
    shorts = (7, 11, 9) if token_budget >= 64 else (max(1, token_budget // 5),) * 3
    shorts = (shorts[0], shorts[1] + (token_budget < 64), shorts[2])
    long = token_budget - sum(shorts)
    if max_sequence_length is not None:
        long = min(long, int(max_sequence_length))
    return (shorts[0], max(1, long), shorts[1], shorts[2])


#: a document's outputs may depend on another document's tokens by at most this fraction of their dependence on its
#: own: none at all. Masked attention weights are exactly 0 (exp(-inf), or exp of the dtype's minimum, underflows to
#: 0) and so are their gradients; a convolution window or a recurrent state that crosses the boundary gives a
#: non-zero gradient however small its weights are (LFM2 with its convolution weights x 1e-3: 2.8e-19 of its own,
#: x 0.1: 2.8e-9, x 1: a logit difference over the value tolerance), and it grows with the weights
STRUCTURAL_TOL = 0.0


def _structural_leak(model: torch.nn.Module, packed: dict, placement: dict, lengths, run_kwargs: dict,
                     device: torch.device, seed: int) -> tuple[float, int] | None:
    """The largest dependence of the first and the last packed document's outputs on the other documents' input
    embeddings, relative to their dependence on their own, and that document's index; None where the model's input
    embeddings cannot be reached.

    Decided by structure, not by the size of a difference at the current weights: one backward per checked document
    of ``<outputs of the document, a fixed random direction>`` to the embedding output (a leaf swapped in by a forward
    hook), whose gradient at every other document's positions is exactly zero when nothing connects them."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        return None
    leaf: list[torch.Tensor] = []

    def swap(module, args, output):
        t = output.detach().requires_grad_(True)
        leaf.append(t)
        return t

    handle = emb.register_forward_hook(swap)
    gen = torch.Generator().manual_seed(seed + 1)
    worst, worst_doc = 0.0, -1
    try:
        with torch.enable_grad():
            inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in packed.items()}
            out = _output_tensor(model(**inputs, **run_kwargs)).float()
            x = leaf[-1]
            first, last = min(placement), max(placement)  # backward-looking and forward-looking leaks
            for i, (r, off) in placement.items():
                if i not in (first, last):
                    continue
                n = lengths[i]
                direction = torch.randn(out[r, off:off + n].shape, generator=gen).to(out.device)
                (g,) = torch.autograd.grad((out[r, off:off + n] * direction).sum(), x, retain_graph=True)
                g = g.detach().abs()
                own = float(g[r, off:off + n].max())
                g[r, off:off + n] = 0.0
                other = float(g.max())
                rel = other / own if own > 0 else (float("inf") if other > 0 else 0.0)
                if rel > worst:
                    worst, worst_doc = rel, i
    finally:
        handle.remove()
    return worst, worst_doc


def check_model_packs_correctly(
    model: torch.nn.Module,
    attn_implementation: str | None = None,
    *,
    mode: Literal["varlen", "rows"] = "varlen",
    token_budget: int | None = None,
    max_sequence_length: int | None = None,
    lengths: tuple[int, ...] | None = None,
    tolerance: float | None = None,
    position_ids_start: int | None = None,
    seed: int = 0,
    raise_on_failure: bool = True,
) -> PackingCheckReport:
    """Packed-vs-separate forward on ``model``; raise :class:`PackingCheckError` if packing changes the logits.

    The ground truth is each sequence run ALONE the way the model runs it by default: ``input_ids`` only, the
    model's own positions. So a model whose positions start at an offset (RoBERTa-style causal LMs start at
    ``padding_idx + 1``) is compared with what it computes in unpacked training, and the first position is
    detected from behaviour (the start ``k`` for which ``position_ids = k, k+1, ...`` reproduces the default
    run; reported as ``position_ids_start`` for the collator). The probe row is ``token_budget`` tokens long
    (:func:`probe_lengths`), so behaviour that depends on the row's length (dynamic RoPE scaling: frequencies
    follow the longest position in the row) shows up. A model that cannot run its longest probe sequence alone
    (a position table shorter than the budget) is probed with that sequence halved until it runs: longer
    samples could not be trained unpacked either.

    Args:
        model: a transformers model (causal LM or base model); run in eval mode under ``no_grad``, then restored.
        attn_implementation: run the probe with this implementation (restored afterwards); ``None``: the model's
            current one. :data:`~hf_gradfix.packing.attention.REFERENCE_VARLEN_ATTENTION` and
            :data:`~hf_gradfix.packing.attention.TORCH_VARLEN_ATTENTION` are registered on demand.
        mode: pack as :class:`~hf_gradfix.packing.collator.PackedCollator` will in training: ``"varlen"`` (one
            row, ``position_ids`` + ``cu_seq_lens``) or ``"rows"`` (two rows, the shorter one tail-padded).
        token_budget: tokens per packed row in training; ``None``: twice the config's position table, between
            64 and 4096 tokens.
        max_sequence_length: the longest sample training will see (caps the probe's long sequence).
        lengths: explicit probe sequence lengths (at least 2), instead of ``token_budget``'s layout.
        tolerance: max allowed |packed - separate| logit difference; default ``1e-4`` (fp32/fp64) or ``3e-2``
            (half-precision weights, or autocast on) times ``max(1, max |logit|)``.
        position_ids_start: first position of every packed sequence; ``None``: detected (see above).
        seed: seed of the probe's own generator (the global RNG is not touched).
        raise_on_failure: ``False`` returns the failing report instead of raising.

    Always sets ``model.config.use_cache = False`` (and passes ``use_cache=False``): a cache built in ``forward``
    disables packed-sequence detection on sdpa/eager. The error message names the model class, the attention
    implementation and the reason.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...                   num_key_value_heads=2, vocab_size=64, initializer_range=0.2, attn_implementation="sdpa")
    >>> model = LlamaForCausalLM(cfg)
    >>> report = check_model_packs_correctly(model, token_budget=128)
    >>> report.passed, report.lengths, report.position_ids_start, model.config.use_cache
    (True, (7, 101, 11, 9), 0, False)
    >>> report.max_diff < 1e-5 < 1e-2 < report.control_diff
    True
    """
    if mode not in ("varlen", "rows"):
        raise InvalidArgumentError(f"mode must be 'varlen' or 'rows', got {mode!r}")
    cls_name = type(model).__name__
    config = getattr(model, "config", None)
    if lengths is None:
        if token_budget is None:
            table = _position_table(config)
            token_budget = min(4096, max(64, 2 * table)) if table else 256
        lengths = probe_lengths(token_budget, max_sequence_length)
    lengths = tuple(int(n) for n in lengths)
    if len(lengths) < 2 or min(lengths) < 1:
        raise InvalidArgumentError(f"lengths must hold at least 2 positive sequence lengths, got {lengths}")
    if position_ids_start is not None and (isinstance(position_ids_start, bool) or not isinstance(position_ids_start, int) or position_ids_start < 0):
        raise InvalidArgumentError(f"position_ids_start must be a non-negative int or None, got {position_ids_start!r}")
    if attn_implementation == REFERENCE_VARLEN_ATTENTION:
        register_reference_varlen_attention()
    elif attn_implementation == TORCH_VARLEN_ATTENTION:
        register_torch_varlen_attention()
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False

    vocab = _vocab_size(model)
    device = _device(model)
    gen = torch.Generator().manual_seed(seed)
    pad_id = getattr(config, "pad_token_id", None)
    pad_id = int(pad_id) if isinstance(pad_id, int) and 0 <= pad_id < vocab else None

    def tokens(n: int) -> torch.Tensor:
        # never the pad id: unpadded samples have none, and RoBERTa-style models give it a special position
        t = torch.randint(0, vocab - (pad_id is not None), (n,), generator=gen)
        return t + (t >= pad_id).long() if pad_id is not None else t

    seqs = [tokens(n) for n in lengths]
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}

    def run(**inputs: Any) -> torch.Tensor:
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        return _output_tensor(model(**inputs, **extra)).float()

    def refusal(reason: str, exc: BaseException | None, **more: Any) -> PackingCheckReport:
        report = PackingCheckReport(
            cls_name, impl_used, mode, tuple(int(s.numel()) for s in seqs), float("inf"), float("inf"),
            float("nan"), float("nan"), False, reason, {**details, **more},
        )
        return _fail(report, raise_on_failure, exc)

    modes = probe_mode(model)  # eval, quantized layers as they are, modes put back
    impl_used = getattr(config, "_attn_implementation", None)
    details: dict[str, Any] = {}
    longest = max(range(len(seqs)), key=lambda i: (lengths[i], -i))
    try:
        modes.__enter__()
        with use_attention_implementation(model, attn_implementation) as impl_used, torch.no_grad():
            # 1. every sequence alone, as unpacked training runs it: input_ids only, the model's own positions
            separate: list[torch.Tensor | None] = [None] * len(seqs)
            for i in sorted(range(len(seqs)), key=lambda i: i == longest):
                try:
                    separate[i] = run(input_ids=seqs[i].unsqueeze(0))[0]
                except Exception as e:
                    shorter = seqs[i].numel() // 2
                    floor = max(n for j, n in enumerate(lengths) if j != i)
                    if i != longest or shorter < floor:
                        first = str(e).splitlines()[0][:200] if str(e) else ""
                        return refusal(
                            f"it raised {type(e).__name__} on a single unpacked sequence of {seqs[i].numel()} tokens "
                            f"({first}); it does not support this attention implementation", e, exception=repr(e)
                        )
                    # the position table is shorter than the budget: halve until the model runs it alone
                    while True:
                        try:
                            separate[i] = run(input_ids=seqs[i][:shorter].unsqueeze(0))[0]
                            break
                        except Exception:
                            shorter //= 2
                            if shorter < floor:
                                raise
                    details["longest_sequence_run_alone"] = shorter
                    seqs[i] = seqs[i][:shorter]
            lengths = tuple(int(s.numel()) for s in seqs)
            shapes = [tuple(q.shape) for q in separate]  # type: ignore[union-attr]
            if any(len(shape) < 2 or shape[0] != n for shape, n in zip(shapes, lengths)):
                return refusal(
                    f"its output is not one vector per token (shape {shapes[0]} for a sequence of {lengths[0]} "
                    "tokens: a sequence-level head, one value per sample), so a packed row's samples cannot be told "
                    "apart", None, fix="Train it unpacked: remove packing.enabled (no attention implementation "
                                        "changes what its head computes).")
            scale = max(1.0, max(float(q.abs().max()) for q in separate))  # type: ignore[union-attr]
            if tolerance is None:
                half = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()) or \
                    torch.is_autocast_enabled(device.type)  # fp32 weights under autocast compute in half precision
                tolerance = (3e-2 if half else 1e-4) * scale

            # 2. the model's own first position, by behaviour
            probe = max((i for i in range(len(seqs)) if i != longest), key=lambda i: (lengths[i], -i))
            start = position_ids_start
            if start is None:
                candidates = list(dict.fromkeys([0, *([pad_id + 1] if pad_id is not None else []), 1, 2, 3]))
                s = seqs[probe]
                tried = {}
                for k in candidates:
                    try:
                        d = float((run(input_ids=s.unsqueeze(0), position_ids=torch.arange(k, k + s.numel()).unsqueeze(0))[0] - separate[probe]).abs().max())  # type: ignore[operator]
                    except Exception as e:  # the packed run below reports a model that refuses position_ids
                        tried[k] = repr(e)
                        continue
                    tried[k] = d
                    if d <= tolerance:
                        start = k
                        break
                details["position_start_diffs"] = tried
                if start is None:
                    if all(isinstance(v, str) for v in tried.values()):
                        start = 0
                    else:
                        return refusal(
                            "run alone, its default positions are not consecutive from any first position in "
                            f"{candidates} (position_ids = k, k+1, ... never reproduces them; max diffs "
                            f"{ {k: (round(v, 4) if isinstance(v, float) else 'error') for k, v in tried.items()} }), so "
                            "restarted position_ids in a packed row cannot reproduce unpacked training", None,
                        )

            # 3. the packed row, built by the collator exactly as in training
            collator = PackedCollator(mode=mode, pad_token_id=0 if pad_id is None else pad_id, position_ids_start=start)
            if mode == "varlen":
                index_bins = [list(range(len(seqs)))]
            else:  # two rows, the second one shorter so that it gets a padded tail
                half_n = max(1, len(seqs) // 2)
                index_bins = [list(range(half_n)), list(range(half_n, len(seqs)))]
                if sum(lengths[half_n:]) >= sum(lengths[:half_n]):
                    index_bins = index_bins[::-1]
            packed = collator([[{"input_ids": seqs[i]} for i in b] for b in index_bins])
            packed.pop("labels")
            placement: dict[int, tuple[int, int]] = {}
            for r, b in enumerate(index_bins):
                off = 0
                for i in b:
                    placement[i] = (r, off)
                    off += lengths[i]
            try:
                out = run(**packed)
            except Exception as e:  # a model that cannot run this attention implementation or packed inputs
                first = str(e).splitlines()[0][:200] if str(e) else ""
                return refusal(
                    f"it raised {type(e).__name__} on packed inputs ({first}); it does not support this attention "
                    "implementation / packed format", e, exception=repr(e)
                )
            # 3b. a row holding ONE document, as the collator builds it (cu_seq_lens [0, n] in varlen mode): the last
            # row of an epoch or a stream often is one, and so is every row when documents are as long as the budget.
            # A layer may take another path there (a torch fallback that refuses any cu_seq_lens); measured, not assumed.
            single = collator([[{"input_ids": seqs[probe]}]])
            single.pop("labels")
            try:
                alone = run(**single)[0]
            except Exception as e:  # noqa: BLE001 - refused in one line before any step, never a crash at a step
                first = str(e).splitlines()[0][:200] if str(e) else ""
                return refusal(
                    f"it raised {type(e).__name__} on a packed row holding one document ({first}); such a row comes "
                    "at the end of every epoch or stream", e, exception=repr(e)
                )
            details["one_document_diff"] = float((alone - separate[probe]).abs().max())  # type: ignore[operator]
            # 4. control: the same row WITHOUT restarted positions (and without cu_seq_lens): what mixing looks
            # like. A row past the position table cannot run that way; then the short sequences alone form it.
            control_seqs: list[int] = sorted(placement)
            width = packed["input_ids"].shape[1]
            plain = torch.arange(start, start + width).expand_as(packed["input_ids"])
            control_placement = placement
            try:
                control = run(input_ids=packed["input_ids"], position_ids=plain)
            except Exception as e:
                details["control_exception"] = repr(e)
                control_seqs = [i for i in range(len(seqs)) if i != longest]
                row = torch.cat([seqs[i] for i in control_seqs]).unsqueeze(0)
                control_placement, off = {}, 0
                for i in control_seqs:
                    control_placement[i] = (0, off)
                    off += lengths[i]
                try:
                    control = run(input_ids=row, position_ids=torch.arange(start, start + off).unsqueeze(0))
                except Exception as e2:  # pragma: no cover
                    control = None
                    details["control_exception"] = repr(e2)
    finally:
        modes.__exit__(None, None, None)

    def part(t: torch.Tensor, where: dict[int, tuple[int, int]], i: int) -> torch.Tensor:
        r, off = where[i]
        return t[r, off : off + lengths[i]]

    diffs = [float((part(out, placement, i) - separate[i]).abs().max()) for i in range(len(seqs))]  # type: ignore[operator]
    leak = None
    if max(diffs) <= tolerance:  # the values agree at these weights: does any path connect the documents at all?
        # on a short row of three documents (a structural path shows at any length; two backwards of ~20 tokens):
        # the last document's outputs against the others' tokens, and the first's (a non-causal path)
        short_lengths = (6, 9, 5)
        short = [tokens(n) for n in short_lengths]
        short_bins = [[0, 1, 2]] if mode == "varlen" else [[0, 1], [2]]
        short_batch = collator([[{"input_ids": short[i]} for i in b] for b in short_bins])
        short_batch.pop("labels")
        short_placement = {}
        for r, b in enumerate(short_bins):
            off = 0
            for i in b:
                short_placement[i] = (r, off)
                off += short_lengths[i]
        try:
            with probe_mode(model), use_attention_implementation(model, attn_implementation):
                leak = _structural_leak(model, short_batch, short_placement, short_lengths, extra, device, seed)
        except Exception as e:  # noqa: BLE001 - a model whose forward cannot run with gradients: the value check stands
            details["structural_check_exception"] = repr(e)
        if leak is not None:
            details["structural_leak"] = leak[0]
    max_diff = max(diffs)
    first_seq = index_bins[0][0]
    first_diff = diffs[first_seq]
    control_diff = packed_vs_control = float("nan")
    if control is not None:
        control_diff = max(float((part(control, control_placement, i) - separate[i]).abs().max()) for i in control_seqs)  # type: ignore[operator]
        if control_placement is placement:
            packed_vs_control = max(float((part(out, placement, i) - part(control, placement, i)).abs().max()) for i in control_seqs)
    details.update(per_sequence_diff=diffs, packed_vs_control=packed_vs_control, logit_scale=scale)
    if start:
        details["position_offset_note"] = (
            f"the model starts positions at {start} on its own: packed rows must restart position_ids at {start}"
        )

    reason = None
    if leak is not None and leak[0] > STRUCTURAL_TOL:
        reason = (
            f"the outputs of packed document {leak[1]} depend on the other documents' tokens (gradient "
            f"{leak[0]:.3g} of its own, where the exact answer is 0; its logits differ by only {max_diff:.3g} at "
            "these weights, a gap that grows as the weights do): a layer carries state across the document boundary "
            "(a convolution window or a recurrent / linear-attention state that the packed inputs do not reset); "
            "train this model unpacked (packing.enabled: false)"
        )
    elif max_diff > tolerance:
        flash = isinstance(impl_used, str) and "flash" in impl_used
        where = "cu_seq_lens / position_ids" if flash else "position_ids"
        if first_diff > tolerance:
            reason = (
                f"the first sequence of the packed row, which no other sequence precedes, differs from its separate "
                f"run (max diff {first_diff:.3g}): its output depends on what follows it in the row or on the row's "
                f"length (longest sequence {max(lengths)} tokens), e.g. dynamic RoPE scaling, whose frequencies "
                "follow the largest position in the row, or non-causal layers"
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
    elif details["one_document_diff"] > tolerance:
        reason = (
            f"a packed row holding one document differs from that document run alone (max diff "
            f"{details['one_document_diff']:.3g}): the model computes something else on a one-document row (its "
            "cu_seq_lens / position_ids), which the end of every epoch or stream trains on"
        )
    elif not (control_diff > 10 * max_diff) or not (control_diff > tolerance):
        reason = (
            f"inconclusive: the probe cannot tell packed from mixed sequences (control diff {control_diff:.3g} vs "
            f"packed diff {max_diff:.3g}); use longer probe lengths or a trained model"
        )
    if reason is not None and ("depend on the other documents' tokens" in reason or "attend to each other" in reason):
        # rows mode on a flash path: the attention mixes the rows' documents (FlashAttention separates them only in
        # one row with cu_seq_lens), which the probe row, packed in varlen mode, cannot show: that reason stands
        flash_rows = mode == "rows" and isinstance(impl_used, str) and "flash" in impl_used
        reason = _located(model, reason, details, structural=leak is not None and leak[0] > STRUCTURAL_TOL,
                          max_diff=max_diff, keep=flash_rows)
    report = PackingCheckReport(
        cls_name, impl_used, mode, lengths, max_diff, first_diff, control_diff, float(tolerance), reason is None,
        reason, details, start,
    )
    if reason is not None:
        return _fail(report, raise_on_failure, None)
    return report


def _located(model: torch.nn.Module, reason: str, details: dict, *, structural: bool, max_diff: float,
             keep: bool = False) -> str:
    """The refusal's reason, saying what carries one document into the next as measured by
    :func:`hf_gradfix.packing.state_reset.probe_sequence_mixers` (each kind of decoder-layer child replayed on a probe
    row, and whether a document mask stops it): the layers and what they carry (an attention that ignores the
    boundaries, or a recurrent / convolution state), or that none could be located and what was measured."""
    from .state_reset import probe_sequence_mixers

    mixers = probe_sequence_mixers(model)  # the localization words the reason: the verdict stands without it
    trainer = " (hf_gradfix's packing through the Trainer runs those once per document, see docs/packing.md)"
    if mixers is None:
        return reason + ("; the layer could not be located: the probe row that replays each decoder-layer child "
                         "did not run on this model")
    if not mixers:
        if keep:
            return reason
        if not structural:  # nothing measured says attention: the numbers, not a guess
            reason = f"packed documents reach each other (max diff {max_diff:.3g}, restarted position_ids do not keep them apart)"
        return reason + ("; no decoder-layer child could be located as the path (each kind of child of the decoder "
                         "layers was replayed with gradients on a probe row of 3 documents packed in varlen mode: none "
                         "carried one document into another), so the documents meet outside those children: in the embeddings, between the "
                         "layers or in a model-level mixing, which running layers once per document cannot fix")
    details["leaking_layers"] = "; ".join(m.label for m in mixers)
    attention = [m.label for m in mixers if m.kind == "attention"]
    state = [m.label for m in mixers if m.kind != "attention"]
    parts = []
    if attention:
        parts.append(f"measured in {', '.join(attention)}: an attention that ignores the document boundaries (a "
                     "document mask handed to it stops the leak)")
    if state:
        parts.append(f"measured in {', '.join(state)}: a recurrent or convolution state carried along the sequence "
                     "(restarted positions do not reset it, and a document mask does not stop it)")
    if not state:  # attention: the attention wording stands, with the layers named
        return reason.replace("its attention ignores", "it ignores") + "; " + "; ".join(parts) + trainer
    if structural:  # the structural reason already says a state is carried; name where
        return reason + "; " + "; ".join(parts) + trainer
    return (f"packed documents reach each other (max diff {max_diff:.3g}); "
            + "; ".join(parts) + trainer)


def _fail(report: PackingCheckReport, raise_on_failure: bool, cause: BaseException | None) -> PackingCheckReport:
    if not raise_on_failure:
        return report
    control = (f"; without restarted positions {report.control_diff:.3g}"
               if report.control_diff == report.control_diff else "")  # nan: no control run (the CP probe)
    numbers = (
        f" (max |packed - separate| logit diff {report.max_diff:.3g} > tolerance {report.tolerance:.3g}; "
        f"first sequence {report.first_sequence_diff:.3g}{control})"
        if report.max_diff != float("inf")
        else ""
    )
    fix = report.details.get("fix") or ("Train it unpacked (padded batches), or with an attention implementation "
                                        "that passes this check.")
    err = PackingCheckError(
        f"{report.model_class} cannot be trained on packed sequences with attn_implementation="
        f"{report.attn_implementation!r} (mode={report.mode!r}): {report.reason}{numbers}. {fix}"
    )
    err.report = report  # type: ignore[attr-defined]
    if cause is not None:
        raise err from cause
    raise err


def check_model_packs_under_cp(
    model: torch.nn.Module,
    cp: int,
    *,
    lengths: tuple[int, ...] = (5, 11, 3, 7),
    tolerance: float | None = None,
    seed: int = 0,
    raise_on_failure: bool = True,
    balance: str = "per_document",
    threshold: int | None = 6,
) -> PackingCheckReport:
    """The context-parallel packing path (:mod:`hf_gradfix.parallel.context_packing`) on ``model``, in one process:
    a packed row laid out as ``cp`` ranks would hold it (documents padded, permuted by the ``balance`` load
    balancer, positions permuted with the tokens), every attention call given the document mask over the whole
    permuted row, versus each sequence alone. Refuses (:class:`PackingCheckError`) a model whose attention never
    reaches ``torch.nn.functional.scaled_dot_product_attention`` (so it cannot take the mask), or whose output
    under that layout differs (attention or positions read from anything but the mask and ``position_ids``).
    ``threshold`` (``balance="long_documents"``): the probe's own, so that its row holds both kinds, documents cut
    over the ranks and documents dealt whole (at cp 2: 11 and 7 tokens cut, 5 and 3 whole).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...                   num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")
    >>> report = check_model_packs_under_cp(LlamaForCausalLM(cfg), cp=2)
    >>> report.passed, report.mode, report.details["attention_calls"], report.max_diff < 1e-5
    (True, 'cp=2', 1, True)
    """
    from ..parallel.context_packing import PackedLayout, packed_attention_block

    cls_name = type(model).__name__
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    vocab = _vocab_size(model)
    device = _device(model)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    extra = {"use_cache": False} if _accepts(model, "use_cache") else {}
    modes = probe_mode(model)
    modes.__enter__()
    details: dict[str, Any] = {}
    try:
        with torch.no_grad():
            alone = [_output_tensor(model(input_ids=s[None].to(device), **extra)).float()[0] for s in seqs]
            batch = {"input_ids": torch.cat(seqs)[None],
                     "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
            layout = PackedLayout.build(batch, cp, pad_token_id=0, balance=balance, threshold=threshold)
            calls = [0]
            with packed_attention_block(layout.full_mask().to(device), None, calls):
                out = _output_tensor(model(input_ids=layout.permuted("input_ids").to(device),
                                           position_ids=layout.permuted("position_ids").to(device), **extra)).float()[0]
    except Exception as exc:  # noqa: BLE001 - any failure of the probe is a refusal with its reason
        report = PackingCheckReport(cls_name, impl, f"cp={cp}", tuple(lengths), float("inf"), float("inf"),
                                    float("nan"), float("nan"), False,
                                    f"its forward fails on the context-parallel packed layout ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})", details)
        return _fail(report, raise_on_failure, exc)
    finally:
        modes.__exit__(None, None, None)
    original = torch.empty_like(out)
    original[layout.indices[0].to(out.device)] = out  # back to the padded row's order
    starts = [sum(layout.doc_lengths[0][:i]) for i in range(len(lengths))]
    diffs = [float((original[a:a + n] - ref).abs().max()) for a, n, ref in zip(starts, lengths, alone)]
    scale = max(1.0, max(float(r.abs().max()) for r in alone))
    tol = (tolerance if tolerance is not None else 1e-4) * scale
    details["attention_calls"] = calls[0]
    reason = None
    if calls[0] == 0:
        reason = ("its attention never calls torch.nn.functional.scaled_dot_product_attention, so it cannot take the "
                  "document mask that context parallelism needs (load the model with attn_implementation='sdpa')")
    elif max(diffs) > tol:
        reason = ("under the context-parallel layout (documents split and permuted over the cp ranks) a document's "
                  "output differs from the document alone: the model reads something besides the attention mask and "
                  "position_ids that depends on token order")
    report = PackingCheckReport(cls_name, impl, f"cp={cp}", tuple(lengths), max(diffs), diffs[0], float("nan"),
                                tol, reason is None, reason, details)
    if reason is not None:
        return _fail(report, raise_on_failure, None)
    return report
