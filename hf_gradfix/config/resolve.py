"""Resolve a combined accelerate + hf_gradfix YAML into what a launch will run: world size, mesh, global batch.

Shared by ``hf-gradfix config check`` / ``launch`` (:mod:`hf_gradfix.commands.check`,
:mod:`hf_gradfix.commands.launch`) and ``hf-gradfix plan --config`` (:mod:`hf_gradfix.plan.command`); both import it
from here (downward), and the run time applies the same ``parallel`` rule (:func:`parallel_requested`).

>>> import tempfile, os
>>> f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False); _ = f.write("num_processes: 2\\nhf_gradfix:\\n  loss: {}\\n"); f.close()
>>> rc = resolve_config(f.name, micro_batch=2, seq_len=8)
>>> rc.world_size, rc.mesh.dp, rc.global_batch_tokens
(2, 2, 32)
>>> os.unlink(f.name)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .loader import SECTION, read_config_file
from .schema import ConfigError, GradFixConfig, ParallelConfig

__all__ = ["ResolvedConfig", "parallel_requested", "resolve_config", "split_config"]


def parallel_requested(section: ParallelConfig) -> bool:
    """True when the ``parallel`` section differs from its defaults (the defaults mean: leave the launch as is).

    >>> parallel_requested(ParallelConfig()), parallel_requested(ParallelConfig(tp=2))
    (False, True)
    >>> parallel_requested(ParallelConfig(cp_balance="long_documents"))  # a layout option, not a mesh
    False
    """
    return section.mesh_given()  # cp_balance*: how cp lays out packed rows, not a mesh of its own


def describe_balance(balance: str, threshold: int | None, cp: int) -> str:
    """How a packed row is laid over the cp ranks, in words (the config summary and the packing log line).

    >>> describe_balance("per_document", None, 2)
    "documents padded to a multiple of 4 and split head-tail over the cp ranks (torch's per-document balancer)"
    """
    if balance == "long_documents":
        longer = f"{threshold} tokens or " if threshold is not None else ""
        return (f"documents longer than {longer}a rank's share of the row padded to a multiple of {2 * cp} and split "
                "head-tail over the cp ranks, the others dealt whole to the rank with the least attention work "
                "(cp_balance: long_documents)")
    return f"documents padded to a multiple of {2 * cp} and split head-tail over the cp ranks (torch's per-document balancer)"


_PC = "parallelism_config"
_PC_PREFIX = "parallelism_config_"
_PC_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def split_config(path: str | os.PathLike) -> tuple[dict, dict | None]:
    """``(accelerate's keys, the hf_gradfix section or None)`` of a YAML file, validated as a whole.

    The same loader as ``hf_gradfix.patch(config=path)``: a file is accepted or refused the same way by the
    library, ``config check`` and ``launch`` (raises :class:`~hf_gradfix.config.ConfigError`).

    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False); _ = f.write("num_processes: 2\\nhf_gradfix:\\n  packing: true\\n"); f.close()
    >>> split_config(f.name)
    ({'num_processes': 2}, {'packing': True})
    >>> os.unlink(f.name)
    """
    cf = read_config_file(path)
    return cf.accelerate, cf.section


def _accelerate_sizes(acc: dict) -> dict[str, int]:
    """Degrees from accelerate's ``parallelism_config`` section (already validated by the loader)."""
    pc = acc.get(_PC) or {}
    sizes: dict[str, int] = {}
    for key, value in pc.items():
        name = key[len(_PC_PREFIX):]
        name = name[: -len("_size")] if name.endswith("_size") else name
        if name in _PC_SIZES and value is not None:
            sizes[name] = int(value)
    return sizes


