"""``hf-gradfix plan``: the command line (closed form, ``--simulate``, ``--suggest``, ``--json``, ``--plot``).

It is the plan room's one command module (like :mod:`hf_gradfix.verify.command` and :mod:`hf_gradfix.commands`,
dispatched by :mod:`hf_gradfix.cli`), above the planner: no other module of :mod:`hf_gradfix.plan` imports it.

>>> build_parser().parse_args(["--model", "tiny-llama", "--tp", "2"]).tp
2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from .estimate import COMPONENTS, GiB, PlanError, Settings, estimate, load_model_config, param_table, parse_memory

__all__ = ["plan_main", "build_parser", "suggest"]


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's default (unless its help already names it); description wrapped, examples as written."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hf-gradfix plan", formatter_class=_Help,
        description="Per-rank training memory for a model and a mesh, in closed form (parameters, gradients, "
        "optimizer state, activations, communication buffers), optionally checked by tracing one step under fake "
        "tensors (--simulate), or the layouts that fit a GPU (--suggest). The mesh and the optimizer come from "
        "--config (an accelerate YAML with an hf_gradfix: section, read by the same loader as launch). Exit code 0 "
        "when the plan fits (or no GPU memory was given), 1 when it does not, 2 for a diagnosed error.",
        epilog="examples:\n  hf-gradfix plan --model llama-3.1-8b --config run.yaml --seq-len 4096 --micro-batch 2 --gpu h100\n"
        "  hf-gradfix plan --model tiny-llama --num-gpus 8 --gpu-memory 80GiB --suggest\n"
        "  hf-gradfix plan --model llama-3.1-8b --num-gpus 8 --pp 4 --pp-schedule 1f1b --grad-accum 8 --gpu h100\n"
        "  hf-gradfix plan --model configs/plan_qwen3_30b_a3b.json --num-gpus 8 --ep 4 --seq-len 4096 --gpu h100\n"
        "  hf-gradfix plan --model llama-3.1-8b --num-gpus 8 --rl grpo --prompt-len 512 --completion-len 2048 --micro-batch 4 "
        "--grad-accum 4 --beta 0.04 --gpu h100\n"
        "  hf-gradfix plan --model tiny-qwen2 --rl grpo --prompt-len 64 --completion-len 128 --micro-batch 2 "
        "--grad-accum 2 --num-generations 4 --beta 0.04 --dtype fp32 --timeline grpo.png\n"
        "  hf-gradfix plan --model ./my-model/config.json --num-gpus 4 --optimizer galore_adamw --rank 256 --json",
    )
    ap.add_argument("--model", required=True, help="tiny name (tiny-llama, llama-3.1-8b, ...), config.json, local dir or hub id")
    ap.add_argument("--config", help="accelerate YAML with an hf_gradfix: section (mesh, optimizer)")
    ap.add_argument("--num-gpus", type=int, help="world size, 1 .. 2**20 (overrides num_processes; required for --suggest "
                    "without --config)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence, 1 .. 2**24 (default: a --config's "
                    "packing.token_budget when packing is on, else 2048; with --rl: --prompt-len + --completion-len)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch and rank, 1 .. 2**20")
    ap.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps, 1 .. 2**20")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "bf16-pure", "amp-bf16"],
                    help="bf16/fp16: the Playbook's mixed precision (bf16 weights + fp32 master, 16N); amp-bf16: torch "
                         "autocast / FSDP2 MixedPrecisionPolicy as the Trainer runs it; bf16-pure: no master copy "
                         "(default: bf16; amp-bf16 with --simulate / --timeline, which trace what torch runs)")
    ap.add_argument("--attention", default="fused", choices=["fused", "eager"],
                    help="fused: FlashAttention 2 / SDPA (no s x s scores saved); eager: the model's eager path")
    ap.add_argument("--grad-fp32", action="store_true", help="fp32 gradient accumulation buffer (the Playbook's 20N)")
    ap.add_argument("--optimizer", help="adamw | adamw8bit | galore_adamw | galore_adamw8bit | apollo_adamw | apollo_mini | sgd")
    ap.add_argument("--rank", type=int, help="GaLore/APOLLO rank, 1 .. 65536 (default: the YAML's, else 128)")
    ap.add_argument("--lowrank-grads", action="store_true",
                    help="GaLore low-rank gradient accumulation (optimizer.lowrank_grads): rank-r accumulators instead "
                         "of the projected weights' gradients")
    ap.add_argument("--update-proj-gap", type=int, help="GaLore refresh gap, 1 .. 2**31-1 (default: the YAML's, else 200)")
    ap.add_argument("--recompute", choices=["none", "full"],
                    help="activation recomputation (default: none; full with --rl, as GRPOConfig / RLOOConfig's "
                         "gradient_checkpointing)")
    for flag, what in (("--dp-replicate", "data-parallel replicas (HSDP's outer dimension)"),
                       ("--dp-shard", "FSDP2 shard degree (default: the rest of the world)"),
                       ("--tp", "tensor-parallel degree"), ("--cp", "context-parallel degree")):
        ap.add_argument(flag, type=int, help=f"{what}, 1 .. 2**20: parallel.{flag[2:].replace('-', '_')} on the command "
                        "line. With --config: a key the file does not set is taken from the flag, one it sets to "
                        "another value is refused (keep one of them); without --num-gpus the world is the degrees' "
                        "product")
    ap.add_argument("--pp", type=int, help="pipeline stages, 1 .. 2**20 (default: the --config's parallel.pp, else 1); "
                    "the other degrees share world / pp ranks, the schedule's micro-batches are --grad-accum's")
    ap.add_argument("--pp-schedule", choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
                    help="pipeline schedule (default: the --config's parallel.pp_schedule, else 1f1b)")
    ap.add_argument("--pp-virtual-stages", type=int,
                    help="model chunks per pipeline rank, 1 .. 2**20: > 1 only with interleaved_1f1b / zero_bubble, "
                         "which also run 1 (default: the --config's parallel.pp_virtual_stages, else 1)")
    ap.add_argument("--ep", type=int,
                    help="expert parallelism, 1 .. 2**20 (default: the --config's parallel.ep, else 1): a mixture of "
                         "experts' routed experts split as num_experts / ep whole experts per rank, each FSDP2-sharded over "
                         "efsdp = dp_shard / ep, the dense parameters FSDP2 over dp_shard as transformers' DistributedConfig "
                         "(ep_size, all_to_all) lays them out, plus one MoE layer's all-to-all dispatch + combine buffers "
                         "(tokens x top_k x hidden each, balanced routing assumed); refused as config check refuses it "
                         "(pp, cp, tp, packing, GaLore / APOLLO, DeepSpeed)")
    ap.add_argument("--loss-head", choices=["stock", "lean"], default=None,
                    help="the causal-LM loss head (implied by a --config with loss.head): stock (the logits and the "
                         "loss's fp32 tensors) or lean (no logits; hf_gradfix's loss.head: lean)")
    ap.add_argument("--packing", action="store_true",
                    help="packed rows (the plugin's packer; implied by a --config with packing.enabled): with cp > 1 "
                         "SDPA with a dense document mask and a K/V all-gather over the cp ranks")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                    help="ZeRO stage (default: a DeepSpeed --config's zero_stage; 3 with FSDP sharding; else 0)")
    ap.add_argument("--deepspeed", action="store_true",
                    help="DeepSpeed ZeRO over every process (implied by a DeepSpeed --config): with --zero >= 1 it keeps "
                         "an fp32 master partition even for fp32 weights")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="DeepSpeed offload_optimizer: fp32 master copy and optimizer state in host memory "
                         "(default: a DeepSpeed --config's offload_optimizer_device)")
    rl = ap.add_argument_group(
        "RL runs", "TRL 1.16 GRPOTrainer / RLOOTrainer: generation with a KV cache, the no-grad old / reference log-prob "
        "forwards, the training micro-batch with TRL's fused LM head, each phase on its own (docs/plan.md, RL runs). "
        "--micro-batch is per_device_train_batch_size, --grad-accum gradient_accumulation_steps")
    rl.add_argument("--rl", choices=["grpo", "rloo"], help="plan a GRPO / RLOO step (needs --prompt-len and "
                    "--completion-len)")
    rl.add_argument("--prompt-len", type=int, help="the generation batch's longest prompt in tokens, 1 .. 2**24 "
                    "(TRL pads every row to it)")
    rl.add_argument("--completion-len", type=int, help="the longest completion, 1 .. 2**24 (max_completion_length)")
    rl.add_argument("--num-generations", type=int, help="completions per prompt, 1 .. 2**24 (default: the trainer's, "
                    "GRPO 8, RLOO 2); the generation batch over every rank must be a multiple of it")
    rl.add_argument("--steps-per-generation", type=int,
                    help="micro-batches per generation batch, 1 .. 2**20 (default: --grad-accum, TRL's)")
    rl.add_argument("--beta", type=float, help="KL coefficient; > 0 loads a reference model (default: the trainer's, "
                    "GRPO 0.0, RLOO 0.05)")
    rl.add_argument("--rl-forwards", choices=["padded", "packed"],
                    help="log-prob forwards on TRL's padded rows or packed padding-free (default: packed when the "
                         "--config sets packing.rl_forwards, else padded)")
    rl.add_argument("--mean-prompt-len", type=float, help="mean prompt length over the generation batch (default: "
                    "--prompt-len): the real tokens of a packed row")
    rl.add_argument("--mean-completion-len", type=float,
                    help="mean completion length (default: --completion-len): the real tokens of a packed row and the "
                         "positions TRL's fused head scores")
    vis = ap.add_argument_group(
        "vision-language models", "the vision tower's activations at the given image size and count (measured from "
        "its forward under fake tensors) and the image tokens each image adds to a row (docs/plan.md, Vision-language "
        "models); --seq-len counts a row's tokens WITH its image tokens")
    vis.add_argument("--image-size", help="HEIGHTxWIDTH in pixels of each image as the processor hands it to the "
                     "tower (e.g. 448x448); a fixed-resolution tower (LLaVA, Gemma 3) resizes to its own size")
    vis.add_argument("--images-per-sample", type=int, help="images per sample, 0 .. 4096 (default 1 with --image-size)")
    vis.add_argument("--text-len", type=int, help="text tokens per sample beside its image tokens, 0 .. 2**24: with "
                     "packing, how many samples (and so images) share a row (default: the most images a row holds)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--gpu-memory", help="e.g. 80GiB, 40GB")
    g.add_argument("--gpu", help="GPU name, e.g. h100, a100-40gb, rtx4090")
    ap.add_argument("--simulate", action="store_true",
                    help="also trace one step under fake tensors (rank 0); needs --dtype fp32, bf16-pure or amp-bf16 "
                         "(what torch runs): the default bf16 (and fp16) is the closed form's Megatron-style split "
                         "and is refused")
    ap.add_argument("--suggest", action="store_true", help="list layouts that fit, best expected throughput first, "
                    "and the hf_gradfix YAML section and plan command of the best one (needs --num-gpus, a --config "
                    "with num_processes, or mesh flags, and --gpu / --gpu-memory)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--plot", metavar="FILE.png", help="the closed form's components: one stacked bar (ranks alike)")
    ap.add_argument("--timeline", metavar="FILE.png",
                    help="memory over the simulated step's events by category, the peak and the closed form beside "
                         "it (implies --simulate)")
    return ap


# the trace's RL phases -> the closed form's (plan.extra["rl"]["phases"])
_RL_PHASE_OF = {"generation": "generation", "old log-probs": "no_grad", "ref log-probs": "no_grad",
                "forward": "training", "backward": "training"}


def _print_rl_simulated(plan, sim, mesh) -> None:
    """The traced RL step beside the closed form, phase by phase."""
    unit, div = ("GiB", GiB) if plan.peak >= GiB / 4 else ("MiB", 1024**2)
    tl = sim["timeline"]
    print(f"\nsimulated RL step (fake tensors, rank 0 of {mesh.world_size}, {sim['seconds']:.1f} s): traced peak "
          f"{sim['peak'] / div:.3f} {unit} during {sim['phase']} ({tl.peak_label}); at the step's start "
          f"{sim['start'] / div:.3f} {unit} (weights, reference model, optimizer state)")
    phases = plan.extra["rl"]["phases"]
    print(f"  {'phase':<15}{'traced max':>11}{'above start':>12}{'closed form':>12}   ({unit}; closed form: the "
          f"phase on top of the model state)")
    for name, ph in sim["phases"].items():
        cf = phases.get(_RL_PHASE_OF.get(name, ""), {}).get("bytes")
        cf_s = f"{cf / div:>12.3f}" if cf is not None else f"{'-':>12}"
        print(f"  {name:<15}{ph['max'] / div:>11.3f}{ph['above_start'] / div:>12.3f}{cf_s}")
    print("  (above start: training includes the gradients it makes, which the closed form counts in the model "
          "state)")


def _traced_head(plan, mesh) -> tuple[str, str]:
    """The loss head the supervised ``--simulate`` step runs, as the run would (:func:`hf_gradfix.plan.lean_head.
    stock_head_reason`), and a note: why a lean head asked for is not run, or what its op holds that the trace does
    not see ("" when there is nothing to add)."""
    from .common import _fmt
    from .lean_head import stock_head_reason

    if plan.settings.get("loss_head") != "lean":
        return "stock loss head", ""
    why = stock_head_reason(tp=mesh.tp)
    if why is not None:
        return "stock loss head", f"loss.head lean is not used here: {why}"
    lean = plan.extra.get("lean_head")
    if lean is None or lean["path"] != "torch":
        return "lean loss head", ""
    return "lean loss head", (f"torch's linear_cross_entropy allocates {_fmt(lean['transient'])} of scratch inside "
                              "the op, which the trace does not see (the closed form counts it)")


def _schedule_name(value) -> str:
    """A configuration's schedule spelled the planner's way (``Interleaved1F1B``, ``interleaved-1f1b`` ->
    ``interleaved_1f1b``; the zero-bubble family -> ``zero_bubble``)."""
    key = str(value).lower().replace("_", "").replace("-", "").removeprefix("schedule")
    names = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved_1f1b", "zerobubble": "zero_bubble",
             "interleavedzerobubble": "zero_bubble", "zb": "zero_bubble"}
    if key not in names:
        raise PlanError(f"parallel.pp_schedule={value!r}: the planner knows gpipe, 1f1b, interleaved_1f1b and "
                        "zero_bubble; use one of them")
    return names[key]


def _mesh_and_settings(ns, config):
    from ..parallel import ParallelDims

    opt_name, rank, side, targets, exclude, min_size = "adamw", 128, "auto", None, (), 0
    lowrank, gap = False, 200
    zero, offload, deepspeed = ns.zero, bool(ns.offload_optimizer), bool(ns.deepspeed)
    pp, schedule, virtual = ns.pp or 1, ns.pp_schedule or "1f1b", ns.pp_virtual_stages or 1
    packing = bool(ns.packing)
    loss_head = ns.loss_head or "stock"
    rl_packed = False  # the --config's packing.rl_forwards
    fsdp_plugin, loss_enabled = False, True  # the --config's accelerate FSDP plugin and loss.enabled (pp refuses them)
    if virtual > 1 and ns.pp_schedule is None:
        schedule = "interleaved_1f1b"  # virtual stages name the interleaved schedule
    seq_given = ns.seq_len is not None
    if ns.rl is not None:
        if seq_given:
            raise PlanError(f"--seq-len with --rl: TRL's rows are --prompt-len + --completion-len long; drop --seq-len")
        for flag, on in (("--suggest", ns.suggest), ("--pp", (ns.pp or 1) > 1)):
            if on:
                raise PlanError(f"{flag} with --rl: not planned for RL runs (the layout search knows a supervised "
                                "step; TRL runs no pipeline stages); drop it")
    if ns.recompute is None:
        ns.recompute = "full" if ns.rl is not None else "none"  # GRPOConfig / RLOOConfig: gradient_checkpointing
    if not seq_given:
        ns.seq_len = 2048
    if ns.config:
        from ..config.loader import read_config_file
        from ..config.resolve import resolve_config

        cf = read_config_file(ns.config)
        par = cf.gradfix.parallel
        # pipeline keys of the parallel section (issue 28); read by name so that a schema without them plans pp 1
        pp_cfg = int(getattr(par, "pp", 1) or 1)
        if ns.pp is not None and pp_cfg > 1 and ns.pp != pp_cfg:
            raise PlanError(f"--pp {ns.pp}: {ns.config} sets parallel.pp={pp_cfg}; keep one of them")
        pp = ns.pp or pp_cfg
        schedule = ns.pp_schedule or _schedule_name(getattr(par, "pp_schedule", None) or "1f1b")
        virtual = ns.pp_virtual_stages or int(getattr(par, "pp_virtual_stages", 1) or 1)
        if virtual > 1 and ns.pp_schedule is None and getattr(par, "pp_schedule", None) is None:
            schedule = "interleaved_1f1b"
        config_head = str(getattr(cf.gradfix.loss, "head", "stock") or "stock")
        if ns.loss_head is not None and ns.loss_head != config_head:
            raise PlanError(f"--loss-head {ns.loss_head}: {ns.config} sets loss.head={config_head}; keep one of them")
        loss_head = config_head
        if cf.gradfix.packing.enabled:
            packing = True
            if not seq_given:
                ns.seq_len = cf.gradfix.packing.token_budget  # one packed row per micro-batch
        rl_packed = bool(getattr(cf.gradfix.packing, "rl_forwards", False))
        world = ns.num_gpus or int(cf.accelerate.get("num_processes") or 1)
        mesh_has_pp = "pp" in getattr(ParallelDims, "__dataclass_fields__", {})
        num_processes = ns.num_gpus
        if pp > 1 and not (mesh_has_pp and pp_cfg == pp):
            # the other degrees share world / pp ranks (a mesh without pp, or --pp on a file without it)
            if world % pp:
                raise PlanError(f"--pp {pp}: does not divide the world size {world}; use a divisor of {world}")
            num_processes = world // pp
        rc = resolve_config(ns.config, num_processes=num_processes, micro_batch=ns.micro_batch, seq_len=ns.seq_len,
                            grad_accum=ns.grad_accum, model_config=config)
        mesh = rc.mesh
        if _mesh_flags(ns):
            mesh = _with_mesh_flags(ns, rc, cf, config)
        # parallel.ep (resolve_config has checked the file's own); --ep on a file without it: the same checks
        ep_cfg = int(getattr(par, "ep", 1) or 1)
        if ns.ep is not None and ep_cfg > 1 and ns.ep != ep_cfg:
            raise PlanError(f"--ep {ns.ep}: {ns.config} sets parallel.ep={ep_cfg}; keep one of them")
        if ns.ep is not None and ns.ep != getattr(mesh, "ep", 1):
            fsdp_plugin = (str(cf.accelerate.get("distributed_type", "")).upper() == "FSDP"
                           or bool(cf.accelerate.get("fsdp_config")))
            _check_ep_flags(ns, ns.ep, mesh, pp, packing, rc.gradfix.optimizer.name, fsdp_plugin)
            mesh = _with_ep(mesh, ns.ep, config)
        fsdp_plugin = (str(cf.accelerate.get("distributed_type", "")).upper() == "FSDP"
                       or bool(cf.accelerate.get("fsdp_config")))
        loss_enabled = bool(rc.gradfix.loss.enabled)
        o = rc.gradfix.optimizer
        if o.name != "none":
            opt_name = o.name
            rank = o.rank or (1 if o.name == "apollo_mini" else 128)
            side, targets, exclude, min_size = o.proj_side, o.targets, tuple(o.exclude or ()), o.min_size
            lowrank, gap = o.lowrank_grads, o.update_proj_gap
        zero, offload = _deepspeed_zero(rc, zero, offload)
        deepspeed = deepspeed or rc.deepspeed is not None
        if pp > 1 and deepspeed:
            raise PlanError(f"--pp {pp} with DeepSpeed ({ns.config}): DeepSpeed's own pipeline engine is not "
                            "planned; plan pp with FSDP2 / DDP or drop --pp")
    else:
        flags = _mesh_flags(ns)
        n = ns.num_gpus or math.prod([flags.get("dp_shard", 1), *(v for k, v in flags.items() if k != "dp_shard"), pp])
        if flags and deepspeed:
            raise PlanError(f"--{next(iter(flags)).replace('_', '-')} with --deepspeed: DeepSpeed ZeRO partitions over "
                            "every process (one data-parallel group); drop the mesh flags, or --deepspeed")
        if n % pp:
            raise PlanError(f"--pp {pp}: does not divide the world size {n} (--num-gpus); use a divisor of {n}")
        if pp > 1 and deepspeed:
            raise PlanError(f"--pp {pp} with --deepspeed: DeepSpeed's own pipeline engine is not planned; plan pp with "
                            "FSDP2 / DDP (drop --deepspeed) or drop --pp")
        n //= pp  # the other degrees share world / pp ranks
        # DeepSpeed partitions over every process (a replica each); accelerate's default stage is 2
        mesh = (ParallelDims(n, dp_replicate=n, dp_shard=1) if deepspeed
                else ParallelDims(n, **{"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, **flags}))
        zero = 2 if deepspeed and zero is None else zero
        if (ns.ep or 1) > 1:
            if deepspeed:
                raise PlanError(f"--ep {ns.ep} with --deepspeed: transformers shards the experts (ep) and the rest with "
                                "FSDP2 itself; drop --deepspeed, or --ep")
            _check_ep_flags(ns, ns.ep, mesh, pp, packing, "none", False)
            mesh = _with_ep(mesh, ns.ep, config)
        mesh.check_model(config)
    optimizer = ns.optimizer or opt_name
    lowrank_opt = str(optimizer).startswith(("galore", "apollo"))
    for flag, given in (("--rank", ns.rank is not None), ("--update-proj-gap", ns.update_proj_gap is not None),
                        ("--lowrank-grads", bool(ns.lowrank_grads))):
        if given and not lowrank_opt:  # silently ignored before (issue 38)
            raise PlanError(f"{flag} with --optimizer {optimizer}: it applies to the low-rank optimizers only (galore_adamw, "
                            "galore_adamw8bit, apollo_adamw, apollo_mini); drop it or pick one of them")
    if pp > 1 and not deepspeed:  # (DeepSpeed with pp is refused above in the planner's own words)
        # what the run refuses under pp, in its own line (config check's): not a layout to plan
        from ..parallel.pipeline import check_combination as check_pp_combination

        given = ns.optimizer is not None
        check_pp_combination(pp=pp, tp=mesh.tp, cp=mesh.cp, dp_shard=mesh.dp_shard, packing=packing,
                             optimizer=optimizer if lowrank_opt else "none", fsdp_plugin=fsdp_plugin,
                             optimizer_key="--optimizer" if given else "optimizer.name", loss_enabled=loss_enabled)
    if offload and not deepspeed:
        raise PlanError("--offload-optimizer without DeepSpeed: offloading the optimizer state is DeepSpeed's "
                        "(offload_optimizer); add --deepspeed (or a DeepSpeed --config), or drop it")
    s = Settings(seq_len=ns.seq_len, micro_batch=ns.micro_batch, grad_accum=ns.grad_accum, dtype=ns.dtype,
                 grad_fp32=ns.grad_fp32, optimizer=ns.optimizer or opt_name,
                 rank=ns.rank if ns.rank is not None else rank, proj_side=side,
                 targets=targets, exclude=exclude, min_size=min_size, recompute=ns.recompute, zero=zero,
                 attention=ns.attention, lowrank_grads=bool(ns.lowrank_grads or lowrank),
                 update_proj_gap=ns.update_proj_gap if ns.update_proj_gap is not None else gap,
                 offload_optimizer=offload, deepspeed=deepspeed,
                 pp=1 if getattr(mesh, "pp", 1) > 1 else pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                 packing=packing, rl=_rl_run(ns, rl_packed), loss_head=loss_head, vision=_vision_run(ns))
    if getattr(mesh, "ep", 1) > 1:
        for flag, on in (("--suggest", ns.suggest), ("--simulate / --timeline", ns.simulate or ns.timeline)):
            if on:
                raise PlanError(f"{flag} with parallel.ep={mesh.ep}: not planned under expert parallelism (the layout "
                                "search and the fake-tensor step know no expert sharding); drop it, or use ep: 1")
    if s.rl is not None:
        s.seq_len = s.rl.seq_len
        gen = ns.micro_batch * mesh.world_size * (s.rl.steps_per_generation or ns.grad_accum)
        if gen % s.rl.num_generations:
            raise PlanError(f"--num-generations {s.rl.num_generations}: the generation batch (micro-batch "
                            f"{ns.micro_batch} x {mesh.world_size} processes x steps per generation "
                            f"{s.rl.steps_per_generation or ns.grad_accum} = {gen}) must be a multiple of it (TRL's rule)")
    return mesh, s


def _with_mesh_flags(ns, rc, cf, config):
    """The --config's mesh with the mesh flags applied: a flag fills a degree the file does not set and may repeat
    one it sets; a flag that contradicts the file is refused (one rule, as for --pp and --ep).  The file sets the
    keys of its ``hf_gradfix.parallel`` section, or all four degrees through accelerate's ``parallelism_config``."""
    from ..parallel import ParallelDims, ParallelDimsError

    mesh, flags = rc.mesh, _mesh_flags(ns)
    first = f"--{next(iter(flags)).replace('_', '-')} {next(iter(flags.values()))}"
    if rc.deepspeed is not None:
        raise PlanError(f"{first} with {ns.config} (DeepSpeed): ZeRO partitions over every process (one data-parallel "
                        "group); drop the mesh flags, or use an FSDP / DDP config")
    degrees = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1}
    if rc.mesh_source.startswith("accelerate"):  # parallelism_config: every degree given (a missing one is 1)
        where, set_by_file = "accelerate's parallelism_config", {k: getattr(mesh, k) for k in degrees}
    else:
        raw = (cf.section or {}).get("parallel") if isinstance(cf.section, dict) else None
        where, set_by_file = "parallel", {k: v for k, v in (raw or {}).items() if k in degrees}
    degrees.update(set_by_file)
    for key, value in flags.items():
        if key in set_by_file and set_by_file[key] != value:
            raise PlanError(f"--{key.replace('_', '-')} {value}: {ns.config} sets {where} {key}={set_by_file[key]}; keep "
                            f"one of them (drop --{key.replace('_', '-')}, or edit the file)")
        degrees[key] = value
    try:
        dims = ParallelDims(mesh.world_size, **degrees, pp=mesh.pp, pp_virtual_stages=mesh.pp_virtual_stages,
                            ep=mesh.ep)
    except ParallelDimsError as err:
        raise PlanError(f"{first} with {ns.config}: {err}") from None
    dims.check_model(config)
    return dims


