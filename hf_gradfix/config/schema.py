"""Typed schema of the ``hf_gradfix`` configuration section.

Every section is a plain dataclass; every setting is a dataclass field with a
type hint and a default that is right for most users.  Validation in
:mod:`hf_gradfix.config.loader` is generic: it introspects the fields and their
type hints, so adding a section (``packing``, ``optim``, ``parallel``, ...) is a
matter of writing its dataclass and adding one field to :class:`GradFixConfig`::

    @dataclass
    class PackingConfig:
        enabled: bool = False

    @dataclass
    class GradFixConfig:
        loss: LossConfig = field(default_factory=LossConfig)
        packing: PackingConfig = field(default_factory=PackingConfig)
        ...

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]``,
``Optional[X]`` / ``X | None`` (and other unions of these), ``list[X]``,
``tuple[X, ...]``, ``dict[str, X]``, ``Any`` and nested dataclasses (sections).

The optional ``metadata={"help": ...}`` on a field is a one-line description
used in documentation and error messages.  Numeric fields carry their range in the
metadata, checked by the loader (never at ``train()``): ``"min"`` / ``"max"``
(inclusive), ``"above"`` (exclusive lower bound) and ``"special"`` (one extra
allowed value, e.g. ``-1`` = "the rest of the world").  Every float must be finite.

This module imports only the standard library (and :mod:`hf_gradfix.errors`, which imports nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import HfGradfixError

__all__ = [
    "ConfigError",
    "CountRule",
    "OnUndetermined",
    "AuxLossMode",
    "OnNonFinite",
    "LossConfig",
    "PackingConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "GradFixConfig",
]


class ConfigError(HfGradfixError, ValueError):
    """An invalid ``hf_gradfix`` configuration (unknown key, bad value, bad file).

    ``problems`` lists the individual problems (one readable line each); the
    exception message is those lines, plus the source when it is a file.

    Example::

        >>> from hf_gradfix.config import ConfigError, config_from_dict
        >>> try:
        ...     config_from_dict({"loss": {"count_rule": "shift"}})
        ... except ConfigError as err:
        ...     print(err)
        hf_gradfix.loss.count_rule: invalid value 'shift'; allowed values: 'auto', 'shifted', 'unshifted', 'elements' (did you mean 'shifted'?)
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]


CountRule = Literal["auto", "shifted", "unshifted", "elements"]
OnUndetermined = Literal["error", "warn"]
AuxLossMode = Literal["micro", "micro_batch_mean", "global", "previous", "bias", "none", "as_is"]
OnNonFinite = Literal["warn", "skip", "error"]
LossHead = Literal["stock", "lean"]


def _default(name: str, cls: type) -> Any:
    """A field's default value (what a setting left out is)."""
    return cls.__dataclass_fields__[name].default