@dataclass
class ResolvedConfig:
    """What a launch with this file will run."""

    path: str
    world_size: int
    mesh: Any  # ParallelDims
    mesh_source: str
    gradfix: GradFixConfig
    distributed_type: str
    tokens_per_micro_batch: int | None
    grad_accum: int
    global_batch_tokens: int | None
    deepspeed: Any = None  # hf_gradfix.parallel.deepspeed.DeepSpeedSettings when the file selects DeepSpeed
    use_cpu: bool = False
    notes: list = field(default_factory=list)  # what the launch needs to know about the file, one line each

    def lines(self) -> list[str]:
        g = self.gradfix
        opt = g.optimizer
        out = [
            f"config            {self.path}",
            f"launch            {self.distributed_type}, {self.world_size} process(es)"
            + (" on the CPU (use_cpu: true; gloo)" if self.use_cpu else ""),
            f"mesh              {self.mesh.describe()} [from {self.mesh_source}]",
            f"loss              {'exact token mean over the window and ' + str(self.mesh.dp_cp) + ' rank(s) holding different tokens' if g.loss.enabled else 'left to transformers'}",
            f"packing           {'rows of <= %d tokens (%s)' % (g.packing.token_budget, g.packing.mode) if g.packing.enabled else 'off'}",
            f"optimizer         {opt.name if opt.name != 'none' else 'the Trainer default'}"
            + (f" (rank {opt.rank or (1 if opt.name == 'apollo_mini' else 128)}, gap {opt.update_proj_gap})"
               if opt.name != "none" else ""),
        ]
        if self.deepspeed is not None:
            out[1:2] = _deepspeed_lines(self)
        if self.mesh.cp > 1 and g.packing.enabled:
            how = describe_balance(g.parallel.cp_balance, g.parallel.cp_balance_threshold, self.mesh.cp)
            out.insert(3, (
                f"context parallel  cp={self.mesh.cp} over packed rows: {how}, sdpa with the document mask built on "
                "the full row, keys/values all-gathered; FSDP2 over dp_shard x cp; labels shifted and counted before "
                "the split"
            ))
        elif self.mesh.cp > 1:
            out.insert(3, (
                f"context parallel  cp={self.mesh.cp}: torch ring attention (sdpa, causal only), FSDP2 over dp_shard x cp; "
                f"sequences padded to a multiple of {2 * self.mesh.cp}, labels shifted and counted before the split"
            ))
        if self.mesh.ep > 1:
            out.insert(3, (
                f"expert parallel   ep={self.mesh.ep}: each MoE layer's experts split over {self.mesh.ep} ranks "
                f"(transformers' DistributedConfig ep_size, all-to-all token dispatch), FSDP2 over efsdp={self.mesh.efsdp}; "
                f"expert gradients cover every data rank's tokens once, averaged over the {self.mesh.dp} data ranks"
            ))
        if self.mesh.pp > 1:
            from ..parallel.pipeline_schedule import PipelineSpec, bubble_fraction  # one formula for config check and plan

            par = self.gradfix.parallel
            bubble = bubble_fraction(PipelineSpec(self.mesh.pp, par.pp_schedule, self.mesh.pp_virtual_stages,
                                                  self.grad_accum))
            out.insert(3, (
                f"pipeline          pp={self.mesh.pp} x {self.mesh.pp_virtual_stages} stage(s) per rank, {par.pp_schedule} "
                f"(torch.distributed.pipelining); one schedule step per optimizer window of {self.grad_accum} "
                f"micro-batch(es), bubble {_BUBBLE_FORMULA.get(par.pp_schedule, '(p-1)/(v*m+p-1)')} = {bubble:.0%}"
            ))
        if self.global_batch_tokens is not None:
            out.append(
                f"global batch      {self.global_batch_tokens:,} tokens = {self.tokens_per_micro_batch:,} per micro-batch "
                f"x {self.grad_accum} accumulation x {self.mesh.dp} data-parallel rank(s)"
            )
        else:
            out.append("global batch      pass --micro-batch and --seq-len (or enable packing) to compute it")
        out += [f"note              {note}" for note in self.notes]
        return out


#: the bubble formula of each schedule, as hf_gradfix.parallel.pipeline_schedule.bubble_fraction computes it (m >= p)
_BUBBLE_FORMULA = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved_1f1b": "(p-1)/(v*m+p-1)",
                   "zero_bubble": "(p-1)/(3*v*m+p-1)"}


def _deepspeed_lines(resolved: "ResolvedConfig") -> list[str]:
    """The ``launch`` / ``deepspeed`` lines of ``config check`` for a DeepSpeed file: what will really run."""
    ds = resolved.deepspeed
    where = ("CPU: DeepSpeed's CPU accelerator over gloo (hf-gradfix launch sets DS_ACCELERATOR=cpu and keeps "
             "ACCELERATE_USE_CPU unset; the script passes TrainingArguments(use_cpu=True))" if resolved.use_cpu else "GPU")
    return [
        f"launch            DEEPSPEED, {resolved.world_size} process(es), {where}",
        f"deepspeed         {ds.describe()}" + (f" [from {ds.config_file}]" if ds.config_file else ""),
    ]


