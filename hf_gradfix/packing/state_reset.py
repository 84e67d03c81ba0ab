"""Documents kept apart in the layers that carry state along the sequence: linear attention, convolution, SSM.

Attention keeps packed documents apart through its mask (restarted ``position_ids`` / ``cu_seq_lens``). A layer that
carries a recurrent state or a convolution window along the sequence (Gated DeltaNet in Qwen3.5 / Qwen3-Next /
OLMo-hybrid, LFM2's short convolution, the Mamba mixers of Bamba / Jamba / Falcon-H1 / Nemotron-H / Zamba2 /
granite-hybrid) does not: in transformers 5.24 the torch fallbacks swallow ``cu_seqlens`` / ``seq_idx`` in
``**kwargs``, so the state of one document flows into the next (transformers#46093, axolotl#3453).

What this module does, by behaviour rather than by a list of classes:

1. :func:`find_sequence_mixers` runs one packed probe row through the model with a forward pre-hook on every child
   of its decoder layers (the longest ``ModuleList``), then replays each kind of child (attribute name and type, the
   first instance) on its recorded inputs with the hidden states as a leaf: a child through which the gradient of one
   document's outputs reaches another document's positions carries state across the boundary (exactly zero for
   attention under the document mask, for MLPs and norms; non-zero for a convolution window or a recurrent state at
   any weight scale).
2. :func:`split_documents` replaces the forward of every instance of those kinds (on the model instance, reversibly)
   by a loop that calls the original forward once per document of each packed row, on that document's slice of
   every per-token input, and concatenates the outputs: the state and the convolution window start from zero at
   every boundary, whatever kernel runs underneath (torch fallback, fla, causal-conv1d, mamba-ssm). The boundaries are
   the restarted ``position_ids`` of the model's latest forward (transformers' own rule, ``diff != 1``), read by a
   forward pre-hook on the model; they stay until the next forward, so the recomputation of gradient checkpointing
   in backward splits at the same places. A forward with a cache (generation) runs unsplit; one whose rows each hold
   one document (no restart) runs in one call, without the varlen keywords (a torch fallback refuses them).

3. The kernels' own boundaries first, where they keep the documents apart: every kind found in 1 is replayed once
   more as :func:`handoff_call` runs it in training: the packed rows flattened into one row, with the boundaries in
   the keywords the kernels behind transformers 5.x's mixers read (``seq_idx``: causal-conv1d and mamba-ssm, the
   document index of every token; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and their maxima: transformers' varlen
   convention, which Gated DeltaNet hands to fla's ``cu_seqlens``). Where that replay measures no leak, in eval and in
   training mode, the kind is *handed off* (one call per layer, the kernels reset the state and the window at every
   boundary); where it raises or leaks it is split as in 2. The decision is the measurement, on the machine that
   trains: transformers 5.x's torch fallbacks refuse ``seq_idx`` / ``cu_seqlens`` outright (a ``ValueError``), and
   4.57's mixers do not take them (a ``TypeError``) or ignore them off CUDA (a leak), so on a CPU, or on a GPU without
   fla / causal-conv1d / mamba-ssm, every kind is split; a kernel that takes the keyword and ignores it leaks in the
   replay and is split as well.

Why splitting is the fallback rather than the rule: it needs no knowledge of each family's internals and is exact
whatever runs underneath, at one mixer call per document (measured in ``benchmarks/bench_packing_hybrid.py``); the
hand-off is one call per layer, which is what the varlen kernels are for.

>>> import torch
>>> rows = segment_bounds(torch.tensor([[0, 1, 2, 0, 1]]))
>>> rows
[[(0, 3), (3, 5)]]
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..probe_mode import probe_mode

__all__ = ["SequenceMixer", "DocumentSplit", "find_sequence_mixers", "probe_sequence_mixers", "split_documents",
           "segment_bounds", "handoff_call", "describe"]

_ORIGINAL_ATTR = "_hf_gradfix_unsplit_forward"
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k")
_MAX_LEN_KEYS = ("max_length_q", "max_length_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k")


@dataclass
class SequenceMixer:
    """One kind of decoder-layer child that carries state across a packed boundary: its attribute name, type name,
    the module names of every instance, and the measured leak (the other documents' gradient, relative to the own)."""

    attribute: str
    type_name: str
    modules: list[str]
    leak: float
    #: the kernels keep the documents apart when given the boundaries (measured by :func:`handoff_call`'s replay):
    #: one call per layer instead of one per document
    handoff: bool = False
    #: what carries one document into the next, measured (:func:`_leak_kind`): ``"attention"`` (a document mask
    #: handed to it as its attention mask stops the leak: an attention that ignores the boundaries) or ``"state"``
    #: (it takes no such mask, or the leak stays with it: a recurrent or convolution state along the sequence)
    kind: str = "state"

    @property
    def label(self) -> str:
        return f"{self.attribute} ({self.type_name}, {len(self.modules)} layer(s))"


def describe(mixers: list[SequenceMixer]) -> str:
    """What the fix line says about ``mixers``: which run one by one, which the kernels keep apart.

    >>> describe([SequenceMixer("conv", "Lfm2ShortConv", ["model.layers.0.conv"], 0.3)])
    'documents run one by one through conv (Lfm2ShortConv, 1 layer(s))'
    """
    split = ", ".join(m.label for m in mixers if not m.handoff)
    handed = ", ".join(m.label for m in mixers if m.handoff)
    parts = [f"documents run one by one through {split}"] if split else []
    if handed:
        parts.append(f"documents kept apart by the kernels (seq_idx / cu_seq_lens) in {handed}")
    return ", ".join(parts)


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, end)`` of every document: a new one wherever ``diff(position_ids) != 1``."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to("cpu")
    starts = torch.ones_like(pos, dtype=torch.bool)
    if pos.shape[1] > 1:
        starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    rows = []
    for r in range(pos.shape[0]):
        idx = starts[r].nonzero().flatten().tolist() + [pos.shape[1]]
        rows.append(list(zip(idx[:-1], idx[1:])))
    return rows