@dataclass
class LossConfig:
    """Exact loss normalization settings (section ``hf_gradfix.loss``)."""

    enabled: bool = field(
        default=True,
        metadata={"help": "apply exact loss normalization"},
    )
    count_rule: CountRule = field(
        default="auto",
        metadata={
            "help": "how targets are counted: 'shifted' (causal LM, labels shifted by one), "
            "'unshifted' (token classification / masked LM), 'elements' (every element "
            "counts); 'auto' = detected by probing the model; a rule the probe contradicts is refused, one the "
            "probe cannot decide is used as set"
        },
    )
    eval_token_mean: bool = field(
        default=True,
        metadata={"help": "eval_loss = exact token mean over the whole eval set and all ranks"},
    )
    on_undetermined: OnUndetermined = field(
        default="warn",
        metadata={
            "help": "a loss whose normalization a probe cannot tell: 'warn' = that trainer trains exactly as stock, "
            "with one warning naming what could not be read; 'error' = stop with that message (a batch that is not "
            "a Mapping always trains as stock, with one warning)"
        },
    )
    aux_loss: AuxLossMode = field(
        default="micro",
        metadata={
            "help": "MoE router load-balancing loss convention (docs/moe.md): 'micro' (alias 'micro_batch_mean') = "
            "each micro-batch's loss averaged over micro-batches and ranks; 'global' = the loss of the whole window, "
            "expert frequencies over every token of every micro-batch and rank (exact; one extra no-grad forward per "
            "micro-batch); 'previous' = the previous window's frequencies (cheap approximation); 'bias' = "
            "aux-loss-free balancing (DeepSeek-V3): each router's correction bias moves by aux_bias_rate toward "
            "balance after every window, by the window's counts over all micro-batches and ranks; 'none' = no router "
            "loss; 'as_is' = left as the model/trainer adds it (stock)"
        },
    )
    aux_bias_rate: float = field(
        default=0.001,
        metadata={"min": 0.0, "max": 1.0,
                  "help": "aux_loss: bias: the bias update speed gamma (DeepSeek-V3: 0.001): after each window, "
                  "bias_e += gamma * sign(mean load - load_e) per MoE layer"},
    )
    head: LossHead = field(
        default="stock",
        metadata={
            "help": "the causal-LM head of the plugin's own loss: 'stock' = the model's (logits materialized); "
            "'lean' = projection and cross-entropy together, a chunk of tokens at a time (torch's "
            "linear_cross_entropy), so a micro-batch's logits never exist; exact like every path; a model whose "
            "logits are transformed before its loss (soft-capping, scaling) keeps the stock head, said once "
            "(docs/loss.md)"
        },
    )
    on_nonfinite: OnNonFinite = field(
        default="warn",
        metadata={
            "help": "a NaN/inf loss or gradient: 'warn' = a warning naming the step and micro-batch, then stock "
            "behaviour (the update is applied); 'skip' = that optimizer step is skipped (weights, optimizer state "
            "and lr schedule unchanged); 'error' = stop with an error naming the step and micro-batch"
        },
    )

    def conflicts(self) -> list[tuple[str, str]]:
        """``(key, problem)`` for each setting that does nothing with the others given (every path that reads it
        checked: the router-loss conventions and the lean head run inside the loss fix only, ``aux_bias_rate`` is read
        by ``aux_loss: bias`` only).

        >>> LossConfig(aux_bias_rate=0.01).conflicts()[0][0]
        'aux_bias_rate'
        >>> LossConfig(enabled=False, head="lean").conflicts()[0][0]
        'head'
        """
        out: list[tuple[str, str]] = []
        if self.aux_bias_rate != _default("aux_bias_rate", LossConfig) and self.aux_loss != "bias":
            out.append(("aux_bias_rate", f"invalid value {self.aux_bias_rate:g}; aux_bias_rate is the bias update "
                                         f"speed of aux_loss: bias only, aux_loss: {self.aux_loss} would ignore it: set "
                                         "aux_loss: bias or remove aux_bias_rate"))
        if self.aux_loss == "bias" and self.aux_bias_rate == 0:
            out.append(("aux_bias_rate", "invalid value 0; with aux_loss: bias a rate of 0 never moves the router "
                                         "biases, so nothing is balanced: set a rate > 0 (DeepSeek-V3: 0.001), or "
                                         "aux_loss: none for no router loss at all"))
        if not self.enabled:
            # what loss.enabled: false leaves: the model's and trainer's own loss, stock; on_nonfinite still acts
            if self.aux_loss in ("global", "previous", "bias", "none"):
                out.append(("aux_loss", f"invalid value {self.aux_loss!r}; the router-loss conventions are part of "
                                        "the loss fix, which loss.enabled: false turns off (the router loss stays "
                                        "as transformers adds it): set loss.enabled: true or remove aux_loss"))
            if self.head == "lean":
                out.append(("head", "invalid value 'lean'; the lean head is the loss fix's own head, which "
                                    "loss.enabled: false turns off (the model's head and loss run as stock): set "
                                    "loss.enabled: true or remove head"))
        return out


