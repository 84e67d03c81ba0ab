"""Activation memory counted from the architecture's own forward, on fake tensors (no storage, no weights).

Fixed formulas do not carry across architectures: the Playbook's ``L s b h (34 + 5 a s / h)`` is off by -28 % /
+56 % on a Llama block (``../shared/research/landscape.md``), and every family differs (gated or plain MLP,
LayerNorm or RMSNorm with an fp32 upcast, fused QKV, QK-norm, dropout masks, MoE experts that see ``top_k``
copies of each token).  So the planner *detects* what a block saves: it builds the model from its config inside
``FakeTensorMode``, runs one forward at the planned micro-batch and sequence length, and counts every distinct
storage that autograd saves for backward (``saved_tensors_hooks``), skipping parameters.  Each saved tensor is
attributed to the decoder layer that saves it, and flagged *tp-split* when it was created inside a module whose
children the model's tp plan splits (attention and MLP: q/k/v, the SDPA output, gate/up and their product);
norms and the residual stream stay replicated under transformers' tp plans (no sequence parallelism).

Attention is traced with a fused kernel's memory profile (q, k, v, output and log-sum-exp saved; no ``s x s``
score matrix), as FlashAttention 2 / SDPA train: ``attention="eager"`` traces the model's eager path instead.
MoE blocks run transformers' ``grouped_mm`` experts; fake tensors only accept that kernel in bf16, so fp32
traces run it through a bf16 shape stand-in (same shapes, fp32 result; autograd still saves the fp32 inputs).

This is one forward of shapes, not a training step: ``--simulate`` (``simulate.py``) traces the whole step.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from ..torch_private import private

_TRACE = "hf-gradfix plan (the traced activation model)"  # what needs torch's private fake-tensor APIs

__all__ = ["ActivationTrace", "InferenceTrace", "trace_activations", "trace_inference", "decoder_layers",
           "TRACE_ATTENTION", "prepare_config", "fake_kernel_mode", "one_sequence_per_row"]

TRACE_ATTENTION = "flash_fused_memory_trace"


@dataclass
class ActivationTrace:
    """Bytes a forward saves for backward, per decoder layer and outside the layers (one micro-batch)."""

    layer_replicated: list[float]  # per layer: saved bytes that tensor parallelism does not divide
    layer_split: list[float]  # per layer: saved bytes created inside tp-split modules (attention, MLP)
    outside: float  # saved outside the layers: embeddings, final norm, the loss's log-softmax
    logits: float  # the logits tensor the output holds
    hidden: float  # one layer input (what full recomputation keeps per layer)
    loss_transient: float  # fp32 loss gradients alive while the loss backward runs (2 x 4 T v)
    attention: str
    # a layer's backward at its peak: what is left of its saved tensors plus the gradients alive at that moment
    # (the most over the layers)
    layer_backward: float = 0.0
    # under full recomputation: the larger of that and the layer's re-run forward (up to its last saved tensor)
    # with the incoming gradient alive
    layer_recompute: float = 0.0
    layer0: list[tuple[str, tuple, str, int]] = field(default_factory=list)  # (where, shape, dtype, bytes)
    # per layer: its backward at its peak (``layer_backward`` is the most of these). Layers differ in a hybrid model
    # (a chunked linear-attention / Mamba layer's backward holds far more than an attention layer's), and the layers
    # below the one being differentiated still hold their saved tensors, the ones above have released theirs
    layer_backward_each: list[float] = field(default_factory=list)

    def layer(self, i: int, tp: int = 1) -> float:
        return self.layer_replicated[i] + self.layer_split[i] / tp

    def layers_total(self, tp: int = 1) -> float:
        return sum(self.layer(i, tp) for i in range(len(self.layer_split)))

    def scaled(self, other: "ActivationTrace", micro_batch: int) -> "ActivationTrace":
        """Extrapolate from this (micro-batch 1) and ``other`` (micro-batch 2): every saved tensor is either
        proportional to the micro-batch or independent of it (rotary tables), so the bytes are affine in it."""
        lin = lambda a, b: a + (b - a) * (micro_batch - 1)  # noqa: E731
        return ActivationTrace(
            [lin(a, b) for a, b in zip(self.layer_replicated, other.layer_replicated)],
            [lin(a, b) for a, b in zip(self.layer_split, other.layer_split)],
            lin(self.outside, other.outside), lin(self.logits, other.logits), lin(self.hidden, other.hidden),
            lin(self.loss_transient, other.loss_transient), self.attention,
            lin(self.layer_backward, other.layer_backward), lin(self.layer_recompute, other.layer_recompute),
            [(w, s, d, int(lin(b, b2))) for (w, s, d, b), (_, _, _, b2) in zip(self.layer0, other.layer0)]
            if len(self.layer0) == len(other.layer0) else self.layer0,
            [lin(a, b) for a, b in zip(self.layer_backward_each, other.layer_backward_each)],
        )


def decoder_layers(model) -> list[tuple[str, Any]]:
    """The repeated blocks of a transformers model, found by behaviour: the ``nn.ModuleList`` whose children are
    the model's ``_no_split_modules`` classes (what FSDP auto-wrapping uses), else the ModuleList holding the
    most parameters."""
    import torch.nn as nn

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    # a vision-language model: the decoder's blocks, not its vision tower's (a sub-module holding the vision config)
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    towers = [n + "." for n, m in model.named_modules() if n and vision is not None and getattr(m, "config", None) is vision]
    lists = [(n, m) for n, m in lists if not n.startswith(tuple(towers))] or lists
    if not lists:
        raise InvalidArgumentError(f"{type(model).__name__}: no nn.ModuleList of blocks found")
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    hits = [(n, m) for n, m in lists if all(type(c).__name__ in no_split for c in m)]
    pool = hits or lists
    name, blocks = max(pool, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return [(f"{name}.{i}", b) for i, b in enumerate(blocks)]


def _fused_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Trace-only attention with a fused kernel's memory profile: SDPA saves q, k, v, the output and its
    log-sum-exp, never the ``s x s`` scores (softcap / window / dropout live inside FlashAttention's kernel and
    do not change what it saves)."""
    import torch.nn.functional as F

    causal = query.shape[2] == key.shape[2] and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_trace_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if AttentionInterface._global_mapping.get(TRACE_ATTENTION) is not _fused_attention_forward:
        AttentionInterface.register(TRACE_ATTENTION, _fused_attention_forward)
        AttentionMaskInterface.register(TRACE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return TRACE_ATTENTION


def prepare_config(config):
    """A copy of ``config`` for tracing: no KV cache, eager attention at build time (switched after the build)."""
    config = config.__class__.from_dict(config.to_dict())
    config.use_cache = False
    config._attn_implementation = "eager"
    return config


def set_trace_attention(model, attention: str) -> str:
    """Switch a built model to the fused trace attention (``attention="fused"``) or leave it eager; returns the
    attention traced.  A model that does not dispatch through ``AttentionInterface``
    (``_supports_attention_backend`` false: Falcon, Bloom, ...) gets its own SDPA path when it has one (a fused
    kernel when no mask is materialized), else stays eager."""
    if attention == "eager":
        return "eager"
    from ..packing.attention import _set_on_every_config, set_attention_implementation

    if not getattr(model, "_supports_attention_backend", False):
        if getattr(model, "_supports_sdpa", False):
            set_attention_implementation(model, "sdpa")
            return "sdpa (the model has no attention interface)"
        return "eager (the model has neither an attention interface nor SDPA)"
    # set on the configs directly: transformers 5.x would look a custom flash-named kernel up on the hub
    _set_on_every_config(model, model.config, _register_trace_attention())
    return "fused"


def fake_kernel_mode():
    """A dispatch mode for fake-tensor traces: fp32 ``grouped_mm`` (MoE experts) runs as a bf16 shape stand-in,
    because the fake kernel accepts bf16 only; the result is fp32 with the real shape."""
    import torch
    TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode", feature=_TRACE)

    grouped = getattr(torch.ops.aten, "_grouped_mm", None)

    class _FakeKernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if grouped is not None and func is grouped.default and args[0].dtype != torch.bfloat16:
                dt = args[0].dtype
                a, b = (x.to(torch.bfloat16) for x in args[:2])
                return func(a, b, *args[2:], **kwargs).to(dt)
            return func(*args, **kwargs)

    return _FakeKernels()


def _tp_blocks(model, config) -> set[str]:
    """Names of modules that own a tp-planned child (attention, MLP): tensors created inside them are split."""
    from .common import _tp_style

    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    out = set()
    if not plan:
        return out
    for name, _ in model.named_modules():
        if name and _tp_style(name + ".weight", plan) is not None and "." in name:
            out.add(name.rsplit(".", 1)[0])
    return out


def _config_key(config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def trace_activations(config, *, micro_batch: int, seq_len: int, dtype: str = "bf16",  # fp32 | bf16 | amp
                      attention: str = "fused", head: bool = True) -> ActivationTrace:
    """Saved-for-backward bytes of one forward of ``micro_batch x seq_len`` tokens (cached per model and shape;
    micro-batches above 2 are extrapolated exactly from 1 and 2).

    ``head=False`` runs the backbone alone (``model.base_model``: no output head, no loss), for a caller that
    counts its own head (TRL's fused LM head, :mod:`.rl`): ``logits`` and ``loss_transient`` are then 0.

    >>> from hf_gradfix.plan import load_model_config
    >>> t = trace_activations(load_model_config("tiny-llama"), micro_batch=2, seq_len=64, dtype="fp32")
    >>> len(t.layer_split), t.logits == 4 * 2 * 64 * 512
    (2, True)
    """
    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    with data_dependent_refused(config):
        if micro_batch > 2:
            one = _trace_cached(key, 1, seq_len, dtype, attention, head)
            two = _trace_cached(key, 2, seq_len, dtype, attention, head)
            return one.scaled(two, micro_batch)
        return _trace_cached(key, micro_batch, seq_len, dtype, attention, head)


@contextlib.contextmanager
def data_dependent_refused(config):
    """Turn fake tensors' refusal of a data-dependent shape into the planner's error (e.g. MoE experts as a
    Python loop over ``nonzero`` routing, transformers 4.x: 5.x runs them as ``grouped_mm``)."""
    DataDependentOutputException = private("torch._subclasses.fake_tensor", "DataDependentOutputException", feature=_TRACE)
    DynamicOutputShapeException = private("torch._subclasses.fake_tensor", "DynamicOutputShapeException", feature=_TRACE)

    from .common import PlanError

    try:
        yield
    except (DynamicOutputShapeException, DataDependentOutputException) as exc:
        import transformers

        raise PlanError(
            f"{type(config).__name__}: the forward takes a data-dependent step ({exc}) that fake tensors cannot "
            f"trace, so its activations cannot be counted (transformers {transformers.__version__}; MoE experts "
            f"run as grouped_mm on transformers 5.x, which traces). Use activation_model='formula' for a SwiGLU "
            f"decoder, or plan on transformers 5.x") from exc


@contextlib.contextmanager
def one_sequence_per_row():
    """While tracing on fake tensors: each traced row is one sequence, as the real step's unpacked rows are.

    transformers (``masking_utils.find_packed_sequence_indices``) looks for packed documents in the position ids a
    model builds itself (Qwen3.5, Bamba, ... pass their ``arange`` positions to ``create_causal_mask``); on real
    tensors it finds one sequence and the SDPA path runs ``is_causal`` with no mask, but on fake tensors it cannot
    read the values, assumes packing, and builds the 4-D float mask the real step never has -- which SDPA then
    saves, with K / V expanded to every query head instead of ``enable_gqa`` (measured on the tiny Qwen3.5 / Bamba
    of the tests, fp32, 2 x 128: 163,840 B per trace that the real step does not hold).  The traces here pass input
    ids only (or ``arange`` position ids), so the answer is known: no packed documents.  Restored on exit; nothing
    to do on a transformers without the detection."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers without masking_utils (4.4x)
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def one_sequence(position_ids):
        original(position_ids)  # its temporaries, as the real step computes them before finding one sequence
        return None

    masking_utils.find_packed_sequence_indices = one_sequence
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


_CONFIGS: dict[str, Any] = {}  # cache key -> the config it was made from


def _phase(text: str) -> None:
    """A trace (seconds to minutes for a big model) as a phase of ``hf-gradfix plan``'s progress, when the command
    runs; a library call of :func:`trace_activations` / ``estimate`` writes nothing."""
    from ..progress import active

    session = active("plan")
    if session is not None:
        session.phase(text)


@functools.lru_cache(maxsize=64)
def _trace_cached(key: str, micro_batch: int, seq_len: int, dtype: str, attention: str,
                  head: bool = True) -> ActivationTrace:
    import torch
    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode", feature=_TRACE)
    from torch.multiprocessing.reductions import StorageWeakRef
    TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode", feature=_TRACE)
    tree_leaves = private("torch.utils._pytree", "tree_leaves", feature=_TRACE)
    from .common import build_model_for_config

    config = prepare_config(_CONFIGS[key])
    _phase(f"tracing one forward and backward of {micro_batch} x {seq_len:,} tokens "
           f"({'backbone' if not head else 'model'}, {dtype}) under fake tensors: the activations ...")
    # "amp": fp32 weights under torch.autocast(bf16), as the Trainer runs mixed precision; autocast's bf16 weight
    # copies are saved by the matmuls and so counted with the layer that uses them
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "amp" else contextlib.nullcontext()
    state = {"layer": None, "tp_depth": 0}
    born: dict = {}  # storage -> (created inside a tp-split module, op name)
    # per layer, every storage it creates: [birth op, death op or None, bytes, storage]; replayed after the forward
    # to find what a recomputation of the layer holds at once (checkpointing stops after the last saved tensor)
    lifetimes: dict[int, list] = {}
    layer_live: dict = {}  # storage -> its lifetime record, for the running layer
    clock = [0]

    class _Provenance(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            clock[0] += 1
            i = state["layer"]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    w = StorageWeakRef(t.untyped_storage())
                    if w not in born:
                        born[w] = (state["tp_depth"] > 0, func.__name__.split(".")[0])
                        if i is not None:
                            rec = [clock[0], None, t.untyped_storage().nbytes(), w]
                            lifetimes.setdefault(i, []).append(rec)
                            layer_live[w] = rec
            if i is not None:
                for w in [w for w in layer_live if w.expired()]:
                    layer_live.pop(w)[1] = clock[0]
            return out

    def enter_layer(i):
        state["layer"] = i
        layer_live.clear()

    with FakeTensorMode():
        model = build_model_for_config(config, dtype=torch_dtype)  # a VLM config: its whole model
        model.train()
        used = set_trace_attention(model, attention)
        layers = decoder_layers(model)
        skip = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        skip |= {StorageWeakRef(b.untyped_storage()) for b in model.buffers()}
        tp_names = _tp_blocks(model, config)
        handles = []
        for i, (_, layer) in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: enter_layer(i)))
            handles.append(layer.register_forward_hook(lambda m, a, o: state.__setitem__("layer", None)))
        for name, mod in model.named_modules():
            if name in tp_names:
                handles.append(mod.register_forward_pre_hook(lambda m, a: state.__setitem__("tp_depth", state["tp_depth"] + 1)))
                handles.append(mod.register_forward_hook(lambda m, a, o: state.__setitem__("tp_depth", state["tp_depth"] - 1)))
        n = len(layers)
        rep, split, outside = [0.0] * n, [0.0] * n, [0.0]
        layer0: list = []
        saved: set = set()
        by_layer: list[list] = [[] for _ in range(n)]

        def pack(t):
            w = StorageWeakRef(t.untyped_storage())
            if w in skip or w in saved:
                return t
            saved.add(w)
            nbytes = t.untyped_storage().nbytes()
            in_tp, op = born.get(w, (False, "input"))
            i = state["layer"]
            if i is None:
                outside[0] += nbytes
            else:
                (split if in_tp else rep)[i] += nbytes
                by_layer[i].append((w, nbytes))
                if i == 0:
                    layer0.append((f"{op}{' (tp-split)' if in_tp else ''}", tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                   nbytes))
            return t

        ends: dict = {}
        first, last = layers[0][1], layers[-1][1]
        handles.append(first.register_forward_pre_hook(
            lambda m, a, kw: ends.__setitem__("input", a[0] if a else kw.get("hidden_states", next(
                (v for v in kw.values() if isinstance(v, torch.Tensor) and v.is_floating_point()), None))),
            with_kwargs=True))
        handles.append(last.register_forward_hook(
            lambda m, a, o: ends.__setitem__("output", o[0] if isinstance(o, tuple) else o)))
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        with _Provenance(), fake_kernel_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast, \
                one_sequence_per_row():
            out = model(input_ids=ids, labels=ids) if head else model.base_model(input_ids=ids)
        for h in handles:
            h.remove()
        logits = out.logits.untyped_storage().nbytes() if head else 0
        elem = torch.finfo(torch_dtype).bits // 8
        hidden = ends["input"].untyped_storage().nbytes() if ends.get("input") is not None else \
            micro_batch * seq_len * config.get_text_config().hidden_size * elem
        vocab = out.logits.shape[-1] if head else 0
        backward_each = _backward_working_set(ends, skip | saved, by_layer)
    layer_backward = max(backward_each, default=0)
    # full recomputation re-runs one layer's forward during backward with the incoming gradient alive (one
    # hidden-state-sized tensor), then its backward: the larger of the two is the recomputed layer's footprint
    recompute = max(layer_backward, _recompute_forward_peak(lifetimes, saved) + hidden)
    return ActivationTrace(rep, split, outside[0], float(logits), float(hidden),
                           float(2 * 4 * micro_batch * seq_len * vocab), used, float(layer_backward),
                           float(recompute), layer0, [float(b) for b in backward_each])


@dataclass
class InferenceTrace:
    """A forward without gradients (``torch.no_grad``, no KV cache) of the backbone (``model.base_model``: no output
    head), one micro-batch: nothing is saved, every tensor dies when its last use is over."""

    peak: float  # the most bytes alive at once (input ids included; weights and buffers not)
    output: float  # the backbone's output (the last hidden state), alive when a head runs on it


def trace_inference(config, *, micro_batch: int, seq_len: int, dtype: str = "bf16",  # fp32 | bf16 | amp
                    attention: str = "fused", generation: bool = False) -> InferenceTrace:
    """The peak of one no-grad forward of ``micro_batch x seq_len`` tokens through the backbone, on fake tensors
    (a no-grad log-prob forward, a generation's prefill without its KV cache). Cached per model and shape;
    micro-batches above 2 are extrapolated from 1 and 2 (every tensor is proportional to the micro-batch or
    independent of it).

    ``generation=True`` runs it as ``generate``'s prefill does: with per-row position ids, so rotary tables are per
    row, and counts its attention mask and position ids (``micro_batch x seq_len`` int64 each).

    >>> from hf_gradfix.plan import load_model_config
    >>> t = trace_inference(load_model_config("tiny-llama"), micro_batch=2, seq_len=64, dtype="fp32")
    >>> t.output == 4 * 2 * 64 * 128, t.peak > t.output
    (True, True)
    """
    key = _config_key(config)
    _CONFIGS.setdefault(key, config)
    with data_dependent_refused(config):
        if micro_batch > 2:
            one = _inference_cached(key, 1, seq_len, dtype, attention, generation)
            two = _inference_cached(key, 2, seq_len, dtype, attention, generation)
            lin = lambda a, b: a + (b - a) * (micro_batch - 1)  # noqa: E731
            return InferenceTrace(lin(one.peak, two.peak), lin(one.output, two.output))
        return _inference_cached(key, micro_batch, seq_len, dtype, attention, generation)


def _live_storage_mode(known: set, live: dict, on_op):
    """A dispatch mode keeping ``live`` = {storage: bytes} of every tensor an op makes (storages in ``known``
    excepted) and dropping the freed ones; after each op ``on_op(sum of live bytes)`` (the callers keep a peak)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    TorchDispatchMode = private("torch.utils._python_dispatch", "TorchDispatchMode", feature=_TRACE)
    tree_leaves = private("torch.utils._pytree", "tree_leaves", feature=_TRACE)

    class _Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    w = StorageWeakRef(t.untyped_storage())
                    if w not in known and w not in live:
                        live[w] = t.untyped_storage().nbytes()
            for w in [w for w in live if w.expired()]:
                del live[w]
            on_op(sum(live.values()))
            return out

    return _Live()


@functools.lru_cache(maxsize=64)
def _inference_cached(key: str, micro_batch: int, seq_len: int, dtype: str, attention: str,
                      generation: bool = False) -> InferenceTrace:
    import torch
    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode", feature=_TRACE)
    from torch.multiprocessing.reductions import StorageWeakRef
    from .common import build_model_for_config

    config = prepare_config(_CONFIGS[key])
    _phase(f"tracing one no-grad forward of {micro_batch} x {seq_len:,} tokens ({dtype}) under fake tensors"
           + (": a generation's prefill ..." if generation else ": a log-prob forward ..."))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "amp" else contextlib.nullcontext()
    live: dict = {}
    peak = [0]

    with FakeTensorMode():
        model = build_model_for_config(config, dtype=torch_dtype)  # a VLM config: its whole model
        model.eval()  # TRL disables dropout; a no-grad forward keeps no masks either way
        set_trace_attention(model, attention)
        skip = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        skip |= {StorageWeakRef(b.untyped_storage()) for b in model.buffers()}

        mode = _live_storage_mode(skip, live, lambda total: peak.__setitem__(0, max(peak[0], total)))
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        extra = {}
        if generation:  # generate's per-row position ids (left padding shifts them)
            extra = {"position_ids": torch.arange(seq_len).expand(micro_batch, seq_len).contiguous()}
        with torch.no_grad(), mode, fake_kernel_mode(), autocast, one_sequence_per_row():
            out = model.base_model(input_ids=ids, **extra)
        hidden = out.last_hidden_state.untyped_storage().nbytes()
    # the input ids, and generate's position ids and attention mask (not passed: a mask's all() is a
    # data-dependent step; a fused kernel saves no mask)
    held = ids.untyped_storage().nbytes() * (3 if generation else 1)
    return InferenceTrace(float(peak[0] + held), float(hidden))


def _recompute_forward_peak(lifetimes: dict[int, list], saved: set) -> int:
    """The most bytes one layer's forward holds at once, up to its last saved tensor (non-reentrant checkpointing
    stops recomputing there): saved tensors from birth on, transient ones from birth to death."""
    peak = 0
    for records in lifetimes.values():
        births = [r[0] for r in records if r[3] in saved]
        if not births:
            continue
        stop = max(births)
        events: dict[int, int] = {}
        for birth, death, nbytes, w in records:
            if birth > stop:
                continue
            events[birth] = events.get(birth, 0) + nbytes
            if death is not None and w not in saved:
                events[death] = events.get(death, 0) - nbytes
        live = 0
        for t in sorted(events):
            live += events[t]
            peak = max(peak, live)
    return peak


def _backward_working_set(ends: dict, known: set, by_layer: list[list]) -> list[int]:
    """Backward through the decoder layers only (last layer's output to first layer's input, no weight
    gradients), recording at every op the bytes of the layer being differentiated that are still alive (its
    saved tensors, released as autograd goes) plus every gradient temporary alive: per layer, the maximum while
    that layer is differentiated (the incoming gradient included)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    x, y = ends.get("input"), ends.get("output")
    if x is None or y is None or not (x.requires_grad and y.requires_grad):
        return [0] * len(by_layer)
    live: dict = {}
    peak = [0] * len(by_layer)
    current = [len(by_layer) - 1]  # layers above it are released, layers below it untouched

    def layer_live() -> int:
        while current[0] > 0 and all(w.expired() for w, _ in by_layer[current[0]]):
            current[0] -= 1
        return sum(b for w, b in by_layer[current[0]] if not w.expired())

    def on_op(total: int) -> None:
        held = total + layer_live()
        peak[current[0]] = max(peak[current[0]], held)

    seed = torch.ones_like(y)
    known = known | {StorageWeakRef(seed.untyped_storage())}

    with _live_storage_mode(known, live, on_op), fake_kernel_mode():
        grad = torch.autograd.grad(y, x, grad_outputs=seed, allow_unused=True)
    del grad
    return [p + seed.untyped_storage().nbytes() for p in peak]
