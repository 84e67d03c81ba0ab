"""The Trainer side of the low-rank optimizers: build GaLore / APOLLO from the ``optimizer`` section or from
``Trainer(optimizer_cls_and_kwargs=(GaLoreAdamW, {...}))``, with the Trainer's own hyper-parameters.

transformers' built-in ``optim="galore_adamw"`` replaces the Trainer's decay/no-decay groups and forwards only
``lr`` (weight_decay, betas and eps are silently dropped), pickles a projector object into the optimizer state
(resume fails under ``weights_only=True``) and its layer-wise variants step on un-reduced gradients.  Here
the optimizer gets ``learning_rate``, ``weight_decay`` (and the Trainer's no-decay parameter names),
``adam_beta1/2`` and ``adam_epsilon`` exactly, and its state is tensors only.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..config.schema import OptimizerConfig
from ..errors import GradFixError
from ..optim import ApolloAdamW, GaLoreAdamW, GaLoreAdamW8bit, LowRankAdamW, apollo_mini

__all__ = [
    "build_low_rank_optimizer", "optimizer_requested", "check_optimizer_setup", "lowrank_optimizer_of",
    "begin_lowrank_training", "end_lowrank_training", "route_clipping",
]

_CLASSES = {"galore_adamw": GaLoreAdamW, "galore_adamw8bit": GaLoreAdamW8bit, "apollo_adamw": ApolloAdamW, "apollo_mini": apollo_mini}


def _is_ours(cls: Any) -> bool:
    return cls is apollo_mini or (isinstance(cls, type) and issubclass(cls, LowRankAdamW))


def optimizer_requested(trainer: Any, cfg: OptimizerConfig) -> tuple[Any, dict] | None:
    """``(class or factory, kwargs)`` when this trainer should get one of our optimizers, else None."""
    pair = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if pair is not None and _is_ours(pair[0]):
        return pair[0], dict(pair[1] or {})
    if cfg.name != "none":
        return _CLASSES[cfg.name], _kwargs_from_config(cfg)
    return _from_transformers_optim(trainer.args)


def _parse_optim_args(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").replace(" ", "").split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def _from_transformers_optim(args: Any) -> tuple[Any, dict] | None:
    """``optim="galore_adamw"`` / ``"apollo_adamw"`` (not layer-wise, not 8-bit): the same optimizer, built by us.

    Same settings as transformers' handler (``optim_target_modules``, ``optim_args`` rank / update_proj_gap /
    scale / proj_type, exact SVD, moments kept), but with the Trainer's weight decay, no-decay groups, betas
    and eps, and a tensor-only state that resumes.
    """
    name = str(getattr(args.optim, "value", args.optim))
    if name not in ("galore_adamw", "apollo_adamw"):
        return None
    opt_args = _parse_optim_args(getattr(args, "optim_args", None))
    targets = getattr(args, "optim_target_modules", None)
    if targets is None:
        return None  # transformers raises its own clear error
    if isinstance(targets, str):
        targets = "all-linear" if targets.replace("_", "-") == "all-linear" else [targets]
    kw: dict[str, Any] = {
        "targets": targets,
        "rank": int(opt_args.get("rank", 128)),
        "update_proj_gap": int(opt_args.get("update_proj_gap", 200)),
        "proj_side": opt_args.get("proj_type", "std"),
    }
    if name == "galore_adamw":
        kw.update(scale=float(opt_args.get("scale", 0.25)), proj_method="svd")
        return GaLoreAdamW, kw
    if opt_args.get("proj", "random") != "random":
        return None  # APOLLO with an SVD projector: left to transformers / apollo-torch
    kw.update(scale=float(opt_args.get("scale", 1.0)), scale_type=opt_args.get("scale_type", "channel"))
    return ApolloAdamW, kw


def _kwargs_from_config(cfg: OptimizerConfig) -> dict:
    kw: dict[str, Any] = {
        "update_proj_gap": cfg.update_proj_gap,
        "proj_side": cfg.proj_side,
        "on_switch": cfg.on_switch,
        "min_size": cfg.min_size,
        "stagger": cfg.stagger,
        "seed": cfg.seed,
        "exclude": list(cfg.exclude),
    }
    targets = cfg.targets
    if targets is not None:
        kw["targets"] = "all-linear" if list(targets) == ["all-linear"] else list(targets)
    if cfg.rank is not None:
        kw["rank"] = cfg.rank
    if cfg.scale is not None:
        kw["scale"] = cfg.scale
    if cfg.name in ("galore_adamw", "galore_adamw8bit"):
        kw["proj_method"] = cfg.proj_method
        if cfg.lowrank_grads:
            kw.update(lowrank_grads=True, initial_basis=cfg.initial_basis, stagger=True)
    elif cfg.scale_type is not None:
        kw["scale_type"] = cfg.scale_type
    return kw


def check_optimizer_setup(trainer: Any, cfg: OptimizerConfig) -> None:
    """Refuse setups a low-rank optimizer cannot be exact in, before any work is done."""

    args = trainer.args
    optim_name = str(getattr(args.optim, "value", args.optim))
    if "layerwise" in optim_name:
        world = int(getattr(args, "world_size", 1) or 1)
        ga = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        if world > 1 or ga > 1:
            raise GradFixError(
                f"TrainingArguments.optim={optim_name!r} steps each weight inside backward on its un-reduced, "
                f"un-accumulated gradient, so it is wrong with {world} processes and gradient_accumulation_steps={ga} "
                "(transformers refuses or silently mis-steps). Use the hf_gradfix optimizer section instead, e.g. "
                "optimizer: {name: galore_adamw, rank: 128, lowrank_grads: true}, which steps once on the reduced, accumulated "
                "gradient and, like layer-wise mode, keeps no full gradient of the projected weights"
            )
    requested = optimizer_requested(trainer, cfg)
    wants = cfg.name != "none" or requested is not None
    lowrank = requested is not None and bool(requested[1].get("lowrank_grads", False))
    if cfg.lowrank_grads and cfg.name not in ("galore_adamw", "galore_adamw8bit"):
        raise GradFixError(
            f"hf_gradfix.optimizer.lowrank_grads=true needs optimizer.name: galore_adamw (got {cfg.name!r}): APOLLO "
            "scales the raw full gradient, so its step cannot use projected gradients; set lowrank_grads: false"
        )
    if lowrank and getattr(trainer, "is_fsdp_enabled", False):
        raise GradFixError(
            "hf_gradfix.optimizer.lowrank_grads=true under FSDP: FSDP2 reduce-scatters each full gradient inside its "
            "own backward hooks, before a per-parameter hook could project it, and the shard it keeps is already "
            "1/world of the gradient. Set lowrank_grads: false under FSDP, or train with DDP / one process"
        )
    if lowrank and getattr(args, "fp16", False):
        raise GradFixError(
            "hf_gradfix.optimizer.lowrank_grads=true with fp16=True: the fp16 GradScaler unscales and checks only the "
            "full .grad tensors, not the low-rank accumulators. Use bf16=True (or fp32), or set lowrank_grads: false"
        )
    if wants and getattr(trainer, "is_deepspeed_enabled", False):
        raise GradFixError(
            f"hf_gradfix.optimizer.name={cfg.name!r}: low-rank optimizers need each weight's 2-D gradient, which "
            "DeepSpeed ZeRO flattens and partitions. Use FSDP2 (accelerate fsdp_version: 2) or DDP, or set "
            "optimizer.name: none"
        )


def build_low_rank_optimizer(trainer: Any, model: torch.nn.Module, factory: Any, kwargs: dict) -> LowRankAdamW:
    """Our optimizer for ``model`` with the Trainer's hyper-parameters (explicit ``kwargs`` win)."""
    args = trainer.args
    decay = set(trainer.get_decay_parameter_names(model))
    no_decay = [n for n, p in model.named_parameters() if p.requires_grad and n not in decay]
    merged = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "no_decay": no_decay,
    }
    merged.update(kwargs)
    return factory(model, **merged)