PackingMode = Literal["varlen", "rows"]
CPBalance = Literal["per_document", "long_documents"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
PackingAttention = Literal["auto", "keep"]
PackingBalance = Literal["tokens", "compute"]


@dataclass
class PackingConfig:
    """Padding-free packing of training samples (section ``hf_gradfix.packing``)."""

    enabled: bool = field(
        default=False,
        metadata={"help": "bin-pack training samples into rows of at most token_budget tokens"},
    )
    token_budget: int = field(
        default=4096,
        metadata={"min": 8, "max": 2**24,
                  "help": "tokens per packed row (one bin = one micro-batch; >= 8, at least your longest sample)"},
    )
    mode: PackingMode = field(
        default="varlen",
        metadata={
            "help": "'varlen': one row with cu_seq_lens (FlashAttention / reference varlen / sdpa / eager); "
            "'rows': restarted position_ids only, no cu_seq_lens (sdpa / eager)"
        },
    )
    attention: PackingAttention = field(
        default="auto",
        metadata={
            "help": "'auto': varlen mode switches the model to flash_attention_2 where flash-attn and CUDA "
            "exist, else to the pure-PyTorch reference varlen attention; 'keep': leave the model's attention"
        },
    )
    guard: bool = field(
        default=True,
        metadata={"help": "before training, refuse a model that mixes packed sequences (packed-vs-separate forward)"},
    )
    balance: PackingBalance = field(
        default="tokens",
        metadata={
            "help": "how the packed rows of a step are dealt to the data-parallel ranks: 'tokens' = rows of equal "
            "tokens side by side; 'compute' = rows of equal cost L * (c + L) summed over their documents (attention "
            "grows with L**2; c from the model config), so no rank waits for another's long documents; the same "
            "rows, the loss unchanged (docs/packing.md)"
        },
    )
    buffer_size: int = field(
        default=1000,
        metadata={"min": 2, "max": 2**31 - 1,
                  "help": "streams (IterableDataset): samples packed together (best-fit-decreasing) in the online buffer (>= 2)"},
    )
    rl_forwards: bool = field(
        default=False,
        metadata={
            "help": "TRL GRPOTrainer / RLOOTrainer (TRL 1.16): run the policy's log-prob forwards (training, old and "
            "reference) padding-free, each sample's prompt + completion one document of a varlen row (positions "
            "restarted, cu_seq_lens), log-probs and entropies put back in TRL's padded layout; uses packing.attention "
            "and packing.guard, independent of packing.enabled (which packs a dataset of token samples)"
        },
    )

    def conflicts(self) -> list[tuple[str, str]]:
        """``(key, problem)`` for each setting that does nothing with the others given.

        >>> PackingConfig(balance="compute").conflicts()[0][0]
        'balance'
        """
        if self.balance != "tokens" and not self.enabled:  # read where a packed dataset's rows are dealt, nowhere else
            return [("balance", f"invalid value {self.balance!r}; balance deals the rows of a packed dataset to the "
                                "data-parallel ranks, and packing.enabled: false packs none (rl_forwards packs TRL's "
                                "forwards, not dataset rows): set packing.enabled: true or remove balance")]
        return []


OptimizerName = Literal["none", "galore_adamw", "galore_adamw8bit", "apollo_adamw", "apollo_mini"]
ProjSide = Literal["auto", "right", "left", "std", "reverse_std"]
ProjMethod = Literal["auto", "svd", "randomized"]
OnSwitch = Literal["keep", "reset", "reproject"]
InitialBasis = Literal["accumulated", "first_microbatch"]
ScaleType = Literal["channel", "tensor"]


@dataclass
class OptimizerConfig:
    """Low-rank optimizer for the Trainer (section ``hf_gradfix.optimizer``).

    The Trainer's own ``learning_rate``, ``weight_decay`` (with its no-decay parameters), ``adam_beta1``,
    ``adam_beta2`` and ``adam_epsilon`` are used as they are; this section adds the low-rank settings.
    """

    name: OptimizerName = field(
        default="none",
        metadata={
            "help": "'none': keep the Trainer's optimizer; 'galore_adamw': GaLore (SVD subspace); 'galore_adamw8bit': GaLore "
            "with bitsandbytes' 8-bit moments; "
            "'apollo_adamw': APOLLO (random projection, channel-wise scaling); 'apollo_mini': APOLLO-Mini (rank 1)"
        },
    )
    targets: list[str] | None = field(
        default=None,
        metadata={
            "help": "module-name patterns (substring or regex) of the weights to project; "
            "null or ['all-linear'] = every nn.Linear except the output head"
        },
    )
    exclude: list[str] = field(default_factory=list, metadata={"help": "module-name patterns never projected"})
    rank: int | None = field(
        default=None, metadata={"min": 1, "max": 65536, "help": "subspace rank (null: 128; apollo_mini: 1)"}
    )
    update_proj_gap: int = field(
        default=200, metadata={"min": 1, "max": 2**31 - 1, "help": "optimizer steps between basis refreshes"}
    )
    scale: float | None = field(
        default=None,
        metadata={
            "above": 0,
            "max": 1e6,
            "help": "update scale, a finite number > 0 (null: 0.25 for GaLore, 1 for APOLLO, 128 for APOLLO-Mini)",
        },
    )
    proj_side: ProjSide = field(
        default="auto", metadata={"help": "which side of each matrix the subspace reduces ('auto' = in-features)"}
    )
    proj_method: ProjMethod = field(
        default="auto",
        metadata={"help": "GaLore basis: 'svd', 'randomized', or 'auto' (randomized when rank < min(m, n) / 4)"},
    )
    on_switch: OnSwitch = field(
        default="keep", metadata={"help": "moments when the basis changes: 'keep', 'reproject' or 'reset'"}
    )
    min_size: int = field(
        default=0, metadata={"min": 0, "max": 2**31 - 1, "help": "matrices whose smaller side is below this stay AdamW"}
    )
    stagger: bool = field(default=False, metadata={"help": "spread basis refreshes over the gap (no step-time spike)"})
    scale_type: ScaleType | None = field(
        default=None, metadata={"help": "APOLLO scaling: 'channel' or 'tensor' (null: channel; tensor for apollo_mini)"}
    )
    seed: int = field(
        default=0, metadata={"min": 0, "max": 2**32 - 1, "help": "seed of randomized sketches / random projections (0 .. 2**32-1)"}
    )
    lowrank_grads: bool = field(
        default=False,
        metadata={
            "help": "GaLore only: project each micro-batch's gradient into a rank-r accumulator as backward produces "
            "it and free the full gradient (gradient accumulation and DDP keep working; refreshes are staggered; "
            "max_grad_norm clips the accumulators)"
        },
    )
    initial_basis: InitialBasis = field(
        default="accumulated",
        metadata={
            "help": "with lowrank_grads: the first basis from the accumulated gradient (exact; the first step holds "
            "full gradients) or from each matrix's first micro-batch (no step holds them all)"
        },
    )

    def conflicts(self) -> list[tuple[str, str]]:
        """``(key, problem)`` for each setting the chosen optimizer would silently ignore or override.

        >>> OptimizerConfig(name="apollo_mini", rank=64).conflicts()[0][0]
        'rank'
        """
        out: list[tuple[str, str]] = []
        galore = self.name in ("galore_adamw", "galore_adamw8bit")
        apollo = self.name in ("apollo_adamw", "apollo_mini")
        if self.name == "apollo_mini" and self.rank not in (None, 1):
            out.append(("rank", f"invalid value {self.rank}; apollo_mini is rank 1 by definition: remove rank, or "
                                "use name: apollo_adamw for APOLLO at this rank"))
        if self.scale_type is not None and not apollo:
            out.append(("scale_type", f"invalid value {self.scale_type!r}; scale_type applies to APOLLO only "
                                      f"(apollo_adamw, apollo_mini), {self.name!r} would ignore it: remove it"))
        if self.proj_method != "auto" and not galore:
            out.append(("proj_method", f"invalid value {self.proj_method!r}; proj_method applies to GaLore only "
                                       f"(galore_adamw, galore_adamw8bit), {self.name!r} would ignore it: remove it"))
        if self.lowrank_grads and not galore:
            out.append(("lowrank_grads", f"invalid value True; lowrank_grads is GaLore-only (galore_adamw, "
                                         f"galore_adamw8bit), not {self.name!r}: remove it or pick GaLore"))
        if self.initial_basis != "accumulated" and not self.lowrank_grads:
            out.append(("initial_basis", f"invalid value {self.initial_basis!r}; initial_basis applies with "
                                         "lowrank_grads: true only: set lowrank_grads or remove initial_basis"))
        return out


@dataclass
class ParallelConfig:
    """ND-parallel degrees (section ``hf_gradfix.parallel``); their product is the number of processes.

    ``hf-gradfix launch`` writes them into accelerate's own ``parallelism_config`` keys (with the prefix
    accelerate needs); at run time they are checked against the world size and the model.
    """

    dp_replicate: int = field(
        default=1,
        metadata={"min": 1, "max": 2**20, "special": -1, "help": "data-parallel replicas (HSDP outer dim; -1 = the rest)"},
    )
    dp_shard: int = field(
        default=-1,
        metadata={"min": 1, "max": 2**20, "special": -1, "help": "FSDP2 shard degree (-1 = the rest of the world)"},
    )
    tp: int = field(default=1, metadata={"min": 1, "max": 2**20, "help": "tensor-parallel degree (ranks that split each layer)"})
    cp: int = field(default=1, metadata={"min": 1, "max": 2**20, "help": "context-parallel degree (ranks that split each sequence; GPU only)"})
    pp: int = field(default=1, metadata={"min": 1, "max": 2**20, "help": "pipeline-parallel degree (ranks that hold different layers; outermost mesh dim)"})
    ep: int = field(
        default=1,
        metadata={"min": 1, "max": 2**20, "help": "expert-parallel degree: ranks each MoE layer's experts are split over "
                  "(transformers' DistributedConfig ep_size, all-to-all dispatch); borrowed from dp_shard: the experts "
                  "are FSDP2-sharded over the rest (efsdp = dp_shard x tp / ep)"},
    )
    pp_schedule: PipelineSchedule = field(
        default="1f1b",
        metadata={"help": "pipeline schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble (the last two run any pp_virtual_stages, 1 included: zero_bubble with 1 is ZB-H1, one stage per rank with the backward split into input and weight gradients; 1f1b and gpipe run one stage per rank)"},
    )
    pp_virtual_stages: int = field(
        default=1,
        metadata={"min": 1, "max": 2**10, "help": "pipeline stages per pp rank: 1 with every schedule; > 1 only with interleaved_1f1b / zero_bubble"},
    )
    # per_document stays the default: training here attends through SDPA with a dense mask, which computes every
    # score whatever the balance, so long_documents saves only its fewer pads there (0.4-1.5 % of the score work,
    # cp 2-8); its gains (fewer 128-blocks, a faster step) are on block-sparse kernels, which are not wired here
    # (benchmarks/results/cp_packing_balance.md)
    cp_balance: CPBalance = field(
        default="per_document",
        metadata={
            "help": "how cp > 1 lays packed rows over the cp ranks: 'per_document' = every document padded to a "
            "multiple of 2 x cp and cut head-tail over all ranks (equal allowed pairs per rank); 'long_documents' = "
            "only documents longer than cp_balance_threshold cut so, the others kept whole and dealt to the rank with "
            "the least attention work (fewer pads and 128-blocks; docs/multi-device.md); exact either way"
        },
    )
    cp_balance_threshold: int | None = field(
        default=None,
        metadata={
            "min": 1, "max": 2**24,
            "help": "cp_balance: long_documents only: documents longer than this many tokens are cut over the cp "
            "ranks; null = only those longer than a rank's share of the row (row tokens / cp), which are always cut"
        },
    )

    def mesh_given(self) -> bool:
        """True when a degree or the schedule differs from its default: the section then builds the mesh, and its
        ``cp`` is the run's (:func:`hf_gradfix.config.resolve.parallel_requested`, the run time's rule). With the
        defaults the launch's mesh stands (accelerate's ``parallelism_config`` may set cp there).

        >>> ParallelConfig().mesh_given(), ParallelConfig(tp=2).mesh_given()
        (False, True)
        >>> ParallelConfig(cp_balance="long_documents").mesh_given()  # a layout option, not a mesh
        False
        """
        return any(getattr(self, f.name) != f.default for f in dataclasses.fields(self)
                   if not f.name.startswith("cp_balance"))

    def conflicts(self) -> list[tuple[str, str]]:
        """``(key, problem)`` for each setting the others given would silently ignore.

        >>> ParallelConfig(cp_balance_threshold=512).conflicts()[0][0]
        'cp_balance_threshold'
        >>> ParallelConfig(tp=2, cp_balance="long_documents").conflicts()[0][0]
        'cp_balance'
        """
        if self.cp_balance_threshold is not None and self.cp_balance != "long_documents":
            return [("cp_balance_threshold",
                     f"invalid value {self.cp_balance_threshold}; cp_balance_threshold applies with cp_balance: "
                     f"long_documents only, {self.cp_balance!r} would ignore it: set cp_balance: long_documents or "
                     "remove cp_balance_threshold")]
        if self.cp_balance == "long_documents" and self.cp == 1 and self.mesh_given():
            return [("cp_balance", cp_balance_without_cp("this section's mesh has cp: 1"))]
        return []


def cp_balance_without_cp(why: str) -> str:
    """The one problem text of ``parallel.cp_balance: long_documents`` on a run whose cp is 1, wherever it is found
    (this schema, a launch file's accelerate keys, the trainer's mesh at install); ``why``: where cp 1 comes from."""
    return (f"invalid value 'long_documents'; cp_balance lays packed rows over the context-parallel ranks, and {why}, "
            "so nothing is split: set parallel.cp > 1 (or accelerate's parallelism_config_cp_size) or remove cp_balance")


@dataclass
class GradFixConfig:
    """The whole ``hf_gradfix`` section (top level of the plugin config)."""

    loss: LossConfig = field(
        default_factory=LossConfig,
        metadata={"help": "exact loss normalization"},
    )
    packing: PackingConfig = field(
        default_factory=PackingConfig,
        metadata={"help": "padding-free packing with FlashAttention-style varlen attention"},
    )
    optimizer: OptimizerConfig = field(
        default_factory=OptimizerConfig,
        metadata={"help": "low-rank optimizers (GaLore, APOLLO) for the Trainer"},
    )
    parallel: ParallelConfig = field(
        default_factory=ParallelConfig,
        metadata={"help": "ND-parallel mesh: pp x dp_replicate x dp_shard x tp x cp"},
    )
    log_fixes: bool = field(
        default=True,
        metadata={"help": "one log line per trainer naming each fix applied and why"},
    )