def _decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    best = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
                any(True for _ in m.parameters()) for m in module):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    return best


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    h = args[0] if args else kwargs.get("hidden_states")
    return h if isinstance(h, torch.Tensor) and h.dim() == 3 and h.is_floating_point() else None


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def find_sequence_mixers(model: torch.nn.Module, batch: dict, run_kwargs: dict | None = None, *,
                         seed: int = 0) -> list[SequenceMixer]:
    """The kinds of decoder-layer children through which one packed document reaches another (see the module
    docstring). ``batch``: a packed batch (``input_ids`` + restarted ``position_ids``, several documents per row), run
    once without gradients; each kind is then replayed with gradients (one backward per kind)."""
    found = _decoder_layers(model)
    if found is None:
        return []
    layers_name, layers = found
    kinds: dict[tuple[str, str], list[str]] = {}
    for i, layer in enumerate(layers):
        for attr, child in layer.named_children():
            kinds.setdefault((attr, type(child).__name__), []).append(f"{layers_name}.{i}.{attr}")
    modules = dict(model.named_modules())
    recorded: dict[tuple[str, str], tuple[tuple, dict]] = {}
    handles = []

    def recorder(key):
        def hook(module, args, kwargs):
            if key not in recorded and _hidden_of(args, kwargs) is not None:
                recorded[key] = (args, dict(kwargs))
        return hook

    for key, names in kinds.items():
        handles.append(modules[names[0]].register_forward_pre_hook(recorder(key), with_kwargs=True))
    try:
        with torch.no_grad():  # no cache: a cache carries the state itself, updated in place (generation's path)
            try:
                model(**batch, **{"use_cache": False, **(run_kwargs or {})})
            except (ValueError, NotImplementedError):
                # a layer that refuses the varlen keys on this path (Qwen3.5's torch fallback raises on cu_seqlens):
                # the row again with restarted positions only (attention reads the boundaries from them)
                recorded.clear()
                slim = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
                model(**slim, **{"use_cache": False, **(run_kwargs or {})})
    finally:
        for h in handles:
            h.remove()
    bounds = segment_bounds(batch["position_ids"])
    gen = torch.Generator().manual_seed(seed)
    mixers = []
    for key, (args, kwargs) in recorded.items():
        hidden = _hidden_of(args, kwargs)
        if hidden is None or tuple(hidden.shape[:2]) != (len(bounds), int(batch["position_ids"].shape[-1])):
            continue
        module = modules[kinds[key][0]]
        leak = _replay_leak(module, args, kwargs, hidden, bounds, gen)
        if leak > 0.0:
            mixers.append(SequenceMixer(key[0], key[1], kinds[key], leak,
                                        handoff=_handoff_keeps_apart(module, args, kwargs, hidden, bounds, gen),
                                        kind=_leak_kind(module, args, kwargs, hidden, bounds, gen)))
    return mixers