def _with_ep(mesh, ep: int, config):
    """``mesh`` with expert parallelism ``ep`` (ParallelDims checks that ep divides the shard group, check_model that
    it divides the model's routed experts)."""
    from ..parallel import ParallelDims

    dims = ParallelDims(mesh.world_size, dp_replicate=mesh.dp_replicate, dp_shard=mesh.dp_shard, cp=mesh.cp, tp=mesh.tp,
                        pp=mesh.pp, pp_virtual_stages=mesh.pp_virtual_stages, ep=ep)
    dims.check_model(config)
    return dims


def _check_ep_flags(ns, ep: int, mesh, pp: int, packing: bool, config_optimizer: str, fsdp_plugin: bool) -> None:
    """``--ep`` against the other choices, in :func:`hf_gradfix.parallel.ep.check_combination`'s words (config check's
    line) and the planner's own for what only the planner has (--suggest, --simulate)."""
    from ..parallel.ep import check_combination

    if ns.optimizer is not None:
        opt, key = (ns.optimizer if ns.optimizer.startswith(("galore", "apollo")) else "none"), "--optimizer"
    else:
        opt, key = config_optimizer, "optimizer.name"
    check_combination(ep=ep, pp=max(pp, getattr(mesh, "pp", 1)), cp=mesh.cp, tp=mesh.tp, packing=packing,
                      optimizer=opt, fsdp_plugin=fsdp_plugin, optimizer_key=key)