def lowrank_optimizer_of(trainer: Any) -> LowRankAdamW | None:
    """The trainer's optimizer when it is one of ours with ``lowrank_grads=True`` (through accelerate's wrapper),
    however it arrived: the config, ``optimizer_cls_and_kwargs`` or ``Trainer(optimizers=(opt, None))``."""
    optimizer = getattr(trainer, "optimizer", None)
    for _ in range(4):  # AcceleratedOptimizer (and wrappers like it) keep the real one in .optimizer
        if isinstance(optimizer, LowRankAdamW) or optimizer is None:
            break
        optimizer = getattr(optimizer, "optimizer", None)
    if isinstance(optimizer, LowRankAdamW) and optimizer.lowrank_grads:
        return optimizer
    return None


def begin_lowrank_training(trainer: Any) -> None:
    """Start of ``train()``: the optimizer's accumulation hooks on the weights (again, after an earlier ``train()``
    took them off), and max_grad_norm routed to it."""
    optimizer = lowrank_optimizer_of(trainer)
    if optimizer is None:
        return
    model = trainer.model
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    optimizer.attach_lowrank_hooks(model)
    optimizer.clipping_routed = True


def end_lowrank_training(trainer: Any) -> None:
    """End of ``train()`` (also by an exception): the hooks come off, so the model trains like any other model
    afterwards (a second, plain trainer gets every gradient; DDP all-reduces every weight again)."""
    optimizer = lowrank_optimizer_of(trainer)
    if optimizer is not None:
        optimizer.detach_lowrank_hooks()