def _leak_kind(module, args, kwargs, hidden, bounds, gen) -> str:
    """``"attention"`` where a document mask given to ``module`` as its ``attention_mask`` (the one it got, restricted
    to each document; an additive causal one where it got none) removes every path from one document to another;
    ``"state"`` where the leak stays, or the module takes no such mask (a recurrent or convolution state)."""
    import inspect

    rows, width = int(hidden.shape[0]), int(hidden.shape[1])
    doc = torch.zeros(rows, width, dtype=torch.long)
    for r, row in enumerate(bounds):
        for k, (a, b) in enumerate(row):
            doc[r, a:b] = k
    keep = (doc[:, :, None] == doc[:, None, :]) & torch.ones(width, width, dtype=torch.bool).tril()
    keep = keep[:, None].to(hidden.device)  # [rows, 1, T, T]
    given = kwargs.get("attention_mask")
    if isinstance(given, torch.Tensor) and given.dim() == 4 and tuple(given.shape[-2:]) == (width, width):
        mask = given & keep if given.dtype == torch.bool else given.masked_fill(~keep, torch.finfo(given.dtype).min)
    elif given is None:
        try:
            takes = "attention_mask" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if not takes:
            return "state"
        mask = torch.zeros(keep.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
            ~keep, torch.finfo(hidden.dtype).min)
    else:  # a 2-D padding mask: the module is not handed pairwise masks
        return "state"
    try:
        leak = _replay_leak(module, args, {**kwargs, "attention_mask": mask}, hidden, bounds, gen)
    except Exception:  # noqa: BLE001 - a module that cannot take a [rows, 1, T, T] mask
        return "state"
    return "attention" if leak == 0.0 else "state"


def _handoff_keeps_apart(module, args, kwargs, hidden, bounds, gen) -> bool:
    """Whether ``module`` keeps the documents apart when :func:`handoff_call` gives it the boundaries, in eval and in
    training mode (a mixer may take another kernel while training: Bamba's fused split-conv1d-scan): by structure (no
    gradient of one document's outputs reaches another's positions, exactly), and its outputs those of each document
    run alone (a kernel that reads the keyword but means something else by it computes other values)."""
    def call(*a, **kw):
        return handoff_call(module, a, kw, bounds)

    try:
        for training in (False, True):
            if _replay_leak(module, args, kwargs, hidden, bounds, gen, call=call, training=training) != 0.0:
                return False
            with probe_mode(module, training), torch.no_grad():
                got = _first_tensor(call(*args, **kwargs))
                alone = _first_tensor(_per_document_call(module, args, kwargs, bounds))
            if got is None or alone is None or got.shape != alone.shape:
                return False
            # The same weights and kernel on other segment lengths: a rounding apart (GPU kernels run fp32 matmuls in
            # tf32, ~1e-3). What this catches is a keyword meaning something else (O(1) apart); the leak is decided
            # above, exactly.
            tol = 1e-2 if alone.dtype in (torch.float32, torch.float64) else 5e-2
            scale = float(alone.float().norm()) or 1.0
            if not float((got.float() - alone.float()).norm()) <= tol * scale:
                return False
        return True
    except Exception:  # noqa: BLE001 - a torch fallback refusing seq_idx / cu_seqlens, a kernel's shape assertion
        return False