def _check_deepspeed(path: str, acc: dict, section: dict | None, gradfix: GradFixConfig):
    """DeepSpeed settings of the file (None when it does not select DeepSpeed); refuses what cannot work with it."""
    from ..parallel.deepspeed import DeepSpeedConfigError, deepspeed_settings

    try:
        ds = deepspeed_settings(acc, path)
    except DeepSpeedConfigError as err:
        raise ConfigError(str(err)) from None
    if ds is None:
        return None
    if section is not None and parallel_requested(gradfix.parallel):
        raise ConfigError(
            f"{path}: {SECTION}.parallel with distributed_type DEEPSPEED: the parallel section builds its own FSDP2 / "
            "tensor-parallel mesh, DeepSpeed ZeRO partitions over every process itself. Remove the parallel section, "
            "or use distributed_type MULTI_GPU for the mesh"
        )
    if gradfix.optimizer.name != "none":
        raise ConfigError(
            f"{path}: {SECTION}.optimizer.name={gradfix.optimizer.name!r} with DeepSpeed: low-rank optimizers need each "
            "weight's 2-D gradient, which DeepSpeed ZeRO flattens and partitions. Use FSDP2 or DDP, or set "
            "optimizer.name: none"
        )
    return ds


def resolve_config(
    path: str | os.PathLike,
    *,
    num_processes: int | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    grad_accum: int = 1,
    model_config: Any = None,
    for_launch: bool = False,
) -> ResolvedConfig:
    """Validate a combined YAML and resolve world size, mesh and global batch (raises ConfigError / ParallelDimsError).

    ``for_launch`` (``config check`` and ``launch``): also refuse what accelerate's launcher cannot run, with the
    same line from both."""
    from ..parallel import ParallelDims
    path = str(path)
    cf = read_config_file(path)
    acc, section, gradfix = cf.accelerate, cf.section, cf.gradfix
    if num_processes is not None and (isinstance(num_processes, bool) or not 1 <= int(num_processes) <= 2**20):
        raise ConfigError(f"--num-processes {num_processes}: invalid value; it must be a whole number >= 1")
    world = int(num_processes if num_processes is not None else (acc.get("num_processes") or 1))
    acc_sizes = _accelerate_sizes(acc)
    par = gradfix.parallel
    ours_set = section is not None and parallel_requested(par)  # the run time's own rule (integration.parallel.nd uses it)
    if ours_set:
        from ..parallel.pipeline import PipelineError, check_combination, check_schedule

        from ..parallel import ParallelDimsError

        try:
            mesh = ParallelDims(world, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, cp=par.cp,
                                pp=par.pp, pp_virtual_stages=par.pp_virtual_stages, ep=par.ep)
        except ParallelDimsError as err:  # the file and the key as every other line names them
            given = (section or {}).get("parallel") if isinstance((section or {}).get("parallel"), dict) else {}
            if str(err).startswith("parallel.dp_shard=-1:") and "dp_shard" not in given:
                # the default took the blame for degrees the user set: name those and the world size's source
                degrees = {k: v for k, v in given.items() if k in ("pp", "tp", "cp", "dp_replicate")
                           and isinstance(v, int) and v > 0}
                product = 1
                for v in degrees.values():
                    product *= v
                world_from = "--num-processes" if num_processes is not None else "num_processes"
                raise ConfigError(
                    f"{path}: {SECTION}.parallel: the degrees set ({', '.join(f'{k}={v}' for k, v in degrees.items())}) "
                    f"multiply to {product}, which does not divide {world_from} {world}; dp_shard (not set: it takes "
                    f"the rest of the world) cannot fill it. Fix: a world size that is a multiple of {product}, or "
                    f"degrees whose product divides {world}") from None
            raise ConfigError(f"{path}: {SECTION}.{err}") from None
        source = f"{SECTION}.parallel"
        fsdp = str(acc.get("distributed_type", "")).upper() == "FSDP" or bool(acc.get("fsdp_config"))
        try:
            check_schedule(mesh.pp, par.pp_schedule, mesh.pp_virtual_stages)
            check_combination(pp=mesh.pp, tp=mesh.tp, cp=mesh.cp, dp_shard=mesh.dp_shard, packing=gradfix.packing.enabled,
                              optimizer=gradfix.optimizer.name, fsdp_plugin=fsdp, loss_enabled=gradfix.loss.enabled)
        except PipelineError as err:
            raise ConfigError(f"{path}: {SECTION}.{err}") from None
        from ..parallel.ep import EPError, check_combination as check_ep

        try:
            check_ep(ep=mesh.ep, pp=mesh.pp, tp=mesh.tp, cp=mesh.cp, packing=gradfix.packing.enabled,
                     optimizer=gradfix.optimizer.name, fsdp_plugin=fsdp)
        except EPError as err:
            raise ConfigError(f"{path}: {SECTION}.{err}") from None
        if acc_sizes:
            theirs = {k: acc_sizes.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "cp")}
            mine = {"dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard, "tp": mesh.tp, "cp": mesh.cp}
            if theirs != mine:
                raise ConfigError(
                    f"{path}: {SECTION}.parallel gives {mine} but accelerate's {_PC} gives {theirs}; keep one of them"
                )
    elif acc_sizes:
        if acc_sizes.get("sp", 1) > 1:
            raise ConfigError(f"{path}: {_PC}.{_PC_PREFIX}sp_size: DeepSpeed Ulysses sequence parallelism is not supported")
        mesh = ParallelDims(world, **{k: acc_sizes.get(k, 1) for k in ("dp_replicate", "dp_shard", "tp", "cp")})
        source = f"accelerate {_PC}"
    elif str(acc.get("distributed_type", "NO")).upper() == "FSDP":
        mesh = ParallelDims(world)
        source = "default: FSDP shards over every process"
    else:
        mesh = ParallelDims(world, dp_replicate=world, dp_shard=1)
        source = "default: every process a data-parallel replica"
    deepspeed = _check_deepspeed(path, acc, section, gradfix)
    if deepspeed is not None:
        source = f"DeepSpeed ZeRO-{deepspeed.stage} over every process"
    if model_config is not None:
        mesh.check_model(model_config)
    if mesh.cp > 1 and (str(acc.get("distributed_type", "")).upper() == "FSDP" or acc.get("fsdp_config")):
        raise ConfigError(
            f"{path}: cp={mesh.cp} with accelerate's FSDP plugin (distributed_type FSDP / fsdp_config): hf_gradfix shards "
            "the model itself for context parallelism (FSDP2 over dp_shard x cp); use distributed_type MULTI_GPU without "
            "fsdp_config"
        )
    for flag, value in (("--micro-batch", micro_batch), ("--seq-len", seq_len), ("--grad-accum", grad_accum)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: invalid value; it must be a whole number >= 1")
    if for_launch and acc and "distributed_type" not in acc:
        raise ConfigError(
            f"{path}: distributed_type: missing; accelerate launch needs it in a file that has accelerate keys "
            f"({', '.join(sorted(map(str, acc)))}): add distributed_type: 'NO' (one process), MULTI_CPU, MULTI_GPU "
            "or FSDP"
        )
    tokens = None
    if gradfix.packing.enabled:
        tokens = gradfix.packing.token_budget
    elif micro_batch is not None and seq_len is not None:
        tokens = micro_batch * seq_len
    global_tokens = tokens * grad_accum * mesh.dp if tokens is not None else None
    return ResolvedConfig(
        path=path,
        world_size=world,
        mesh=mesh,
        mesh_source=source,
        gradfix=gradfix,
        distributed_type=str(acc.get("distributed_type", "NO")),
        tokens_per_micro_batch=tokens,
        grad_accum=grad_accum,
        global_batch_tokens=global_tokens,
        deepspeed=deepspeed,
        use_cpu=bool(acc.get("use_cpu")),
        notes=([
            f"plain `accelerate launch` stops on the {SECTION}: section (its own parser knows no such key and "
            f"says \"try upgrading accelerate\"): launch this file with `hf-gradfix launch --config_file {path} "
            "train.py`, which gives accelerate its keys and every rank the section"] if section is not None and acc
            else []),
    )