_RL_ONLY = ("prompt_len", "completion_len", "num_generations", "steps_per_generation", "beta", "rl_forwards",
            "mean_prompt_len", "mean_completion_len")


def _rl_run(ns, config_packed: bool):
    """The RL run of the command line (None without --rl); its flags without --rl are refused."""
    from .rl import DEFAULT_BETA, RLRun

    if ns.rl is None:
        given = [k for k in _RL_ONLY if getattr(ns, k) is not None]
        if given:
            raise PlanError(f"--{given[0].replace('_', '-')} needs --rl grpo|rloo")
        return None
    if ns.prompt_len is None or ns.completion_len is None:
        raise PlanError(f"--rl {ns.rl} needs --prompt-len and --completion-len (the generation batch's longest "
                        "prompt and completion)")
    return RLRun(trainer=ns.rl, prompt_len=ns.prompt_len, completion_len=ns.completion_len,
                 num_generations=ns.num_generations or {"grpo": 8, "rloo": 2}[ns.rl],
                 steps_per_generation=ns.steps_per_generation,
                 beta=DEFAULT_BETA[ns.rl] if ns.beta is None else ns.beta,
                 forwards=ns.rl_forwards or ("packed" if config_packed else "padded"),
                 mean_prompt_len=ns.mean_prompt_len, mean_completion_len=ns.mean_completion_len)


