"""Closed-form per-rank training memory: parameters, gradients, optimizer state, activations, buffers, margin.

Everything here is arithmetic on parameter *shapes* (from a model built on the meta device: no weights) and
the mesh degrees.  Each term carries a one-line explanation so the table says where a number comes from.

Rules (Ultra-Scale Playbook, "memory usage in transformers"; N = parameter count, k = optimizer bytes/param):

* mixed precision (``bf16``/``fp16``): bf16 weights 2N + bf16 grads 2N + fp32 master 4N + Adam moments 8N
  = 16N bytes; 20N when gradients are accumulated in fp32 (``grad_fp32=True``, nanotron); ``fp32``: 4+4+8 = 16N;
  ``bf16-pure`` (no master copy, moments in bf16): 2+2+4 = 8N.
* ZeRO over the sharding degree ``d`` (FSDP2 shards over ``dp_shard x cp``): stage 1 divides master + moments,
  stage 2 also the gradients, stage 3 (FSDP) also the weights.  Tensor parallelism divides the weights that the
  model's tp plan splits (column-wise: out-features, row-wise: in-features) before ZeRO divides the rest.
* GaLore / APOLLO: per projected matrix of local shape ``(m, n)`` (after FSDP's row split and TP), moments
  ``2 k r`` and (GaLore only) basis ``d r`` with the side rule of :func:`hf_gradfix.optim.projection.resolve_side`
  (``auto`` reduces the in-features, so under FSDP2 the basis is not divided by ``d``); everything else AdamW.
* activations (default ``activation_model="traced"``): every tensor the architecture's own forward saves for
  backward, counted on fake tensors at the planned shape (``activations.py``: any architecture, fused attention
  by default), plus the fp32 loss gradients (the logits are not held: the step keeps only the loss; under pp the
  schedule keeps the last stage's output).  ``"formula"`` is the same count written out by
  hand for SwiGLU decoders (Llama, Mistral, Qwen2: equal to the trace there, a test checks it); the Playbook's
  GPT formula ``L s b h (34 + 5 a s / h)`` is reported alongside.  Full recomputation keeps each layer's input
  plus one recomputed layer's footprint (the larger of its re-run forward and its backward working set, both
  traced).  TP (transformers' tp plans, no sequence parallelism) divides what attention
  and MLP create by ``tp`` (norms and the residual stream stay replicated); CP divides the tokens by ``cp``.
* CP with packed rows (``Settings.packing``, :mod:`hf_gradfix.parallel.context_packing`): SDPA saves each layer's
  all-gathered full-sequence K/V (every query head), plus the document mask of this rank's queries against the
  whole row, boolean and additive, shared by the layers (sizes in the code below).
* pipeline parallelism (``Settings.pp``; ``pipeline.py``): each stage's own parameters (its layers, the
  embeddings on the first, norm and head on the last), its activations times the micro-batches its schedule
  keeps in flight, and a receive buffer per micro-batch; every stage is planned and the fullest returned.
* a TRL GRPO / RLOO run (``Settings.rl``; ``rl.py``): the reference model's weights (``beta > 0``) beside the
  model state, and as activations the largest of three phases that never overlap: generation (the KV cache and
  the prefill), the no-grad old / reference log-prob forwards, and the training micro-batch, whose head is TRL's
  fused one (a tile and fp32 gradients, no logits) on padded rows or one packed row of the real tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

from ..errors import HfGradfixError, model_load_error
# the planner's bottom module (no imports back up): estimate, activations and rl share these
from .common import GiB, PlanError, _fmt, _tp_style

__all__ = [
    "PlanError",
    "TINY_MODELS",
    "GPU_MEMORY",
    "load_model_config",
    "param_table",
    "ParamInfo",
    "Settings",
    "Plan",
    "estimate",
    "parse_memory",
    "playbook_model_state_bytes",
    "playbook_activation_bytes",
]


# ---------------------------------------------------------------------------------------------- models
TINY_MODELS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
    "tiny-mistral": dict(model_type="mistral", hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=640, max_position_embeddings=2048),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=500, max_position_embeddings=2048,
                       tie_word_embeddings=True),
    "llama-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072),
}

# Memory a training process can use, in bytes (marketing GB -> GiB where the vendor states GB).
GPU_MEMORY: dict[str, float] = {
    "h100": 80 * GiB, "h100-80gb": 80 * GiB, "h100-94gb": 94 * GiB, "h200": 141e9, "b200": 180e9,
    "a100": 80 * GiB, "a100-80gb": 80 * GiB, "a100-40gb": 40 * GiB, "l40s": 48 * GiB, "l4": 24 * GiB,
    "a10g": 24 * GiB, "rtx4090": 24 * GiB, "rtx3090": 24 * GiB, "v100": 32 * GiB, "v100-16gb": 16 * GiB,
    "t4": 16 * GiB, "mi300x": 192 * GiB, "mi250x": 128 * GiB,
}


def parse_memory(text: str | float | int) -> float:
    """Bytes from ``80GiB``, ``80 GB``, ``24g``, a bare number of GiB, or a GPU name (``h100``).

    >>> parse_memory("80GiB") / GiB, parse_memory("h100") / GiB, parse_memory(24) / GiB
    (80.0, 80.0, 24.0)
    """
    if isinstance(text, (int, float)):
        return float(text) * GiB
    s = str(text).strip().lower().replace(" ", "")
    if s in GPU_MEMORY:
        return GPU_MEMORY[s]
    m = re.fullmatch(r"([0-9.]+)(gib|gb|g|tib|tb|mib|mb)?", s)
    if not m:
        raise PlanError(f"--gpu-memory {text!r}: give a size like 80GiB / 40GB, or a GPU name ({', '.join(sorted(GPU_MEMORY))})")
    try:
        value, unit = float(m.group(1)), m.group(2) or "gib"
    except ValueError:
        value, unit = math.nan, "gib"
    scale = {"gib": GiB, "g": GiB, "gb": 1e9, "tib": 1024 * GiB, "tb": 1e12, "mib": 1024**2, "mb": 1e6}[unit]
    if not (math.isfinite(value) and 0 < value * scale <= 1024**5):
        raise PlanError(f"--gpu-memory {text!r}: invalid size; give a number > 0 with a unit, like 80GiB / 40GB")
    return value * scale


def load_model_config(spec: str):
    """A transformers config from a tiny name, a ``config.json``, a local directory or a hub id (config only)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    if spec in TINY_MODELS:
        kw = dict(TINY_MODELS[spec])
        return CONFIG_MAPPING[kw.pop("model_type")](**kw)
    p = Path(spec)
    if p.is_file():
        import json

        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:  # bad JSON, not UTF-8, unreadable
            raise PlanError(f"--model {spec}: not a JSON config file ({exc})") from None
        if not isinstance(data, dict):
            raise PlanError(f"--model {spec}: expected a JSON object (a model's config.json), got a "
                            f"{type(data).__name__}")
        mt = data.get("model_type")
        if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
            raise PlanError(f"--model {spec}: model_type={mt!r} is not a transformers architecture")
        check_model_sizes(argparse_namespace(data), spec)  # before transformers divides by them
        try:
            return check_model_sizes(CONFIG_MAPPING[mt].from_dict(data), spec)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers' own validation (StrictDataclassClassValidationError, ...)
            text = " ".join(str(exc).split())
            raise PlanError(f"--model {spec}: transformers refuses this config ({type(exc).__name__}: {text})") from None
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise PlanError(f"--model {spec}: the directory has no config.json")
        import json

        try:
            raw = json.loads((p / "config.json").read_text(encoding="utf-8"))
        except (ValueError, OSError):
            raw = None  # transformers says what is wrong with it below
        if isinstance(raw, dict):
            check_model_sizes(argparse_namespace(raw), spec)  # before transformers divides by them
        try:
            return check_model_sizes(AutoConfig.from_pretrained(str(p), trust_remote_code=False), spec)  # no remote code
        except PlanError:
            raise
        except ArithmeticError as exc:  # a size of 0 that transformers divides by
            raise PlanError(f"--model {spec}: transformers refuses this config ({type(exc).__name__}: {exc}); "
                            "check its sizes") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # remote code refused, unknown model_type, bad JSON
            raise model_load_error(spec, exc) from None
    try:
        return check_model_sizes(AutoConfig.from_pretrained(spec, trust_remote_code=False), spec)
    except PlanError:
        raise
    except Exception as exc:  # OSError (not found / offline), ValueError (unknown type)
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise model_load_error(spec, exc) from None
        raise PlanError(
            f"--model {spec!r}: unknown model. Give a tiny name ({', '.join(TINY_MODELS)}), a config.json, a local "
            f"directory with a config.json, or a hub id reachable from here (only its config is read). ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


def argparse_namespace(data: dict):
    """A dict's items as attributes (a ``config.json`` read as JSON, checked before transformers builds it)."""
    import argparse

    return argparse.Namespace(**{k: v for k, v in data.items() if isinstance(k, str)})


MAX_MODEL_DIM = 2**24
MAX_MODEL_LAYERS = 4096
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "head_dim")