def route_clipping(trainer: Any) -> None:
    """Make the Trainer's ``accelerator.clip_grad_norm_`` clip what a ``lowrank_grads`` optimizer steps on.

    The Trainer (4.57 and 5.x) clips, and logs ``grad_norm``, through ``self.accelerator.clip_grad_norm_(
    model.parameters(), max_grad_norm)``, which sees only ``.grad``; the projected weights' gradients live in the
    optimizer's rank-r accumulators instead.  An instance attribute on this trainer's accelerator (its class is
    untouched) sends the call to :meth:`LowRankAdamW.clip_grad_norm_` (plain gradients + accumulators, all-reduced
    first under DDP) whenever the trainer's optimizer, looked up at the call, accumulates low-rank gradients; other
    calls pass through.  Installed on every fixed trainer, so it holds however the optimizer arrives.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None:
        return
    current = accelerator.__dict__.get("clip_grad_norm_")
    if current is not None and getattr(current, "_gradfix_lowrank_clip", False):
        current._gradfix_trainer[0] = weakref.ref(trainer)
        return
    original = accelerator.clip_grad_norm_
    owner = [weakref.ref(trainer)]  # weakly: the accelerator must not keep its trainer alive

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        trainer_now = owner[0]()
        optimizer = lowrank_optimizer_of(trainer_now) if trainer_now is not None else None
        if optimizer is None or not optimizer.lowrank_hooks_attached:
            return original(parameters, max_norm, norm_type=norm_type)
        return optimizer.clip_grad_norm_(max_norm, parameters, norm_type=norm_type)

    clip_grad_norm_._gradfix_lowrank_clip = True
    clip_grad_norm_._gradfix_trainer = owner
    accelerator.clip_grad_norm_ = clip_grad_norm_


def describe(optimizer: LowRankAdamW, trainer: Any = None) -> str:
    """One line for the fix log."""
    via = ""
    if trainer is not None and _from_transformers_optim(trainer.args) is not None:
        via = f"TrainingArguments.optim={str(getattr(trainer.args.optim, 'value', trainer.args.optim))!r} rebuilt (transformers' drops weight_decay/betas/eps and cannot resume): "
    g = next((g for g in optimizer.param_groups if g.get("project")), optimizer.param_groups[0])
    n = len(optimizer.projected_names)
    kind = type(optimizer).__name__
    extra = f", method {g['proj_method']}" if kind.startswith("GaLore") else f", {g.get('scale_type')}-wise"
    skipped = getattr(optimizer, "skipped_small", [])
    tail = f"; {len(skipped)} matrices too small for the rank stay AdamW" if skipped else ""
    if getattr(optimizer, "lowrank_grads", False):
        tail += (f"; low-rank gradient accumulation (rank-{g['rank']} accumulators, staggered refreshes, "
                 "max_grad_norm clips the accumulators)")
    return (
        f"{via}optimizer {kind}: {n} matrices at rank {g['rank']}, refresh every {g['update_proj_gap']} steps{extra}, "
        f"lr/weight_decay/betas/eps from TrainingArguments{tail}"
    )