def probe_sequence_mixers(model: torch.nn.Module) -> list[SequenceMixer] | None:
    """:func:`find_sequence_mixers` on the plugin's probe row (3 random documents of 5, 7 and 4 tokens, packed by
    :class:`~hf_gradfix.packing.collator.PackedCollator` as in training), the model in eval mode and the RNG left as
    it was; None where the model cannot run a packed row (the guard then decides, in its own words)."""
    from .collator import PackedCollator

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = int(getattr(emb, "num_embeddings", 0) or 0)
    if vocab < 4:
        return []
    gen = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(1, vocab - 1, (n,), generator=gen).tolist()} for n in (5, 7, 4)]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batch = PackedCollator(mode="varlen")(docs)
    probe = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    try:
        with probe_mode(model), torch.random.fork_rng(
                devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            return find_sequence_mixers(model, probe)
    except Exception:  # noqa: BLE001 - a model that cannot run a packed row
        return None


def _replay_leak(module, args, kwargs, hidden, bounds, gen, *, call=None, training: bool = False) -> float:
    # Every per-token hidden input is a leaf (a convolved attention reads key_hidden_states / value_hidden_states
    # too): the leak is measured to all of them, through one shared leaf where they were the same tensor.
    shape = tuple(hidden.shape)
    leaves: dict[int, torch.Tensor] = {}

    def leaf(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point() and tuple(v.shape) == shape:
            if id(v) not in leaves:
                leaves[id(v)] = v.detach().clone().requires_grad_(True)
            return leaves[id(v)]
        return v

    args = tuple(leaf(v) for v in args)
    kwargs = {k: leaf(v) for k, v in kwargs.items()}
    x = leaves[id(hidden)]
    with probe_mode(module, training), torch.enable_grad():
        out = _first_tensor((call or module)(*args, **kwargs))
    if out is None or not out.requires_grad or tuple(out.shape[:2]) != tuple(x.shape[:2]):
        # nothing measurable: no leak for the probe of 1., but never a pass for a hand-off (``call`` given)
        return 0.0 if call is None else float("inf")
    worst = 0.0
    inputs = list(leaves.values())
    for r, row in enumerate(bounds):
        if len(row) < 2:
            continue
        for a, b in (row[0], row[-1]):  # backward- and forward-looking paths
            direction = torch.randn(out[r, a:b].shape, generator=gen).to(out.device, out.dtype)
            grads = torch.autograd.grad((out[r, a:b] * direction).sum(), inputs, retain_graph=True, allow_unused=True)
            own, other = 0.0, 0.0
            for g in grads:
                if g is None:
                    continue
                g = g.detach().abs().float()
                own = max(own, float(g[r, a:b].max()))
                g[r, a:b] = 0.0
                other = max(other, float(g.max()))
            worst = max(worst, other / own if own > 0 else (float("inf") if other > 0 else 0.0))
    return worst


@dataclass
class DocumentSplit:
    """What :func:`split_documents` changed on one model; :meth:`restore` undoes it. ``calls``: per-document mixer calls
    made so far (a packed forward with d documents adds d per wrapped module); ``handoff_calls``: packed forwards of
    a handed-off mixer (one per layer, the boundaries given to the kernels)."""

    model_ref: Any
    modules: list[str]
    hook: Any = None
    bounds: list | None = None
    calls: int = 0
    split_forwards: int = 0
    handoff_calls: int = 0
    _wrapped: list = field(default_factory=list)

    def restore(self) -> int:
        """Put every original forward back and remove the boundary hook. Returns how many modules."""
        n = 0
        for module in self._wrapped:
            original = module.__dict__.get("forward")
            original = getattr(original, _ORIGINAL_ATTR, None)
            if original is not None:
                if original is _CLASS_FORWARD:
                    del module.forward
                else:
                    module.forward = original
                n += 1
        self._wrapped.clear()
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        return n


_CLASS_FORWARD = object()  # marks a module whose forward was the class's (no instance attribute to put back)


def split_documents(model: torch.nn.Module, mixers: list[SequenceMixer]) -> DocumentSplit:
    """Run every module of ``mixers`` once per packed document (see the module docstring). Idempotent: a module
    already split is left as it is. Returns the handle whose ``restore()`` undoes it."""
    existing = getattr(model, "_hf_gradfix_document_split", None)
    if existing is not None and existing.hook is not None:
        split = existing
    else:
        split = DocumentSplit(model_ref=weakref.ref(model), modules=[])

        def keep_bounds(module, args, kwargs):
            pos = kwargs.get("position_ids")
            cache = kwargs.get("past_key_values")
            if isinstance(pos, torch.Tensor) and pos.dim() == 2 and (cache is None or not kwargs.get("use_cache")):
                split.bounds = segment_bounds(pos)  # one document per row too: see _split_forward
            else:
                split.bounds = None

        split.hook = model.register_forward_pre_hook(keep_bounds, with_kwargs=True)
        model._hf_gradfix_document_split = split
    modules = dict(model.named_modules())
    for mixer in mixers:
        for name in mixer.modules:
            module = modules[name]
            if getattr(module.__dict__.get("forward"), _ORIGINAL_ATTR, None) is not None:
                continue
            module.forward = _split_forward(module, split, handoff=mixer.handoff)
            split._wrapped.append(module)
            split.modules.append(name)
    return split


def _split_forward(module: torch.nn.Module, split: DocumentSplit, handoff: bool = False):
    own = module.__dict__.get("forward")
    original = own if own is not None else module.forward  # the bound class forward

    def forward(*args, **kwargs):
        bounds = split.bounds
        hidden = _hidden_of(args, kwargs)
        cache = kwargs.get("cache", kwargs.get("cache_params", kwargs.get("past_key_values")))
        if bounds is None or hidden is None or cache is not None or tuple(hidden.shape[:2]) != (
                len(bounds), sum(b - a for a, b in bounds[0])):
            return original(*args, **kwargs)
        if all(len(row) == 1 for row in bounds):
            return _one_document_call(original, args, kwargs)
        if handoff:
            try:
                out = handoff_call(original, args, kwargs, bounds)
                split.handoff_calls += 1
                return out
            except _CannotFlatten:  # several rows with a [rows, heads, T, T] mask: this call runs per document
                pass
        split.calls += sum(len(row) for row in bounds)
        split.split_forwards += 1
        return _per_document_call(original, args, kwargs, bounds)

    setattr(forward, _ORIGINAL_ATTR, own if own is not None else _CLASS_FORWARD)
    return forward


def _one_document_call(forward, args: tuple, kwargs: dict) -> Any:
    """``forward`` on rows that each hold one document (the last row of an epoch or a stream, documents as long as the
    budget): nothing to keep apart, but the collator's ``cu_seq_lens`` / ``seq_idx`` still reach the mixer, and a
    torch fallback refuses them whatever they say (Qwen3.5's ``chunk_gated_delta_rule`` without fla raises a
    ``ValueError`` on ``cu_seq_lens = [0, n]``): one call, the varlen keywords dropped as for each document of a split
    row, ``seq_idx`` all zeros."""
    one = {}
    for k, v in kwargs.items():
        if k in _VARLEN_KEYS or k in _MAX_LEN_KEYS:
            v = None
        elif k == "seq_idx" and isinstance(v, torch.Tensor):
            v = torch.zeros_like(v)
        one[k] = v
    return forward(*args, **one)


def _per_document_call(forward, args: tuple, kwargs: dict, bounds: list[list[tuple[int, int]]]) -> Any:
    """``forward`` once per document of each row, on that document's slice of every per-token input; the outputs
    concatenated back into rows."""
    width = _hidden_of(args, kwargs).shape[1]
    rows_out = []
    for r, row in enumerate(bounds):
        pieces = []
        for a, b in row:
            sub_args = tuple(_slice(v, r, a, b, len(bounds), width) for v in args)
            sub_kwargs = {k: _slice_kw(k, v, r, a, b, len(bounds), width) for k, v in kwargs.items()}
            pieces.append(forward(*sub_args, **sub_kwargs))
        rows_out.append(_cat(pieces, 1))
    return _cat(rows_out, 0)


class _CannotFlatten(ValueError):
    """The inputs of a hand-off cannot be flattened into one row (raised before the mixer runs)."""


def handoff_call(forward, args: tuple, kwargs: dict, bounds: list[list[tuple[int, int]]]) -> Any:
    """Call ``forward`` once on the packed rows flattened into one row ``[1, rows * width, ...]``, with the document
    boundaries in the keywords the varlen kernels read: ``seq_idx`` (int32 ``[1, tokens]``, the document index of every
    token), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 offsets) and ``max_length_q`` / ``max_length_k``; the output
    goes back to ``[rows, width, ...]``. Flattening is exact for a mixer (per-token work plus a sequence scan that
    restarts at every boundary) and is what fla's ``cu_seqlens`` asks for (one row). A per-pair ``[rows, heads, T, T]``
    mask of several rows cannot be flattened: :class:`_CannotFlatten` (a ``ValueError``) is raised before ``forward``
    runs, and the split's forward runs that call per document instead."""
    hidden = _hidden_of(args, kwargs)
    rows, width = int(hidden.shape[0]), int(hidden.shape[1])
    lengths = [b - a for row in bounds for a, b in row]
    device = hidden.device
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))

    def flat(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (rows, width):
            return v.reshape(1, rows * width, *v.shape[2:])
        if isinstance(v, torch.Tensor) and rows > 1 and v.dim() == 4 and v.shape[0] == rows and v.shape[-1] == width:
            raise _CannotFlatten("a per-pair attention mask of several rows cannot be flattened into one row")
        if isinstance(v, (tuple, list)):
            return type(v)(flat(x) for x in v)
        if isinstance(v, dict):
            return {k: flat(x) for k, x in v.items()}
        return v

    flat_kwargs = {k: flat(v) for k, v in kwargs.items() if k not in _VARLEN_KEYS + _MAX_LEN_KEYS + ("seq_idx",)}
    cu = cu.to(device)
    flat_kwargs.update(seq_idx=seq_idx.to(device)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(lengths), max_length_k=max(lengths))
    out = forward(*(flat(v) for v in args), **flat_kwargs)

    def unflat(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (1, rows * width):
            return v.reshape(rows, width, *v.shape[2:])
        return v

    if isinstance(out, (tuple, list)):
        return type(out)([unflat(out[0])] + [None if isinstance(x, torch.Tensor) and rows > 1 else x for x in out[1:]])
    return unflat(out)


def _slice(v: Any, r: int, a: int, b: int, rows: int, width: int) -> Any:
    if isinstance(v, torch.Tensor):
        if v.dim() == 2 and tuple(v.shape) == (width, width) and not (rows == width):  # an unbatched [T, T] table
            return v[a:b, a:b]
        if v.dim() >= 2 and v.shape[0] == rows:
            if v.dim() == 4 and tuple(v.shape[-2:]) == (width, width):  # a [B, H, T, T] mask
                return v[r:r + 1, :, a:b, a:b]
            if v.shape[1] == width:
                return v[r:r + 1, a:b]
        return v
    if isinstance(v, (tuple, list)):
        return type(v)(_slice(x, r, a, b, rows, width) for x in v)
    if isinstance(v, dict):  # e.g. {"causal": [B, 1, T, T] mask, "conv": None}
        return {k: _slice(x, r, a, b, rows, width) for k, x in v.items()}
    return v


def _slice_kw(key: str, v: Any, r: int, a: int, b: int, rows: int, width: int) -> Any:
    if key in _VARLEN_KEYS or key in _MAX_LEN_KEYS:
        return None  # one document per call: nothing to keep apart (the torch fallbacks refuse cu_seqlens outright)
    if key == "seq_idx" and isinstance(v, torch.Tensor):
        return torch.zeros_like(_slice(v, r, a, b, rows, width))
    return _slice(v, r, a, b, rows, width)


def _cat(pieces: list, dim: int) -> Any:
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return first if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    if isinstance(first, (tuple, list)):
        # the hidden states first; what else a mixer returns per document (eager attention weights [1, H, t, t])
        # does not concatenate into the row's: None, as the varlen kernels return
        return type(first)([_cat([p[0] for p in pieces], dim)] + [
            x if not isinstance(x, torch.Tensor) or len(pieces) == 1 else None for x in first[1:]])
    raise TypeError(f"hf_gradfix packing: a split sequence mixer returned {type(first).__name__}, not a tensor")