def check_model_sizes(config, spec: str):
    """Refuse, before any work, a config whose sizes are not whole numbers >= 1 or are beyond any real model
    (each <= 2**24, at most 4096 layers): such a plan would divide by zero or build a model for minutes."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for key in _SIZE_KEYS:
            value = getattr(cfg, key, None)
            if value is None:
                continue
            high = MAX_MODEL_LAYERS if key == "num_hidden_layers" else MAX_MODEL_DIM
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise PlanError(f"--model {spec}: {key}={value!r}: invalid value; it must be a whole number >= 1 and "
                                f"<= {high}")
        heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
        hidden, head_dim = getattr(cfg, "hidden_size", None), getattr(cfg, "head_dim", None)
        if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
            raise PlanError(f"--model {spec}: num_key_value_heads={kv} does not divide num_attention_heads={heads}: "
                            "each key/value head serves a whole group of query heads; fix the config")
        if isinstance(heads, int) and isinstance(hidden, int) and head_dim is None and hidden % heads:
            raise PlanError(f"--model {spec}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                            "(and the config gives no head_dim); fix the config")
    return config


@dataclass
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    tp_style: str | None  # colwise / rowwise / None
    projected: bool = False  # a GaLore/APOLLO target
    layer: int | None = None  # index of the decoder block holding it (None: embeddings, final norm, head)
    # outside the decoder blocks: "input" (registered before them: embeddings, the first pipeline stage) or
    # "output" (after them: final norm, output head, the last pipeline stage)
    place: str | None = None
    tied: bool = False  # the input embedding is also the output head (both end stages hold it under pp)
    expert: bool = False  # routed experts (the config's ep plan, experts.py): sharded by expert under parallel.ep

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def build_meta_model(config):
    import torch
    from .common import build_model_for_config

    with torch.device("meta"):
        return build_model_for_config(config)  # a VLM config: its whole model (vision tower included)


def param_table(config, *, targets=None, exclude=(), min_size: int = 0, model=None) -> list[ParamInfo]:
    """One row per distinct trainable parameter of the meta-device model (tied weights once)."""
    from ..optim.groups import select_targets

    from .activations import decoder_layers
    from .experts import expert_patterns, is_expert_param, moe_shape

    model = model if model is not None else build_meta_model(config)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    sel = select_targets(named, targets, exclude, model=model)
    projected = set(sel.projected)
    layer_of = {}
    for i, (_, block) in enumerate(decoder_layers(model)):
        for p in block.parameters():
            layer_of.setdefault(id(p), i)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied_ids = ({id(out.weight)} if inp is not None and out is not None and getattr(out, "weight", None) is not None
                and out.weight is getattr(inp, "weight", None) else set())
    out_ids = {id(p) for p in out.parameters()} if out is not None else set()
    rows = ParamTable()
    seen_layer = False
    moe = moe_shape(config)
    ep_patterns = expert_patterns(config) if moe is not None else []
    for n, p in named:
        proj = n in projected and p.dim() == 2 and min(p.shape) >= min_size
        layer = layer_of.get(id(p))
        seen_layer = seen_layer or layer is not None
        # registration order places the rest: before the blocks (embeddings) or after them (norm, head)
        place = None if layer is not None else ("output" if seen_layer or id(p) in out_ids and id(p) not in tied_ids
                                                else "input")
        expert = moe is not None and is_expert_param(n, tuple(p.shape), ep_patterns, moe[0])
        rows.append(ParamInfo(n, tuple(p.shape), _tp_style(n, plan), proj, layer, place, id(p) in tied_ids, expert))
    # buffers (rotary tables, GPT-2's causal-mask buffer on transformers 4.x): replicated on every rank
    rows.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return rows


class ParamTable(list):
    """The rows of :func:`param_table`, plus ``buffer_bytes`` (the model's buffers, never sharded)."""

    buffer_bytes: int = 0


# ---------------------------------------------------------------------------------------------- settings
PRECISIONS = {
    # name: (weight bytes, grad bytes, master bytes, moment bytes, activation bytes)
    "fp32": (4, 4, 0, 4, 4),
    "bf16": (2, 2, 4, 4, 2),
    "fp16": (2, 2, 4, 4, 2),
    "bf16-pure": (2, 2, 0, 2, 2),
    # torch AMP as transformers' Trainer and accelerate run it: fp32 weights (they are the master), fp32 grads;
    # autocast's bf16 weight copies live from forward to backward; under FSDP2 MixedPrecisionPolicy(bf16, fp32)
    # instead, the gathered weights and unsharded grads are bf16 and the reduce-scatter fp32
    "amp-bf16": (4, 4, 0, 4, 2),
}
OPTIMIZERS = ("adamw", "adamw8bit", "galore_adamw", "galore_adamw8bit", "apollo_adamw", "apollo_mini", "sgd")


@dataclass
class Settings:
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    dtype: str = "bf16"
    grad_fp32: bool = False  # fp32 gradient accumulation buffer (+4N): the Playbook's 20N
    optimizer: str = "adamw"
    rank: int = 128
    proj_side: str = "auto"
    targets: Any = None
    exclude: tuple = ()
    min_size: int = 0
    recompute: str = "none"  # none | full
    zero: int | None = None  # None: 3 when dp_shard*cp > 1 (FSDP2), else 0 (DDP)
    fragmentation: float = 0.10
    # traced: counted from the architecture's forward on fake tensors (any architecture; activations.py);
    # formula: the SwiGLU-decoder closed form written out tensor by tensor; playbook: Korthikanti et al.
    activation_model: str = "traced"
    attention: str = "fused"  # fused (FlashAttention 2 / SDPA: no s x s scores saved) | eager
    projector_bytes: int | None = None  # bytes per GaLore basis element (None: as the optimizer allocates it)
    # bytes per element of a projected matrix's moments (and, for GaLore, its basis) in the non-8-bit low-rank
    # optimizers. None: 4, because hf_gradfix's GaLoreAdamW / ApolloAdamW keep them in fp32 whatever the weights'
    # dtype (compat="torch"); galore-torch and compat="galore_torch" keep the parameter's dtype (2 for bf16).
    lowrank_state_bytes: int | None = None
    lowrank_grads: bool = False  # GaLore low-rank gradient accumulation (rank-r accumulators instead of gradients)
    update_proj_gap: int = 200  # with lowrank_grads: refreshes are staggered over this many steps
    # DeepSpeed offload_optimizer (device cpu / nvme): the fp32 master partition and the optimizer state live in host
    # memory, the optimizer steps there; the GPU keeps weights, gradients and activations
    offload_optimizer: bool = False
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when the weights are fp32 (a clone, not an alias)
    deepspeed: bool = False
    # pipeline parallelism (pipeline.py): stages, schedule, virtual stages per rank; the schedule's micro-batches
    # are the accumulation window's (grad_accum)
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    # packed rows (the plugin's packer): with cp > 1 they run SDPA with a dense document mask and an all-gather
    # of K/V over the cp ranks (issue 29, hf_gradfix.parallel.context_packing) instead of the SDPA ring
    packing: bool = False
    # a TRL GRPO / RLOO run (rl.py): generation, no-grad log-prob forwards, TRL's fused LM head; its row length
    # (prompt + completion) replaces seq_len
    rl: Any = None  # RLRun | None
    # loss.head: stock (the logits and the loss's fp32 tensors) | lean (hf_gradfix's lean head, lean_head.py; used
    # where the head is a plain tensor at its forward: not under tp (a DTensor head), nor on a pp stage that FSDP2
    # shards or under the zero-bubble schedule)
    loss_head: str = "stock"
    # a vision-language model's images (vision.py's VisionRun: image size, images per sample): the vision tower's
    # activations and the image tokens of a row, an additive term of the activations
    vision: Any = None

    def check(self) -> None:
        if self.dtype not in PRECISIONS:
            raise PlanError(f"--dtype {self.dtype!r}: choose one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"--optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.recompute not in ("none", "full"):
            raise PlanError(f"--recompute {self.recompute!r}: none | full")
        for key in ("seq_len", "micro_batch", "grad_accum", "rank", "update_proj_gap"):
            if int(getattr(self, key)) < 1:
                raise PlanError(f"--{key.replace('_', '-')} must be >= 1")
        if self.zero not in (None, 0, 1, 2, 3):
            raise PlanError(f"--zero {self.zero!r}: 0, 1, 2 or 3")
        if self.loss_head not in ("stock", "lean"):
            raise PlanError(f"--loss-head {self.loss_head!r}: stock | lean (the config key loss.head)")
        if self.activation_model not in ("traced", "formula", "playbook"):
            raise PlanError(f"activation_model={self.activation_model!r}: traced | formula | playbook")
        if self.attention not in ("fused", "eager"):
            raise PlanError(f"--attention {self.attention!r}: fused (FlashAttention / SDPA) | eager")
        from ..parallel.pipeline_schedule import SCHEDULES

        if self.pp_schedule not in SCHEDULES:
            raise PlanError(f"--pp-schedule {self.pp_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        for key in ("pp", "pp_virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**20:
                raise PlanError(f"--{key.replace('_', '-')} {value!r}: invalid value; it must be a whole number >= 1 "
                                "and <= 1048576")
        if self.rl is not None:
            self.rl.check()
            if self.activation_model != "traced":
                raise PlanError(f"activation_model={self.activation_model!r} with an RL run: only the traced count "
                                "knows TRL's fused head (activation_model='traced')")
            if self.pp > 1:
                raise PlanError("--rl with --pp: TRL's GRPO / RLOO trainers do not run pipeline stages; drop --pp")
        if self.vision is not None:
            self.vision.check()
            if self.rl is not None:
                raise PlanError("--image-size with --rl: the vision tower of an RL run is not planned; drop "
                                "--image-size / --images-per-sample (the plan then counts the text rows only)")
            if self.activation_model != "traced":
                raise PlanError(f"activation_model={self.activation_model!r} with --image-size: only the traced count "
                                "measures the vision tower (activation_model='traced')")


COMPONENTS = ("parameters", "master_weights", "gradients", "optimizer_state", "reference_model", "activations",
              "comm_buffers", "fragmentation")  # reference_model: RL runs only (a plan holds the components it has)


@dataclass
class Plan:
    model: str
    n_params: int
    mesh: dict
    settings: dict
    components: dict  # name -> bytes per rank
    explain: dict  # name -> text
    peak: float
    global_batch_tokens: int
    activations_no_recompute: float
    activations_full_recompute: float
    playbook_activations: float
    gpu_memory: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.peak <= self.gpu_memory

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        d["peak_gib"] = self.peak / GiB
        return d

    def table(self) -> str:
        m = self.mesh
        unit, div = ("GiB", GiB) if self.peak >= GiB / 4 else ("MiB", 1024**2)
        lines = [
            f"model       {self.model}: {self.n_params / 1e9:.3f} B parameters" if self.n_params >= 1e8
            else f"model       {self.model}: {self.n_params / 1e6:.3f} M parameters",
            f"mesh        world {m['world_size']}: {'pp=%d ' % m['pp'] if m.get('pp', 1) > 1 else ''}"
            f"dp_replicate={m['dp_replicate']} dp_shard={m['dp_shard']} "
            f"cp={m['cp']} tp={m['tp']}" + (f" ep={m['ep']} (efsdp={m['efsdp']})" if m.get("ep", 1) > 1 else "")
            + f" (ZeRO-{self.extra['zero']} over {self.extra['shard_degree']})",
            f"batch       micro-batch {self.settings['micro_batch']} x seq {self.settings['seq_len']} x grad-accum "
            f"{self.settings['grad_accum']} x dp {m['dp_replicate'] * m['dp_shard']} = {self.global_batch_tokens:,} tokens/step",
            f"precision   {self.settings['dtype']}{' + fp32 grad accumulation' if self.settings['grad_fp32'] else ''}, "
            f"optimizer {self.settings['optimizer']}, recompute {self.settings['recompute']}",
            "",
            f"{'component':<17}{unit + '/rank':>10}  how",
        ]
        if self.extra.get("rl"):
            lines.insert(4, self.extra["rl"]["summary"])
        for k in COMPONENTS:
            if k in self.components:
                lines.append(f"{k:<17}{self.components[k] / div:>10.3f}  {self.explain[k]}")
        # measured over the configurations the tests trace: 1.10-1.39 x the traced peak, but a component is an estimate
        # (activations within +-10 % of the trace), so the sum is not called a bound (tests/plan/test_plan_lean_head.py)
        lines.append(f"{'peak':<17}{self.peak / div:>10.3f}  sum of the above, each at its own maximum (an estimate, "
                     "not a bound; --simulate traces the step's peak)")
        lines.append(
            f"activations: {self.activations_no_recompute / div:.3f} {unit} without recomputation, "
            f"{self.activations_full_recompute / div:.3f} {unit} with full recomputation "
            f"(Playbook GPT formula, bf16: {self.playbook_activations / div:.3f} {unit})"
        )
        rl = self.extra.get("rl")
        if rl:
            lines.append(f"rl phases   each on top of the model state, the reference model and the comm buffers ({unit}):")
            for name, label in (("generation", "generation"), ("no_grad", "old/ref fwd"), ("training", "training")):
                ph = rl["phases"][name]
                mark = "  <- the peak" if name == rl["peak_phase"] else ""
                lines.append(f"  {label:<13}{ph['bytes'] / div:>10.3f}  {ph['how']}{mark}")
        pipe = self.extra.get("pipeline")
        if pipe:
            p, v, mb = pipe["pp"], pipe["virtual_stages"], pipe["microbatches"]
            formula = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved_1f1b": "(p-1)/(v m+p-1)",
                       "zero_bubble": "(p-1)/(3 v m+p-1)"}[pipe["schedule"]]
            if pipe["schedule"] == "interleaved_1f1b" and mb < p:
                formula = "e/(v m+e), e = p-1+(p-m)(v-1)"
            lines.append(f"pipeline    pp {p}, {pipe['schedule']}" + (f", {v} virtual stages" if v > 1 else "")
                         + f", m = {mb} micro-batches (grad-accum): bubble {100 * pipe['bubble_fraction']:.1f} % "
                         f"{formula}; the table above is stage {pipe['worst_stage']}, the fullest")
            lines.append(f"  {'stage':>5} {'layers':<20}{'params':>14} {'in flight':>9} {'activations':>12} "
                         f"{'p2p bufs':>9} {'peak':>9}  ({unit})")
            for st in self.extra["stages"]:
                where = _layer_span(st["layers"])[len("layers "):] + (" +emb" if st["first"] else "") + (
                    " +head" if st["last"] else "")
                lines.append(f"  {st['stage']:>5} {where:<20}{st['parameters']:>14,} {st['in_flight']:>9g} "
                             f"{st['activations'] / div:>12.3f} {st['p2p_buffers'] / div:>9.3f} "
                             f"{st['peak'] / div:>9.3f}")
        if self.gpu_memory is not None:
            verdict = "FITS" if self.fits else "DOES NOT FIT"
            lines.append(f"verdict     {verdict} in {self.gpu_memory / GiB:.1f} GiB "
                         f"({100 * self.peak / self.gpu_memory:.0f} % used)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- formulas
def playbook_model_state_bytes(n: float, *, zero: int = 0, dp: int = 1, grad_fp32: bool = False) -> dict:
    """The Playbook's mixed-precision model state: 2N weights, 2N grads, 4N master + 8N Adam (k = 12)
    [+4N fp32 grads], divided by ``dp`` per ZeRO stage.

    >>> round(sum(playbook_model_state_bytes(1e9).values()) / 1e9), round(sum(playbook_model_state_bytes(1e9, grad_fp32=True).values()) / 1e9)
    (16, 20)
    """
    w, g, k = 2 * n, 2 * n + (4 * n if grad_fp32 else 0), 12 * n
    return {"parameters": w / dp if zero >= 3 else w, "gradients": g / dp if zero >= 2 else g,
            "optimizer_state": k / dp if zero >= 1 else k}


def playbook_activation_bytes(config, seq_len: int, micro_batch: int, *, fused_attention: bool = True,
                              tp: int = 1, cp: int = 1) -> float:
    """``L s b h (34 + 5 a s / h)`` bytes (bf16, Korthikanti et al.); fused attention drops the ``5as/h`` term."""
    h, L = config.hidden_size, config.num_hidden_layers
    a = getattr(config, "num_attention_heads", None) or 0  # attention-free models (Mamba): no score term
    s = seq_len / cp
    per = 34 + (0 if fused_attention else 5 * a * s / h)
    return L * s * micro_batch * h * per / tp


def _decoder_layer_activation(config, tokens: float, e: int, tp: int) -> float:
    """Bytes one SwiGLU decoder layer saves for backward (fused SDPA), tensor by tensor (checked against the
    saved-tensor hooks of a Llama layer: exact in fp32).

    RMSNorm (x2): the fp32 input (4Th, HF upcasts), its rsqrt (4T), ``x * rsqrt`` and the weighted output
    (2 e Th).  Attention: rotated q (e T hq) and k (e T hk), v (e T hk), the SDPA output (e T hq, also the
    o_proj input) and its log-sum-exp (4 T heads); GQA runs inside SDPA (no repeated K/V).  MLP: gate,
    silu(gate), up, their product (4 e T i).
    """
    h, i = config.hidden_size, config.intermediate_size
    nh = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // nh
    hk = (getattr(config, "num_key_value_heads", None) or nh) * hd
    hq = nh * hd
    norms = 2 * (4 * tokens * h + 4 * tokens + 2 * e * tokens * h)
    attn = e * tokens * (2 * hq + 2 * hk) + 4 * tokens * nh
    mlp = 4 * e * tokens * i
    # TP (transformers' tp plans: no sequence parallelism) splits attention by heads and the MLP by columns;
    # the norms and the residual stream stay replicated on every tp rank.
    return norms + (attn + mlp) / tp


def _head_activation(config, tokens: float, e: int, seq: float = 0) -> float:
    """Final norm, rotary cos/sin, the logits (e T v: returned with the output, which the step drops before
    backward, so :func:`estimate` does not hold them), the fp32 log-softmax saved by the loss (4 T v), and the
    loss backward's two fp32 T x v gradients (of the log-softmax's output, then of its input)."""
    h, v = config.hidden_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    return 4 * tokens * h + 4 * tokens + 2 * e * tokens * h + 2 * e * seq * hd + e * tokens * v + 12 * tokens * v


@dataclass
class _Stage:
    """One pipeline stage as the planner sees it (pipeline.py's split rule)."""

    index: int
    layers: list[int]  # global decoder-layer indices it runs
    first: bool  # holds the input embeddings (chunk 0)
    last: bool  # holds the final norm and the output head (the last chunk)
    in_flight: float  # micro-batches whose activations it holds at its peak (pipeline.in_flight)
    recv_fwd: int  # activation buffers it receives into (one per micro-batch and chunk that is not chunk 0)
    recv_grad: int  # gradient buffers it receives into (one per micro-batch and chunk that is not the last)


def pipeline_degree(mesh, settings: Settings) -> int:
    """``pp`` from the mesh (a ParallelDims that carries ``pp``) or from the settings (``--pp``), never both
    different."""
    mesh_pp = int(getattr(mesh, "pp", 1) or 1)
    if mesh_pp > 1 and settings.pp > 1 and mesh_pp != settings.pp:
        raise PlanError(f"--pp {settings.pp}: the configuration's parallel.pp is {mesh_pp}; keep one of them")
    return max(mesh_pp, settings.pp)


def estimate(config, mesh, settings: Settings, *, gpu_memory: float | None = None, model_name: str = "model",
             params: list[ParamInfo] | None = None) -> Plan:
    """The closed-form per-rank plan (see the module docstring for every rule).

    With pipeline parallelism (``settings.pp > 1``, or a ``mesh`` that carries ``pp``) ``mesh`` holds the other
    degrees over ``world / pp`` ranks; every stage is planned and the worst one returned, each stage's summary in
    ``extra["stages"]`` (``pipeline.py`` has the split rule, the schedules' in-flight counts and the bubble)."""
    from ..parallel import pipeline_schedule as pl

    settings.check()
    from .vision import with_text_sizes

    config = with_text_sizes(config)  # a VLM config: the decoder's sizes where the closed form reads them
    if settings.rl is not None and settings.seq_len != settings.rl.seq_len:
        from dataclasses import replace

        settings = replace(settings, seq_len=settings.rl.seq_len)  # TRL's rows: prompt + completion
    pp = pipeline_degree(mesh, settings)
    if params is None:
        params = param_table(config, targets=settings.targets, exclude=settings.exclude, min_size=settings.min_size)
    if pp == 1:
        return _estimate_rank(config, mesh, settings, gpu_memory=gpu_memory, model_name=model_name, params=params)
    n_layers = len({p.layer for p in params if p.layer is not None}) or config.num_hidden_layers
    world = mesh.world_size if getattr(mesh, "pp", 1) > 1 else mesh.world_size * pp
    spec = pl.PipelineSpec(pp, settings.pp_schedule, settings.pp_virtual_stages, settings.grad_accum)
    pl.check_pipeline(spec, world_size=world, n_layers=n_layers, raise_as=PlanError)
    n_chunks = spec.chunks
    plans = []
    for s in range(pp):
        chunks = pl.stage_chunks(s, pp, spec.virtual_stages)
        stage = _Stage(s, pl.stage_layers(n_layers, s, pp, spec.virtual_stages), first=0 in chunks,
                       last=n_chunks - 1 in chunks, in_flight=pl.in_flight(spec, s),
                       recv_fwd=spec.microbatches * sum(1 for c in chunks if c > 0),
                       recv_grad=spec.microbatches * sum(1 for c in chunks if c < n_chunks - 1))
        keep = set(stage.layers)
        rows = ParamTable(
            p for p in params
            if (p.layer is not None and p.layer in keep)
            or (p.layer is None and ((p.place == "input" and stage.first) or (p.place == "output" and stage.last)
                                     or (p.tied and stage.last))))
        rows.buffer_bytes = getattr(params, "buffer_bytes", 0)  # rotary tables: every stage computes them
        plans.append(_estimate_rank(config, mesh, settings, gpu_memory=gpu_memory, model_name=model_name,
                                    params=rows, stage=stage, pp=pp, world=world))
    worst = max(plans, key=lambda q: q.peak)
    bubble = pl.bubble_fraction(spec)
    worst.extra["pipeline"] = {"pp": pp, "schedule": spec.schedule, "virtual_stages": spec.virtual_stages,
                               "microbatches": spec.microbatches, "bubble_fraction": bubble,
                               "worst_stage": plans.index(worst), "model_parameters": sum(p.numel for p in params)}
    worst.extra["stages"] = [q.extra["stage"] for q in plans]
    worst.extra["stage_parameters"] = worst.n_params
    worst.n_params = sum(p.numel for p in params)  # the model's; each stage's count is in extra["stages"]
    return worst


def _estimate_rank(config, mesh, settings: Settings, *, gpu_memory: float | None, model_name: str,
                   params: list[ParamInfo], stage: _Stage | None = None, pp: int = 1,
                   world: int | None = None) -> Plan:
    """One rank's plan: the whole model, or one pipeline ``stage`` (its parameters in ``params``)."""
    mesh.check_model(config)
    cp_flex = mesh.cp > 1 and settings.packing  # packed rows under CP: document mask + K/V all-gather (issue 29)
    seq_len = settings.seq_len
    rl = settings.rl
    if rl is not None:
        if mesh.cp > 1:
            raise PlanError(f"--rl with cp={mesh.cp}: TRL's GRPO / RLOO generation and log-prob forwards do not run "
                            "context-parallel here; plan cp=1")
        seq_len = rl.seq_len  # TRL's rows: the longest prompt + the longest completion of the generation batch
    if cp_flex:
        # the packed layout pads every document to a multiple of 2 x cp (torch's per-document head-tail
        # balancer cuts each into 2 x cp chunks); a row is counted as one document, so padded the same way
        quantum = 2 * mesh.cp
        seq_len = -(-seq_len // quantum) * quantum
    elif settings.seq_len % mesh.cp:
        raise PlanError(f"--seq-len {settings.seq_len} is not divisible by cp={mesh.cp}")
    opt = settings.optimizer
    wb, gb, mb, momb, eb = PRECISIONS[settings.dtype]
    if settings.deepspeed and (settings.zero or 0) >= 1 and not mb:
        mb = 4
    if settings.grad_fp32:
        gb += 4
    d = mesh.dp_shard * mesh.cp
    zero = settings.zero if settings.zero is not None else (3 if d > 1 else 0)
    if zero == 0:
        d_eff = 1
    else:
        d_eff = d if d > 1 else mesh.dp_replicate  # ZeRO-1/2 without FSDP: over the data-parallel group
    tp = mesh.tp
    ep = int(getattr(mesh, "ep", 1) or 1)
    if ep > 1:
        _check_ep(mesh, settings, pp)
    from ..optim import projection as proj
    from ..optim.memory import adamw_state_elements, eight_bit_moment_bytes, galore_state_elements

    if settings.lowrank_grads and not opt.startswith("galore"):
        raise PlanError(f"--lowrank-grads: low-rank gradient accumulation is GaLore's (got --optimizer {opt}); "
                        "APOLLO scales the full gradient, AdamW has no projection")
    if settings.lowrank_grads and zero >= 2:
        raise PlanError("--lowrank-grads works with DDP or one process, not with ZeRO-2/3 / FSDP2 (they shard the "
                        "full gradient before a per-parameter hook could project it)")
    lowrank_acc = 0.0  # bytes of the rank-r gradient accumulators
    projected_grad_elems = 0.0  # full-gradient elements replaced by them
    projected_sizes: list[float] = []

    n_total = sum(p.numel for p in params)
    local_elems = 0.0  # weights on this rank after TP (before ZeRO)
    opt_bytes = 0.0
    n_proj = 0
    layer_elems: dict[int, float] = {}  # per decoder layer, after TP
    root_local = 0.0  # embeddings, final norm, head: FSDP2's root unit, unsharded through forward and backward
    n_layers = len({p.layer for p in params if p.layer is not None}) or (
        len(stage.layers) if stage is not None else config.num_hidden_layers)
    for p in params:
        shape = list(p.shape)
        sharded = set()
        if tp > 1 and p.tp_style == "colwise":
            shape[0] = math.ceil(shape[0] / tp); sharded.add(0)
        elif tp > 1 and p.tp_style == "rowwise" and len(shape) > 1:
            shape[1] = math.ceil(shape[1] / tp); sharded.add(1)
        numel = math.prod(shape)
        local_elems += numel
        gathered = numel / ep if p.expert else numel  # an FSDP2 unit gathers this rank's num_experts / ep experts
        if p.layer is not None:
            layer_elems[p.layer] = layer_elems.get(p.layer, 0.0) + gathered
        else:
            root_local += gathered
        low_rank = p.projected and opt.startswith(("galore", "apollo"))
        if low_rank and zero >= 3 and d_eff > 1 and 1 in sharded:
            raise PlanError(
                f"--optimizer {opt}: {p.name} is sharded on both dimensions (FSDP2 rows x tensor-parallel columns), "
                "so the low-rank optimizer refuses it (a collective every step). Exclude the row-wise tp weights "
                "from the targets (optimizer.exclude, e.g. [o_proj, down_proj] for a Llama tp plan) or drop tp")
        if low_rank:
            n_proj += 1
            rank = 1 if opt == "apollo_mini" else settings.rank
            if zero >= 3 and d_eff > 1:
                shape[0] = math.ceil(shape[0] / d_eff)  # FSDP2 Shard(0): the projection sees the row shard
                div = 1
            else:
                div = d_eff if zero >= 1 else 1
            side = proj.resolve_side(tuple(shape), settings.proj_side, frozenset(sharded))
            moments, basis = galore_state_elements(tuple(shape), rank, side)
            # bitsandbytes' blockwise state (GaLoreAdamW8bit): uint8 codes + an fp32 absmax per 256, fp32 below 4096;
            # its basis is in the parameter's dtype. The full-precision optimizers keep moments and basis in fp32.
            eight_bit = opt.endswith("8bit")
            low_b = momb if eight_bit else (settings.lowrank_state_bytes or 4)
            mom_b = eight_bit_moment_bytes(moments // 2) if eight_bit else moments * low_b
            if opt.startswith("galore"):
                b = mom_b + basis * (settings.projector_bytes or low_b) + 5
            else:
                b = mom_b + 8 + 5 + 4
            if settings.lowrank_grads and opt.startswith("galore"):
                k_r = moments // 2
                lowrank_acc += k_r * gb / div  # the rank-r accumulator, in the gradients' dtype
                projected_grad_elems += numel
                projected_sizes.append(numel)
            opt_bytes += b / div
        elif opt == "sgd":
            pass
        else:
            if opt.endswith("8bit"):  # bitsandbytes: 8-bit codes + blockwise absmax (block 256); fp32 below 4096
                b = eight_bit_moment_bytes(numel) + 4
            else:
                b = adamw_state_elements(tuple(shape)) * momb + 4
            opt_bytes += b / (d_eff if zero >= 1 else 1)
    params_b = local_elems * wb / (d_eff if zero >= 3 else 1) + getattr(params, "buffer_bytes", 0)
    master_b = local_elems * mb / (d_eff if zero >= 1 else 1)
    grads_b = local_elems * gb / (d_eff if zero >= 2 else 1)
    ep_info = None
    if ep > 1:  # experts by expert over ep, then FSDP2 over efsdp; the rest FSDP2 over dp_shard; padded shards
        ep_info = _ep_shares(config, mesh, params, momb=momb, optimizer=opt)
        padded = ep_info["expert_padded"] + ep_info["dense_padded"]
        params_b = padded * wb + getattr(params, "buffer_bytes", 0)
        master_b = padded * mb
        grads_b = padded * gb
        opt_bytes = ep_info["optimizer_bytes"]
    refreshing = 0
    if settings.lowrank_grads and projected_sizes:
        # staggered refreshes: ceil(K / gap) matrices refresh per step and keep their full gradient (the largest,
        # to be safe); every other projected matrix holds only its rank-r accumulator
        refreshing = math.ceil(len(projected_sizes) / settings.update_proj_gap)
        full_refresh = sum(sorted(projected_sizes, reverse=True)[:refreshing])
        grads_b = (local_elems - projected_grad_elems + full_refresh) * gb + lowrank_acc

    # activations, per micro-batch, this rank's tokens
    amp = settings.dtype == "amp-bf16"
    fsdp = zero >= 3 and d_eff > 1
    tokens = settings.micro_batch * seq_len / mesh.cp
    pb_act = playbook_activation_bytes(config, seq_len, settings.micro_batch, tp=tp, cp=mesh.cp)
    # the traced rows: micro-batch x sequence; an RL run's packed forwards are one row of the real tokens
    trace_rows, trace_len = settings.micro_batch, seq_len // mesh.cp
    if rl is not None and rl.forwards == "packed":
        trace_rows, trace_len = 1, math.ceil(settings.micro_batch * (rl.prompt_mean + rl.completion_mean))
        tokens = trace_len
    trace_dtype = "fp32" if eb == 4 else "amp" if (amp and not fsdp) else "bf16"
    rl_head = None
    act_how = ""
    tr = None
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_width = (getattr(config, "num_key_value_heads", None) or heads) * head_dim / tp
    lean = None
    # under pp the last stage's loss function applies the head (integration/parallel/pipeline.py), except where FSDP2 shards
    # the head or the zero-bubble schedule runs its backward twice; the one reason that applies is said
    stock_why = None
    if settings.loss_head == "lean":
        from .lean_head import stock_head_reason

        stock_why = stock_head_reason(rl=None if rl is None else rl.trainer, tp=tp, pp_stage=stage is not None,
                                      fsdp=fsdp, schedule=settings.pp_schedule)
    if settings.loss_head == "lean" and stock_why is None:
        from .lean_head import lean_head_bytes
        from ..loss.lean_head import has_torch_linear_cross_entropy

        text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        # FSDP2 mixed precision gathers the head in bf16; autocast runs its matmul in bf16 over fp32 weights
        lean = lean_head_bytes(tokens, text_cfg.hidden_size, text_cfg.vocab_size, compute_bytes=eb,
                               weight_bytes=2 if amp and fsdp else wb, hidden_bytes=4 if amp else eb,
                               torch_op=has_torch_linear_cross_entropy())
    if settings.activation_model == "traced":
        from .activations import trace_activations

        tr = trace_activations(config, micro_batch=trace_rows, seq_len=trace_len, dtype=trace_dtype,
                               attention=settings.attention, head=rl is None and lean is None)
        all_layers = [tr.layer(i, tp) for i in range(len(tr.layer_split))]
        # a layer's backward footprint (its saved tensors + gradients) shrinks with tp as its activations do
        tp_share = max(all_layers) / max(tr.layer(i) for i in range(len(all_layers)))
        layer_bwd, layer_rc = tr.layer_backward * tp_share, tr.layer_recompute * tp_share
        hidden = tr.hidden
        per_layer = all_layers if stage is None else [all_layers[i] for i in stage.layers]
        # each layer's own backward working set: a hybrid model's chunked linear-attention / Mamba layers hold far
        # more than its attention layers, so the peak is not always in the last layer's backward
        each = tr.layer_backward_each or [tr.layer_backward] * len(all_layers)
        bwd_each = [b * tp_share for b in (each if stage is None else [each[i] for i in stage.layers])]
        head_saved, logits_b, loss_t = tr.outside, tr.logits, tr.loss_transient
        if lean is not None:  # the backbone's trace (no head); the lean head's own count (lean_head.py)
            head_saved, logits_b, loss_t = tr.outside + lean["kept"], 0.0, lean["transient"]
        if rl is not None:
            # TRL's fused LM head instead of the logits and their loss gradients (rl.py)
            from .rl import training_head

            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            hidden_bytes = round(tr.hidden / (trace_rows * trace_len * text.hidden_size))
            head_w = 2 if amp and fsdp else wb  # FSDP2 mixed precision gathers the head in bf16
            rl_head = training_head(
                config, rl, micro_batch=settings.micro_batch, rows=trace_rows, row_len=trace_len,
                hidden_bytes=hidden_bytes, weight_bytes=head_w, compute_bytes=eb,
                # the fp32 weight gradient becomes .grad itself only for fp32 weights, the window's first
                # micro-batch and no FSDP2 (whose gathered head hands its gradient to a reduce-scatter)
                weight_grad_fresh=not (head_w == 4 and settings.grad_accum == 1 and not fsdp))
            head_saved, logits_b, loss_t = tr.outside + rl_head["kept"], 0.0, rl_head["transient"]
    else:
        layer_act = _decoder_layer_activation(config, tokens, eb, tp)
        per_layer = [layer_act] * n_layers
        layer_bwd = layer_rc = layer_act
        bwd_each = [layer_bwd] * len(per_layer)
        hidden = eb * tokens * config.hidden_size
        logits_b, loss_t = eb * tokens * config.vocab_size, 12 * tokens * config.vocab_size
        head_saved = _head_activation(config, tokens, eb, seq_len / mesh.cp) - logits_b - loss_t
        if lean is not None:
            head_saved, logits_b, loss_t = head_saved + lean["kept"], 0.0, lean["transient"]
        if settings.activation_model == "playbook":
            per_layer = [pb_act * eb / 2 / config.num_hidden_layers] * n_layers
            layer_rc = per_layer[0] + head_saved + loss_t
    if cp_flex:
        # SDPA saves its inputs for backward: K and V of the whole row (gathered over cp, grouped KV heads
        # expanded to every query head before the gather), where the fused trace counted this rank's own K and V
        # (tokens x kv_width each); the log-sum-exp it also saves is in the trace already
        q_width = heads * head_dim / tp
        kv_gathered = 2 * tokens * (mesh.cp * q_width - kv_width) * eb
        per_layer = [a + kv_gathered for a in per_layer]
        layer_bwd += kv_gathered  # a layer's backward (and its recomputation) holds them too
        layer_rc += kv_gathered
        bwd_each = [b + kv_gathered for b in bwd_each]
    # what the head keeps per micro-batch (final norm, loss log-softmax) lives on the last stage; the
    # first keeps the input ids its embedding saves (int64); without pp one rank has both (the trace's outside
    # already holds the ids)
    last = stage is None or stage.last
    first_saved = 8 * tokens if stage is not None and stage.first and not stage.last else 0.0
    # The logits are not held without pp: the training step keeps only the loss (Trainer.compute_loss returns it
    # without the model output; so does the GPU check's step), and no backward saves them (the loss upcasts them to
    # fp32 and log_softmax saves its own output, counted in head_saved). Counting them held was issue 53's
    # over-count: +7.8 % of the activations at Llama-3.2-1B, seq 2048, bf16 (docs/plan.md, "Activations against the
    # allocator"). Under pp torch's schedule keeps the last stage's output (the stock head's logits) for its backward.
    logits_held = logits_b if stage is not None else 0.0
    head_kept = (head_saved + logits_held) if last else 0.0
    loss_now = loss_t if last else 0.0
    # without recompute the peak is where backward starts (everything saved + the loss gradients), or in a
    # layer's backward for a model whose layer working set outweighs the loss gradients: layer k's working set
    # plus what the layers below it saved (the layers above have released theirs). Equal layers peak in the last
    # one; in a hybrid model it may be an earlier, heavier layer. What the head saved is kept in both terms,
    # although its backward has released it by the time the layers run (LFM2: +5.7 %): that margin is what
    # covers the weight-gradient temporaries the layers' traced backward leaves out (Mamba -2.4 %, Mixtral
    # -4.9 % without it)
    saved_mb = sum(per_layer) + head_kept + first_saved
    in_backward = max((sum(per_layer[:k]) + b for k, b in enumerate(bwd_each)), default=0.0)
    peak_mb = head_kept + first_saved + max(sum(per_layer) + loss_now, in_backward)
    # full recompute: the checkpointed layer inputs, plus the larger of the loss (end of forward) and one
    # recomputed layer's backward footprint (by then the head has released everything but logits_held)
    ckpt = len(per_layer) * hidden
    saved_mb_full = ckpt + head_kept + first_saved
    peak_mb_full = ckpt + first_saved + (max(head_kept + loss_now, logits_held + layer_rc) if last else layer_rc)
    if settings.activation_model == "playbook" and stage is None:
        peak_mb = pb_act * eb / 2 + head_kept + loss_now
    mask_b = 0.0
    if cp_flex:
        # the document mask of this rank's queries against the whole row, [micro_batch, 1, seq / cp, seq], kept
        # for the step: boolean (1 B) and its additive form in the attention dtype, which SDPA saves for backward
        # (one storage shared by every layer: context_packing converts it once)
        mask_b = settings.micro_batch * (seq_len // mesh.cp) * seq_len * (1 + eb)
        saved_mb += mask_b; peak_mb += mask_b; saved_mb_full += mask_b; peak_mb_full += mask_b
    # a pipeline stage holds the saved activations of its micro-batches in flight: all but the one at its peak
    held = (stage.in_flight - 1) if stage is not None else 0.0
    act_none = held * saved_mb + peak_mb
    act_full = held * saved_mb_full + peak_mb_full
    if tr is not None and rl_head is not None:
        fh = rl_head["fused"]
        act_how = (f"counted from the forward ({tr.attention} attention): {len(per_layer)} layers x "
                   f"{_fmt(sum(per_layer) / max(1, len(per_layer)))} + outside the layers {_fmt(tr.outside)}; TRL's "
                   f"fused LM head on {rl_head['n']:,} completion tokens: kept {_fmt(rl_head['kept'])}, backward "
                   f"{_fmt(rl_head['transient'])} ({fh['rows']:,} x 32,768 tile {_fmt(fh['tile'])}, fp32 gradients)"
                   + (f"; a recomputed layer peaks at {_fmt(layer_rc)}" if settings.recompute == "full" else ""))
    elif tr is not None and lean is not None:
        act_how = (f"counted from the forward ({tr.attention} attention): {len(per_layer)} layers x "
                   f"{_fmt(sum(per_layer) / max(1, len(per_layer)))} + outside the layers {_fmt(tr.outside)}; lean "
                   f"loss head ({lean['path']} path, {lean['rows']:,}-token chunks): kept {_fmt(lean['kept'])}, "
                   f"transient {_fmt(lean['transient'])}, no logits"
                   + (f"; a recomputed layer peaks at {_fmt(layer_rc)}" if settings.recompute == "full" else ""))
    elif tr is not None:
        act_how = (f"counted from the forward ({tr.attention} attention): {len(per_layer)} layers x "
                   f"{_fmt(sum(per_layer) / max(1, len(per_layer)))}"
                   + (f" + outside the layers {_fmt(tr.outside)} + fp32 loss gradients {_fmt(tr.loss_transient)} "
                      + (f"+ logits {_fmt(tr.logits)} (the pipeline schedule keeps the stage's output)" if stage is not None
                         else f"(the {_fmt(tr.logits)} of logits are not held: the step keeps only the loss)")
                      if last else " + the input ids" if first_saved else "")
                   + (f"; a recomputed layer peaks at {_fmt(layer_rc)}" if settings.recompute == "full" else ""))
    if cp_flex:
        act_how += (f"; CP x packing: SDPA saves each layer's all-gathered K/V ({_fmt(kv_gathered)} more per layer "
                    f"than the local shard), document mask {_fmt(mask_b)} (boolean + additive, shared by the layers)"
                    + (f", sequence padded to {seq_len:,} (a multiple of 2 x cp)" if seq_len != settings.seq_len
                       else ""))
    if stage is not None:
        act_how += f"; x {stage.in_flight:g} micro-batches in flight ({settings.pp_schedule})"
    if stock_why is not None:
        act_how += f"; loss.head lean is not used here ({stock_why}): the stock head is counted"
    vision_info = None
    if settings.vision is not None and (stage is None or stage.first):
        from .vision import vision_term

        # the tower runs first and its backward last: its saved tensors sit under the whole text step's peak
        vision_info = vision_term(config, settings.vision, rows=settings.micro_batch, seq_len=settings.seq_len,
                                  packing=settings.packing, dtype=trace_dtype, attention=settings.attention,
                                  recompute="none")
        full_info = (vision_term(config, settings.vision, rows=settings.micro_batch, seq_len=settings.seq_len,
                                 packing=settings.packing, dtype=trace_dtype, attention=settings.attention,
                                 recompute="full") if settings.recompute == "full" else vision_info)
        in_flight = stage.in_flight if stage is not None else 1.0
        act_none += in_flight * vision_info["bytes"]
        act_full += in_flight * full_info["bytes"]
        act_how += f"; {full_info['how'] if settings.recompute == 'full' else vision_info['how']}"
        vision_info = full_info if settings.recompute == "full" else vision_info
    act = act_full if settings.recompute == "full" else act_none
    rl_info = None
    ref_b = 0.0
    if rl is not None:
        from .rl import plan_phases

        # TRL loads the reference model in the policy's dtype and prepares it as the policy (FSDP2 / ZeRO-3 shard it)
        ref_b = params_b if rl.beta_value > 0 else 0.0
        gather = 0.0
        if settings.deepspeed and zero >= 3 and d_eff > 1:  # ds3_gather_for_generation (TRL's default: on)
            gather = n_total * wb - (params_b - getattr(params, "buffer_bytes", 0))
        phases = lambda train: plan_phases(  # noqa: E731
            config, rl, micro_batch=settings.micro_batch, grad_accum=settings.grad_accum, rows=trace_rows,
            row_len=trace_len, training=train, head=rl_head, trace_dtype=trace_dtype, attention=settings.attention,
            elem_bytes=eb, tp=tp, gather_for_generation=gather)
        rl_info = phases(act)
        act_none, act_full = phases(act_none)["peak"], phases(act_full)["peak"]
        rl_info["phases"]["training"]["how"] = (
            f"{'full recompute' if settings.recompute == 'full' else 'no recompute'}: micro-batch of "
            + (f"{settings.micro_batch} x {seq_len:,} positions, padded (prompt {rl.prompt_len:,} + completion "
               f"{rl.completion_len:,})" if rl.forwards == "padded" else
               f"{settings.micro_batch} samples packed into one row of {trace_len:,} real tokens")
            + f", TRL's fused LM head")
        act = rl_info["peak"]

    # communication buffers
    layer_local = max(layer_elems.values(), default=0.0)  # the largest FSDP unit (one decoder layer)
    prefetch = 0.0
    if fsdp:
        # FSDP2 in backward (traced: torch's FSDPMemTracker): the root unit (embeddings, final norm, head) stays
        # gathered; per layer unit (the largest): one gathered layer, its unsharded gradients, the reduce-scatter
        # buffer in the reduce dtype, and from 3 layers on the next layer's all-gather (prefetch)
        gathered_b, unsharded_grad_b = (2, 2) if amp else (wb, gb)  # MixedPrecisionPolicy(bf16, reduce fp32)
        reduce_b = 4 if amp else gb
        prefetch = layer_local * gathered_b if n_layers >= 3 else 0.0
        comm = root_local * gathered_b + layer_local * (gathered_b + unsharded_grad_b + reduce_b) + prefetch
        comm_txt = ("FSDP2: root unit (embeddings, head) gathered + per layer unit: gathered weights, unsharded "
                    "grads, reduce-scatter buffer" + (", next layer's all-gather" if prefetch else ""))
    elif mesh.dp > 1:
        comm = min(2 * 25 * 1024**2, local_elems * gb)
        comm_txt = "DDP/ZeRO gradient buckets (2 x 25 MiB, at most the gradients)"
    else:
        comm, comm_txt = 0.0, "one process per replica: no collectives"
    if tp > 1:
        comm_txt += "; TP all-reduces write the layer outputs (counted in activations)"
    if ep_info is not None:
        # AllToAllEP: per MoE layer the (token, expert) pairs go to their experts' ranks and the outputs come back;
        # one layer's exchange is in flight at a time (backward runs the reverse exchanges of the same sizes)
        a2a = 2 * tokens * ep_info["top_k"] * ep_info["hidden_size"] * eb
        comm += a2a
        ep_info["all_to_all_bytes"] = a2a
        comm_txt += (f" (a layer unit: its dense part + this rank's {ep_info['num_experts']}/{ep} experts gathered over "
                     f"efsdp={mesh.efsdp}); EP all-to-all of one MoE layer: dispatch + combine, each {int(tokens):,} "
                     f"tokens x top_k {ep_info['top_k']} x hidden {ep_info['hidden_size']} x {eb} B (assumes balanced "
                     f"routing: a rank receives tokens x top_k rows; a skewed router sends up to ep={ep} times more to "
                     f"one rank)")
    if cp_flex:
        # backward of one layer: the gradients of the gathered full-sequence K and V (every query head) before
        # the all-reduce that hands each rank its own slice
        comm += 2 * tokens * mesh.cp * heads * head_dim / tp * eb
        comm_txt += "; CP all-gather: one layer's full-sequence dK/dV before the all-reduce"
    elif mesh.cp > 1:
        comm += 2 * tokens * 2 * kv_width * eb
        comm_txt += "; CP ring: the next K/V chunk in flight, double-buffered"
    p2p = 0.0
    if stage is not None:
        # torch.distributed.pipelining allocates a receive buffer per micro-batch (PipelineStage's
        # _prepare_forward_infra / _setup_backward_recv_info): activations from the previous stage, gradients
        # from the next, each one layer input (the hidden state is replicated over tp)
        p2p = (stage.recv_fwd + stage.recv_grad) * hidden
        comm += p2p
        comm_txt += (f"; pipeline receive buffers: {stage.recv_fwd} activation + {stage.recv_grad} gradient x "
                     f"{_fmt(hidden)}")
    subtotal = params_b + master_b + grads_b + opt_bytes + ref_b + act + comm
    host_b = 0.0
    if settings.offload_optimizer:
        host_b = master_b + opt_bytes
        subtotal -= host_b
        master_b = opt_bytes = 0.0
    frag = settings.fragmentation * subtotal
    comp = {"parameters": params_b, "master_weights": master_b, "gradients": grads_b, "optimizer_state": opt_bytes,
            "activations": act, "comm_buffers": comm, "fragmentation": frag}
    if rl is not None:
        comp["reference_model"] = ref_b
    shard_txt = lambda on: f" / {d_eff} (ZeRO)" if on and d_eff > 1 else ""
    tp_txt = f", TP-split weights / {tp}" if tp > 1 else ""
    if opt.startswith(("galore", "apollo")):
        opt_txt = (f"{opt} rank {1 if opt == 'apollo_mini' else settings.rank} on {n_proj} matrices "
                   f"(side {settings.proj_side}; moments "
                   + ("8-bit blockwise" if opt.endswith("8bit") else f"{settings.lowrank_state_bytes or 4} B/element")
                   + f"), AdamW on the rest ({1 if opt.endswith('8bit') else momb} B/moment)")
    elif opt == "sgd":
        opt_txt = "SGD without momentum: no state"
    else:
        opt_txt = f"{opt}: 2 moments x {1 if opt.endswith('8bit') else momb} B/param"
    opt_txt += shard_txt(zero >= 1) if not (zero >= 3 and opt.startswith(("galore", "apollo"))) else \
        f" on the FSDP row shard (1/{d_eff}; the basis is not divided)"
    if settings.offload_optimizer:
        opt_txt = f"offloaded to host memory (DeepSpeed offload_optimizer): {_fmt(host_b)} per rank with the master copy; {opt_txt}"
    explain = {
        "parameters": (f"{wb} B x {n_total:,} params{tp_txt}{shard_txt(zero >= 3)}"
                       + (f" (stage {stage.index}: {_layer_span(stage.layers)}"
                          + (", embeddings" if stage.first else "") + (", final norm + head" if stage.last else "")
                          + ")" if stage is not None else "")),
        "master_weights": ("offloaded to host memory with the optimizer state" if settings.offload_optimizer else
                           f"fp32 master copy 4 B/param{shard_txt(zero >= 1)}" if mb else "none (weights are the master)"),
        "gradients": (f"{gb} B/param{' (incl. 4 B fp32 accumulation)' if settings.grad_fp32 else ''}{shard_txt(zero >= 2)}"
                      if not (settings.lowrank_grads and projected_sizes) else
                      f"low-rank accumulation: {gb} B/param of the unprojected weights + rank-{settings.rank} "
                      f"accumulators of the {n_proj} projected matrices ({_fmt(lowrank_acc)}) + full gradients of the "
                      f"{refreshing} largest refreshing at once (staggered over --update-proj-gap "
                      f"{settings.update_proj_gap}; the first step needs initial_basis: first_microbatch)"),
        "optimizer_state": opt_txt,
        "activations": (f"{'full recompute: layer inputs + 1 layer' if settings.recompute == 'full' else 'all layers' if stage is None else 'the stage' + chr(39) + 's layers'}"
                        f", {int(tokens):,} tokens/rank{' (seq / cp)' if mesh.cp > 1 else ''}"
                        f"{', attention/MLP / tp (norms replicated)' if tp > 1 else ''}"
                        + (f"; {act_how}" if act_how else ", + fp32 log-softmax and loss gradients (logits not held)")
                        + ("; incl. autocast's bf16 weight copies" if amp and not fsdp else "")),
        "comm_buffers": comm_txt,
        "fragmentation": f"{100 * settings.fragmentation:.0f} % allocator/fragmentation margin",
    }
    if ep_info is not None:
        _ep_explain(explain, ep_info, mesh, wb=wb, gb=gb, mb=mb, momb=momb, opt=opt)
    gbt = settings.micro_batch * settings.seq_len * settings.grad_accum * mesh.dp
    if rl is not None:
        peak_phase = {"generation": "generation", "no_grad": "the no-grad log-prob forwards",
                      "training": "the training step"}[rl_info["peak_phase"]]
        explain["activations"] = f"the largest of the rl phases below: {peak_phase}; training: " + explain["activations"]
        explain["reference_model"] = (f"beta {rl.beta_value:g}: TRL loads it in the policy's dtype ({wb} B/param)"
                                      + (", sharded as the policy" if zero >= 3 and d_eff > 1 else "")
                                      if ref_b else f"beta {rl.beta_value:g}: none loaded")
        g_rows = rl.generation_rows(settings.micro_batch, settings.grad_accum)
        real = rl.prompt_mean + rl.completion_mean
        layout = ("padded forwards" if rl.forwards == "padded" else
                  f"packed forwards (mean prompt {rl.prompt_mean:g} + completion {rl.completion_mean:g} = "
                  f"{real:g} real tokens per sample, {100 * real / seq_len:.0f} % of the padded positions)")
        rl_info["summary"] = (f"rl          {rl.trainer} (TRL 1.16): generation batch {settings.micro_batch} x "
                              f"{rl.steps_per_generation or settings.grad_accum} = {g_rows} samples/rank "
                              f"(G {rl.num_generations}), rows of prompt {rl.prompt_len:,} + completion "
                              f"{rl.completion_len:,}; {layout}; reference model: "
                              + ("yes" if ref_b else "none (beta 0)"))
    stage_info = None
    if stage is not None:
        stage_info = {"stage": stage.index, "layers": list(stage.layers), "first": stage.first, "last": stage.last,
                      "parameters": n_total, "in_flight": stage.in_flight, "activations": act,
                      "p2p_buffers": p2p, "peak": subtotal + frag,
                      "model_state": params_b + master_b + grads_b + opt_bytes}
    return Plan(
        model=model_name, n_params=n_total,
        mesh={"world_size": world or mesh.world_size, "pp": pp, "dp_replicate": mesh.dp_replicate,
              "dp_shard": mesh.dp_shard, "cp": mesh.cp, "tp": mesh.tp,
              **({"ep": ep, "efsdp": mesh.efsdp} if ep > 1 else {})},
        settings=asdict(settings), components=comp, explain=explain, peak=subtotal + frag,
        global_batch_tokens=gbt, activations_no_recompute=act_none, activations_full_recompute=act_full,
        playbook_activations=pb_act, gpu_memory=gpu_memory,
        extra={"zero": zero, "shard_degree": d_eff, "host_bytes_per_rank": host_b, "projected_matrices": n_proj, "prefetch_bytes": prefetch,
               # what the first decoder layer saves for backward, tensor by tensor (the traced count's evidence)
               "layer0_saved_tensors": [{"op": w, "shape": list(sh), "dtype": dt, "bytes": b}
                                        for w, sh, dt, b in (tr.layer0 if tr is not None else [])],
               "stage": stage_info, "document_mask_bytes": mask_b, "padded_seq_len": seq_len,
               **({"ep": ep_info} if ep_info is not None else {}),
               **({"rl": rl_info, "fused_head": rl_head} if rl is not None else {}),
               **({"lean_head": lean} if lean is not None else {}),
               **({"vision": vision_info} if vision_info is not None else {}),
               # loss.head lean asked for where the run keeps the stock head: the one reason
               **({"stock_head_reason": stock_why} if stock_why is not None else {})},
    )


def _check_ep(mesh, settings: Settings, pp: int) -> None:
    """Refuse what ``parallel.ep`` does not plan, with :func:`hf_gradfix.parallel.ep.check_combination`'s line (the one
    ``config check`` prints) where it has one."""
    from ..parallel.ep import check_combination

    ep, opt = mesh.ep, settings.optimizer
    check_combination(ep=ep, pp=pp, cp=mesh.cp, tp=mesh.tp, packing=settings.packing,
                      optimizer=opt if opt.startswith(("galore", "apollo")) else "none", optimizer_key="--optimizer")
    if settings.deepspeed:
        raise PlanError(f"parallel.ep={ep} with DeepSpeed: transformers shards the experts (ep) and the rest with FSDP2 "
                        "itself; plan without --deepspeed / a DeepSpeed --config, or with ep: 1")
    if settings.zero not in (None, 3):
        raise PlanError(f"--zero {settings.zero} with parallel.ep={ep}: transformers' expert parallelism shards every "
                        "parameter with FSDP2 (ZeRO-3: dense over dp_shard, experts over efsdp); drop --zero, or use ep: 1")
    if settings.rl is not None:
        raise PlanError(f"--rl with parallel.ep={ep}: TRL runs under expert parallelism are not planned; use ep: 1")


def _ep_shares(config, mesh, params, *, momb: int, optimizer: str) -> dict:
    """Per-rank elements of the routed experts and of the rest under ``mesh.ep`` (experts.py), and the optimizer state
    of the fullest rank (rank 0: FSDP2's first chunks are the full ones), built on the unpadded local shards."""
    from ..optim.memory import eight_bit_moment_bytes
    from .experts import _text, ep_rank_split, fsdp2_rows, moe_shape

    ep, efsdp, fsdp = mesh.ep, mesh.efsdp, mesh.dp_shard_cp
    experts = [p for p in params if p.expert]
    if not experts:
        raise PlanError(f"parallel.ep={ep}: none of the model's parameters is a routed-expert tensor (the config has no "
                        "'grouped_gemm' entry in base_model_ep_plan, and no (num_experts, ...) tensor under an experts "
                        "module); transformers cannot shard it by expert: use ep: 1")
    n_experts, top_k = moe_shape(config)
    listed = range(fsdp) if fsdp <= 64 else (0, fsdp - 1)
    per_rank = {r: ep_rank_split(params, ep=ep, efsdp=efsdp, fsdp=fsdp, rank=r) for r in listed}
    opt_b = 0.0
    for p in params:  # rank 0: ep index 0, efsdp index 0, fsdp index 0
        shape = tuple(p.shape) or (1,)
        rows = fsdp2_rows(fsdp2_rows(shape[0], ep, 0)[0], efsdp, 0)[0] if p.expert else fsdp2_rows(shape[0], fsdp, 0)[0]
        n = rows * math.prod(shape[1:])
        if optimizer == "sgd":
            continue
        # AdamW's moments are zeros_like(the DTensor parameter): its unpadded local shard; + the fp32 step
        opt_b += (eight_bit_moment_bytes(n) if optimizer.endswith("8bit") else 2 * n * momb) + 4
    return {"ep": ep, "efsdp": efsdp, "fsdp": fsdp, "num_experts": n_experts, "top_k": top_k,
            "hidden_size": _text(config).hidden_size, "moe_layers": len({p.layer for p in experts}),
            "expert_params": sum(p.numel for p in experts),
            "dense_params": sum(p.numel for p in params if not p.expert),
            "expert_padded": per_rank[0]["expert_padded"], "dense_padded": per_rank[0]["dense_padded"],
            "per_rank": per_rank, "optimizer_bytes": opt_b}


def _ep_explain(explain: dict, info: dict, mesh, *, wb: int, gb: int, mb: int, momb: int, opt: str) -> None:
    """The parameters / master / gradients / optimizer lines of a plan under expert parallelism."""
    ep, efsdp, fsdp = info["ep"], info["efsdp"], info["fsdp"]
    padded = info["expert_padded"] + info["dense_padded"]
    shards = (f"{info['expert_params']:,} routed-expert params as {info['num_experts']}/{ep} whole experts per rank"
              + (f", FSDP2 over efsdp={efsdp}" if efsdp > 1 else " (efsdp=1: not split further)")
              + f"; {info['dense_params']:,} dense params FSDP2 over {fsdp}")
    explain["parameters"] = (f"{wb} B x FSDP2's padded shards, {padded:,} elements per rank: {shards}"
                             + (", replicated over dp_replicate" if mesh.dp_replicate > 1 else ""))
    explain["gradients"] = f"{gb} B x the same padded shards (FSDP2's reduce-scatter output)"
    if mb:
        explain["master_weights"] = f"fp32 master copy 4 B x the same padded shards"
    explain["optimizer_state"] = ("SGD without momentum: no state" if opt == "sgd" else
                                  f"{opt}: 2 moments x {1 if opt.endswith('8bit') else momb} B/param of rank 0's "
                                  "unpadded shards (the fullest rank; experts and dense as above)")


def _layer_span(layers: list[int]) -> str:
    """``layers 0-15`` / ``layers 0-3, 8-11`` (an interleaved stage's chunks)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "layers " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