def _vision_run(ns):
    """The images of the command line (None without --image-size); its companions without it are refused."""
    from .vision import VisionRun, parse_image_size

    if ns.image_size is None:
        for flag, value in (("--images-per-sample", ns.images_per_sample), ("--text-len", ns.text_len)):
            if value is not None:
                raise PlanError(f"{flag} {value}: needs --image-size HEIGHTxWIDTH (the images' size); add it, or drop "
                                f"{flag}")
        return None
    if ns.simulate or ns.timeline:
        raise PlanError(f"--image-size {ns.image_size} with --simulate / --timeline: the fake-tensor step traces text rows "
                        "only; drop --simulate (the closed form counts the vision tower)")
    h, w = parse_image_size(ns.image_size)
    run = VisionRun(h, w, 1 if ns.images_per_sample is None else ns.images_per_sample, ns.text_len)
    run.check()
    return run


def _deepspeed_zero(resolved, zero: int | None, offload: bool) -> tuple[int | None, bool]:
    """ZeRO stage and optimizer offload from a DeepSpeed --config (the flags win when given)."""
    ds = getattr(resolved, "deepspeed", None)
    if ds is None:
        return zero, offload
    return (ds.stage if zero is None else zero), (offload or ds.offload_optimizer in ("cpu", "nvme"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(config, num_gpus: int, gpu_memory: float, base: Settings, *, params=None, limit: int = 15,
            gpu: str | None = None) -> list[dict]:
    """Layouts that fit, best expected throughput per GPU first.

    Throughput comes from :func:`hf_gradfix.plan.throughput.layout_throughput` (an analytic roofline model of
    compute, TP/CP/FSDP/DDP communication and overlap, for ``gpu``'s spec sheet; H100 when the GPU is not
    named): a model, not a measurement.  Each row carries its predicted peak, tokens/s/GPU and MFU."""
    from dataclasses import replace

    from ..parallel import ParallelDims, ParallelDimsError
    from ..parallel.pipeline import PipelineError, check_combination as check_pp_combination
    from ..parallel.pipeline_schedule import PipelineSpec, bubble_fraction, check_pipeline
    from .throughput import GPU_SPECS, layout_throughput

    spec = GPU_SPECS.get((gpu or "h100").lower().replace(" ", ""), GPU_SPECS["h100"])
    params = params if params is not None else param_table(config)
    n_params = sum(p.numel for p in params)
    n_layers = len({p.layer for p in params if p.layer is not None}) or config.num_hidden_layers
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else hidden)
    kv_hidden = (getattr(config, "num_key_value_heads", None) or heads or 1) * head_dim
    rows = []
    tps = [d for d in _divisors(num_gpus) if d <= 8 and heads and heads % d == 0] or [1]
    # pipeline stages: divisors of the world up to 8 with a layer per chunk; 1F1B, and interleaved 1F1B with 2
    # virtual stages where the layers and the micro-batches allow it (pipeline.check_pipeline)
    pps = [q for q in _divisors(num_gpus) if q <= 8 and q <= n_layers]
    for pp in pps:
        pipes = [("1f1b", 1)] if pp > 1 else [(base.pp_schedule, 1)]
        if pp > 1:
            try:
                check_pipeline(PipelineSpec(pp, "interleaved_1f1b", 2, base.grad_accum), world_size=num_gpus,
                               n_layers=n_layers)
                pipes.append(("interleaved_1f1b", 2))
            except ValueError:
                pass
        inner = num_gpus // pp
        for tp in [t for t in tps if inner % t == 0]:
            for cp in [c for c in (1, 2, 4) if inner % (tp * c) == 0 and base.seq_len % c == 0]:
                rest = inner // (tp * cp)
                for rep in _divisors(rest):
                    try:
                        mesh = ParallelDims(inner, dp_replicate=rep, dp_shard=rest // rep, tp=tp, cp=cp)
                        mesh.check_model(config)
                    except ParallelDimsError:
                        continue
                    try:  # what the run refuses under pp (cp, tp x dp_shard, packing): not a layout to suggest
                        check_pp_combination(pp=pp, tp=tp, cp=cp, dp_shard=rest // rep, packing=base.packing)
                    except PipelineError:
                        continue
                    for schedule, virtual in pipes:
                        bubble = bubble_fraction(PipelineSpec(pp, schedule, virtual, base.grad_accum))
                        for mb in (1, 2, 4, 8):
                            for rc in ("none", "full"):
                                # GaLore: with and without low-rank gradient accumulation (DDP / one process only)
                                variants = [(o, False) for o in dict.fromkeys((base.optimizer, "adamw"))]
                                if base.optimizer.startswith("galore"):
                                    variants.insert(1, (base.optimizer, True))
                                for opt, lowrank in variants:
                                    if pp > 1 and opt.startswith(("galore", "apollo")):
                                        continue  # the run refuses low-rank optimizers under pp (check_combination)
                                    s = replace(base, micro_batch=mb, recompute=rc, optimizer=opt, zero=None,
                                                lowrank_grads=lowrank, pp=pp, pp_schedule=schedule,
                                                pp_virtual_stages=virtual)
                                    try:
                                        p = estimate(config, mesh, s, gpu_memory=gpu_memory, params=params)
                                    except PlanError:  # e.g. a low-rank optimizer on FSDP2 x TP row-wise weights
                                        continue
                                    if not p.fits:
                                        continue
                                    t = layout_throughput(
                                        n_params, n_layers, hidden, kv_hidden, seq_len=s.seq_len, micro_batch=mb,
                                        grad_accum=s.grad_accum, dp_replicate=rep, dp_shard=rest // rep, tp=tp,
                                        cp=cp, recompute=rc == "full", gpu=spec,
                                        optimizer_overhead=1.02 if opt.startswith(("galore", "apollo")) else 1.0,
                                        pp=pp, bubble=bubble)
                                    rows.append({"pp": pp, "pp_schedule": schedule if pp > 1 else None,
                                                 "pp_virtual_stages": virtual, "bubble": round(bubble, 4),
                                                 "dp_replicate": rep, "dp_shard": rest // rep, "tp": tp, "cp": cp,
                                                 "micro_batch": mb, "recompute": rc, "optimizer": opt,
                                                 "lowrank_grads": lowrank,
                                                 "peak_gib": round(p.peak / GiB, 2), "peak_bytes": p.peak,
                                                 "tokens_per_s_per_gpu": round(t["tokens_per_s_per_gpu"]),
                                                 "mfu": round(t["mfu"], 3),
                                                 "global_batch_tokens": p.global_batch_tokens})
    # best expected throughput first; at equal throughput the smaller peak, then the smaller bubble
    rows.sort(key=lambda r: (-r["tokens_per_s_per_gpu"], r["peak_gib"], r["bubble"]))
    return rows[:limit]


def suggestion_yaml(row: dict, num_gpus: int) -> str:
    """The accelerate YAML (``num_processes`` and the ``hf_gradfix`` section) that runs a :func:`suggest` row; the
    micro-batch and recomputation are the Trainer's (``per_device_train_batch_size``, ``gradient_checkpointing``).

    >>> print(suggestion_yaml({"dp_replicate": 1, "dp_shard": 4, "tp": 2, "cp": 1, "pp": 1, "optimizer": "adamw",
    ...                        "lowrank_grads": False}, 8))
    distributed_type: MULTI_GPU
    num_processes: 8
    hf_gradfix:
      parallel:
        dp_replicate: 1
        dp_shard: 4
        tp: 2
        cp: 1
    """
    # hf-gradfix launch builds the mesh itself from the section (accelerate's own ND keys are not needed)
    lines = [f"distributed_type: {'MULTI_GPU' if num_gpus > 1 else 'NO'}", f"num_processes: {num_gpus}", "hf_gradfix:",
             "  parallel:"]
    lines += [f"    {k}: {row[k]}" for k in ("dp_replicate", "dp_shard", "tp", "cp")]
    if row.get("pp", 1) > 1:
        lines += [f"    pp: {row['pp']}", f"    pp_schedule: {row['pp_schedule']}"]
        if row.get("pp_virtual_stages", 1) > 1:
            lines.append(f"    pp_virtual_stages: {row['pp_virtual_stages']}")
    if row.get("optimizer", "adamw") not in ("adamw", "sgd", "adamw8bit"):  # the Trainer's own optim otherwise
        lines += ["  optimizer:", f"    name: {row['optimizer']}"]
        if row.get("lowrank_grads"):
            lines.append("    lowrank_grads: true")
    return "\n".join(lines)


def suggestion_command(row: dict, ns, num_gpus: int) -> str:
    """The ``hf-gradfix plan`` command line that plans a :func:`suggest` row on its own."""
    argv = ["hf-gradfix", "plan", "--model", ns.model, "--num-gpus", str(num_gpus)]
    for k in ("dp_replicate", "dp_shard", "tp", "cp"):
        argv += [f"--{k.replace('_', '-')}", str(row[k])]
    if row.get("pp", 1) > 1:
        argv += ["--pp", str(row["pp"]), "--pp-schedule", row["pp_schedule"]]
        if row.get("pp_virtual_stages", 1) > 1:
            argv += ["--pp-virtual-stages", str(row["pp_virtual_stages"])]
    argv += ["--seq-len", str(ns.seq_len), "--micro-batch", str(row["micro_batch"]), "--grad-accum", str(ns.grad_accum),
             "--recompute", row["recompute"], "--dtype", ns.dtype, "--optimizer", row["optimizer"]]
    if row.get("lowrank_grads"):
        argv.append("--lowrank-grads")
    for flag in ("rank", "update_proj_gap"):
        if getattr(ns, flag) is not None and row["optimizer"].startswith(("galore", "apollo")):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(ns, flag))]
    if ns.attention != "fused":
        argv += ["--attention", ns.attention]
    if ns.grad_fp32:
        argv.append("--grad-fp32")
    if ns.packing:
        argv.append("--packing")
    argv += ["--gpu", ns.gpu] if ns.gpu else ["--gpu-memory", str(ns.gpu_memory)]
    import shlex

    return shlex.join(argv)


def suggestion_text(row: dict, ns, num_gpus: int) -> str:
    """What to paste and type for the best layout (printed after the table)."""
    yaml_text = suggestion_yaml(row, num_gpus)
    trainer = [f"per_device_train_batch_size={row['micro_batch']}"]
    if row["recompute"] == "full":
        trainer.append("gradient_checkpointing=True")
    return ("\nto use the first layout, paste into your accelerate config (run.yaml):\n"
            + "\n".join("  " + line for line in yaml_text.splitlines())
            + f"\nwith the Trainer's {', '.join(trainer)} (gradient_accumulation_steps={ns.grad_accum}), then check "
            "and launch it:\n  hf-gradfix config check run.yaml\n  hf-gradfix launch --config run.yaml train.py\n"
            f"or plan it on its own:\n  {suggestion_command(row, ns, num_gpus)}")


def _gpu_specs() -> dict:
    from .throughput import GPU_SPECS

    return GPU_SPECS


def plot_plan(plans: list, path: str, labels: list[str] | None = None, gpu_memory: float | None = None) -> None:
    """A stacked bar per rank (or per layout) of the components, with the GPU size as a line."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlanError("--plot needs matplotlib: pip install matplotlib (or drop --plot)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(plans) + 2), 4.5))
    bottoms = [0.0] * len(plans)
    for k in [k for k in COMPONENTS if any(k in p.components for p in plans)]:  # reference_model: RL plans only
        vals = [p.components.get(k, 0.0) / GiB for p in plans]
        ax.bar(range(len(plans)), vals, bottom=bottoms, label=k.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    if gpu_memory:
        ax.axhline(gpu_memory / GiB, color="k", ls="--", lw=1, label=f"GPU {gpu_memory / GiB:.0f} GiB")
    ax.set_xticks(range(len(plans)), labels or [f"rank {i}" for i in range(len(plans))], rotation=30, ha="right")
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{plans[0].model}: per-rank memory")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# flag -> (attribute, highest value): the schema's bounds where the flag mirrors a configuration key
_FLAG_BOUNDS = {
    "--num-gpus": ("num_gpus", 2**20), "--seq-len": ("seq_len", 2**24), "--micro-batch": ("micro_batch", 2**20),
    "--grad-accum": ("grad_accum", 2**20), "--rank": ("rank", 65536), "--update-proj-gap": ("update_proj_gap", 2**31 - 1),
    "--pp": ("pp", 2**20), "--dp-replicate": ("dp_replicate", 2**20), "--dp-shard": ("dp_shard", 2**20),
    "--tp": ("tp", 2**20), "--cp": ("cp", 2**20), "--pp-virtual-stages": ("pp_virtual_stages", 2**20), "--ep": ("ep", 2**20),
    "--prompt-len": ("prompt_len", 2**24), "--completion-len": ("completion_len", 2**24),
    "--num-generations": ("num_generations", 2**24), "--steps-per-generation": ("steps_per_generation", 2**20),
}
_IMAGE_TYPES = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp", "eps", "ps", "pgf", "raw", "rgba")


#: the deepest model ``--simulate`` traces (a 4096-layer config took minutes to build alone on the meta device)
MAX_SIMULATED_LAYERS = 256


def _check_flags(ns) -> None:
    """Every number and output path of the command line, before any work (one line naming the flag and the fix)."""
    for flag, (attr, high) in _FLAG_BOUNDS.items():
        value = getattr(ns, attr)
        if value is not None and not 1 <= value <= high:
            raise PlanError(f"{flag} {value}: invalid value; it must be a whole number >= 1 and <= {high}")
    for flag, path in (("--plot", ns.plot), ("--timeline", ns.timeline)):
        if path is None:
            continue
        import importlib.util
        import os

        # optional imports first: before the model is built or a step traced (minutes for big configs)
        if importlib.util.find_spec("matplotlib") is None:
            raise PlanError(f"{flag} {path}: needs matplotlib, which is not installed: pip install matplotlib "
                            f"(or drop {flag})")

        folder = os.path.dirname(os.path.abspath(path))
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        if not os.path.isdir(folder):
            raise PlanError(f"{flag} {path}: the folder {folder} does not exist; create it or write elsewhere")
        if ext not in _IMAGE_TYPES:
            raise PlanError(f"{flag} {path}: unknown image type {('.' + ext) if ext else '(no extension)'}; "
                            f"end the name with .png, .pdf or .svg")
        if os.path.isdir(path):
            raise PlanError(f"{flag} {path}: is a folder; give a file name such as {os.path.join(path, 'plan.png')}")


def _decide_defaults(ns) -> None:
    """Defaults that depend on other flags, decided (and refusals made) before any work: the dtype a trace can run,
    and the world size ``--suggest`` lays out."""
    traced = ns.simulate or ns.timeline is not None
    flag = "--timeline" if ns.timeline is not None else "--simulate"
    ns.dtype_note = None
    if ns.dtype is None:
        ns.dtype = "amp-bf16" if traced else "bf16"
        if traced:  # said when the work starts (the first progress line): a refusal of the flags stays one line
            ns.dtype_note = (f"{flag} traces what torch runs: planning with --dtype amp-bf16 (the "
                             "Trainer's bf16=True); pass --dtype fp32 or bf16-pure for another")
    elif traced:
        from .trace_setup import check_traced_dtype

        check_traced_dtype(ns.dtype)  # the library's own line, before any work
    if ns.suggest and not (ns.gpu or ns.gpu_memory):
        raise PlanError("--suggest: how much memory per GPU? add --gpu NAME (e.g. h100) or --gpu-memory SIZE "
                        "(e.g. 80GiB)")
    if ns.suggest and ns.num_gpus is None and not _mesh_flags(ns) and not ns.config:
        raise PlanError("--suggest: how many GPUs? add --num-gpus N (the world size to lay out), or a --config with "
                        "num_processes")


_MESH_FLAGS = ("dp_replicate", "dp_shard", "tp", "cp")


def _mesh_flags(ns) -> dict:
    """The mesh degrees given on the command line (parallel keys -> values)."""
    return {k: getattr(ns, k) for k in _MESH_FLAGS if getattr(ns, k, None) is not None}


def _plan(ns, progress):
    """The work of ``hf-gradfix plan`` after its flags are checked, each phase announced on ``progress``."""
    if ns.dtype_note:  # the dtype the closed form and the trace both plan
        progress.line(ns.dtype_note)
    progress.phase(f"loading {ns.model}'s config (the first use imports torch and transformers) ...")
    from .vision import with_text_sizes

    config = with_text_sizes(load_model_config(ns.model))  # a VLM config: the decoder's sizes at its top level
    gpu = parse_memory(ns.gpu_memory or ns.gpu) if (ns.gpu_memory or ns.gpu) else None
    mesh, s = _mesh_and_settings(ns, config)
    layers = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", 0) or 0
    traced = ns.simulate or ns.timeline is not None
    if traced and layers > MAX_SIMULATED_LAYERS:
        raise PlanError(f"--simulate / --timeline with {layers} layers: the fake-tensor step traces every operation "
                        f"of every layer (minutes per hundred layers on a CPU); it runs up to {MAX_SIMULATED_LAYERS} "
                        "layers. Drop --simulate (the closed form above is the plan), or simulate a config with "
                        "fewer layers: per-layer memory does not depend on the depth")
    from .estimate import pipeline_degree

    pp = pipeline_degree(mesh, s)
    if traced and pp > 1:  # refused before the closed form's traces
        raise PlanError(f"--simulate / --timeline with pp={pp}: the fake-tensor step traces one rank without pipeline "
                        "stages; drop them (the closed form plans every stage)")
    progress.phase(f"counting {ns.model}'s parameters (its {layers} layers built on the meta device) ...")
    params = param_table(config, targets=s.targets, exclude=s.exclude, min_size=s.min_size)
    progress.phase("the closed form: counting the activations ...")  # its fake-tensor traces announce themselves
    plan = estimate(config, mesh, s, gpu_memory=gpu, model_name=ns.model, params=params)
    out: dict = {"plan": plan.to_dict()}
    sim = None
    if traced:
        from .simulate import simulate

        head, note = _traced_head(plan, mesh) if s.rl is None else ("", "")
        progress.phase(f"simulating one training step of rank 0 under fake tensors ({mesh.world_size} rank(s))"
                       + (f" with the {head}" if head else "") + (f"; {note}" if note else "") + " ...")
        sim = simulate(config, mesh, s, progress=progress.line)
        out["simulated"] = {k: v for k, v in sim.items() if k not in ("raw_max", "timeline")}
        out["simulated"]["timeline"] = sim["timeline"].to_dict()
        if ns.timeline:
            progress.phase(f"drawing {ns.timeline} ...")
        if ns.timeline and s.rl is not None:
            from .rl_simulate import plot_rl_timeline

            plot_rl_timeline(sim["timeline"], ns.timeline, estimate=plan.components, gpu_memory=gpu, title=(
                f"{ns.model}: one {s.rl.trainer.upper()} optimizer step ({s.rl.forwards} forwards), rank 0 of "
                f"{mesh.world_size}, traced under fake tensors; closed form beside it"))
        elif ns.timeline:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise PlanError("--timeline needs matplotlib: pip install matplotlib (or drop --timeline)")
            # the loss head the trace ran in the title's first line (the closed form beside it counts the same), and
            # on a second line why a lean head is not run or what its op holds that the trace does not see
            sim["timeline"].plot(ns.timeline, estimate=plan.components, gpu_memory=gpu, title=(
                f"{ns.model}: one training step with the {head}, rank 0 of {mesh.world_size}"
                + (" (every rank alike)" if mesh.world_size > 1 else "")
                + ", traced under fake tensors; closed form beside it" + (f"\n{note}" if note else "")))
    rows = None
    if ns.suggest:
        if gpu is None:
            raise PlanError("--suggest: how much memory per GPU? add --gpu NAME (e.g. h100) or --gpu-memory SIZE "
                            "(e.g. 80GiB)")
        progress.phase("searching the layouts that fit ...")
        rows = suggest(config, ns.num_gpus or plan.mesh["world_size"], gpu, s, params=params, gpu=ns.gpu)
        out["suggest"] = rows
    if ns.plot:
        progress.phase(f"drawing {ns.plot} ...")
        # every rank holds the same shard sizes: one bar, not world_size identical ones
        plot_plan([plan], ns.plot, gpu_memory=gpu,
                  labels=[f"each of {mesh.world_size} ranks" if mesh.world_size > 1 else "rank 0"])
    return config, mesh, s, gpu, plan, params, sim, rows, out


def plan_main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(argv) if argv is not None else None)
    from ..errors import HfGradfixError
    from ..progress import Progress

    try:
        _check_flags(ns)
        _decide_defaults(ns)
        if ns.gpu_memory or ns.gpu:
            parse_memory(ns.gpu_memory or ns.gpu)  # a bad size is refused before any work
        # progress on stderr (the plugin's log) from here on, stdout stays the table / the JSON: a line per phase, a
        # heartbeat while one runs long; the imports alone take seconds, a trace up to minutes
        with Progress("plan") as progress:
            config, mesh, s, gpu, plan, params, sim, rows, out = _plan(ns, progress)
    except HfGradfixError as exc:  # PlanError, ConfigError, ParallelDimsError, OptimizerConfigError, ...
        print(f"hf-gradfix plan: error: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(plan.table())
    # one unit for every figure of this output: the table's (GiB, or MiB for a plan under a quarter GiB)
    unit, div = ("GiB", GiB) if plan.peak >= GiB / 4 else ("MiB", 1024**2)
    if sim is not None and s.rl is not None:
        _print_rl_simulated(plan, sim, mesh)
    elif sim is not None:
        head, note = _traced_head(plan, mesh)
        print(f"\nsimulated step with the {head} (fake tensors, rank 0 of {mesh.world_size}, {sim['seconds']:.1f} s): "
              f"traced peak {sim['peak'] / div:.3f} {unit} during the {sim['phase']}" + (f"; {note}" if note else ""))
        print(f"  {'component':<17}{'closed form':>12}{'traced max':>12}{'at peak':>10}{'after step':>11}   ({unit})")
        for k in ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "temporaries"):
            cf = plan.components.get(k)
            cf_s = f"{cf / div:>12.3f}" if cf is not None else f"{'-':>12}"
            # the closed-form activations include the backward's transient gradients (the tracker's Temp)
            traced = sim["max"].get("activations_and_temporaries" if k == "activations" else k, 0)
            print(f"  {k:<17}{cf_s}{traced / div:>12.3f}{sim['at_peak'].get(k, 0) / div:>10.3f}"
                  f"{sim['after_step'].get(k, 0) / div:>11.3f}")
        print("  (traced max of activations: saved tensors + the backward's transient gradients, as the closed "
              "form counts them)")
    if rows is not None:
        print(f"\nlayouts that fit ({len(rows)} shown, best expected throughput/GPU first; an analytic model "
              f"for {(ns.gpu or 'h100') if (ns.gpu or 'h100').lower() in _gpu_specs() else 'h100'}, not measured):")
        print(f"  {'pp':>2} {'schedule':>18} {'bubble':>6} {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'cp':>3} {'mb':>3} "
              f"{'recompute':>9} {'optimizer':>22} {'peak ' + unit:>9} {'tok/s/GPU':>10} {'MFU':>5}")
        for r in rows:
            sched = "-" if r["pp"] == 1 else r["pp_schedule"] + (f" v{r['pp_virtual_stages']}"
                                                                 if r["pp_virtual_stages"] > 1 else "")
            print(f"  {r['pp']:>2} {sched:>18} {100 * r['bubble']:>5.1f}% "
                  f"{r['dp_replicate']:>6} {r['dp_shard']:>8} {r['tp']:>3} {r['cp']:>3} {r['micro_batch']:>3} "
                  f"{r['recompute']:>9} {r['optimizer'] + ('+lowrank_grads' if r.get('lowrank_grads') else ''):>22} {r['peak_bytes'] / div:>9.3f} {r['tokens_per_s_per_gpu']:>10,} "
                  f"{r['mfu']:>5.2f}")
        if not rows:
            print("  none: more GPUs, a bigger GPU, or a smaller sequence")
        else:
            print(suggestion_text(rows[0], ns, num_gpus=ns.num_gpus or plan.mesh["world_size"]))
    if ns.plot:
        print(f"\nplot written to {ns.plot}")
    if ns.timeline:
        print(f"timeline written to {ns.timeline} (traced peak {sim['timeline'].peak / div:.3f} {unit}: "
              f"{sim['timeline'].peak_label})")
    return 0 if plan.fits in (None, True) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_main())
