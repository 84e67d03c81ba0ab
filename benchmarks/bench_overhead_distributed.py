"""Overhead of hf_gradfix's loss fix on 2 processes: DeepSpeed ZeRO-3, pipeline parallelism 2, expert parallelism 2.

    python benchmarks/bench_overhead_distributed.py                   # all three meshes, ~3-4.5 min on 2 busy CPU cores
    python benchmarks/bench_overhead_distributed.py --mesh pp --rounds 6 --no-write    # one mesh, a smoke run
    python benchmarks/bench_overhead_distributed.py --no-control      # without the A/A control arm (a third faster)

The distributed counterpart of ``bench_overhead.py``. Each mesh is one ``torch.distributed.run`` launch of 2 gloo
processes on 127.0.0.1 (1 torch thread each) that runs this file with ``--worker``; rank 0 writes every rank's
per-step records as JSON, and the parent prints a markdown table (and writes ``results/overhead-distributed.md``).

* ``zero3``: a tiny Llama through ``transformers.Trainer`` with ``TrainingArguments(deepspeed={ZeRO stage 3})``
  (DeepSpeed on CPU, its collectives over gloo, as ``tests/support/deepspeed_worker.py`` runs it). Arms: ``stock``,
  ``patched`` (built after ``hf_gradfix.patch()``) and ``control`` (a second stock trainer: the A/A control).
* ``pp``: the same Llama split in 2 stages by ``hf_gradfix.patch({"parallel": {"pp": 2}})`` (1F1B). One arm: there
  is no stock Trainer pipeline to compare with.
* ``ep``: a tiny Qwen3-MoE loaded as a user loads it for expert parallelism, ``from_pretrained(path,
  distributed_config=DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"))`` (as
  ``tests/support/ep_worker.py``); arms ``stock``, ``patched`` (``loss.aux_loss: micro``), ``control``.

Where there are several arms, they live in the same 2 processes and take turns one optimizer step at a time: each
arm's ``trainer.train()`` runs in its own thread, and a callback hands a baton over at every ``on_step_end`` (only
the thread holding it runs, so both ranks issue their collectives in the same order). A round is one step of every
arm, in a rotating order (so drifts of a shared machine hit every arm alike); the first ``--warmup`` rounds (where
hf_gradfix probes the loss and AdamW allocates its state) are left out.

Measured per step and rank:

* the step's wall time, from the baton's hand-over (or ``on_train_begin``) to ``on_step_end``; a step's time is the
  slower rank's. ``patched / stock`` is the median of the paired per-round ratios, with their IQR; ``control /
  stock`` is the same for two stock trainers (the noise floor of the ratio on this machine);
* ``zero3`` / ``ep``: the trainer's step outside the model, its backward and the optimizer: ``get_batch_samples`` +
  ``training_step`` minus the model's forward and ``accelerator.backward`` (which under DeepSpeed also steps the
  engine). All of hf_gradfix's per-step loss work happens there: counting the window's targets, the count all-reduce,
  the rescaling, its checks around each micro-batch, under ep the router loss's share (stock does its own count
  gather there). "Loss fix" = patched minus stock, without the non-finite guard's loss checks (reported apart);
  below the table also without the count's one collective (stock's ``accelerator.gather``, hf_gradfix's
  ``accelerator.reduce``), whose latency on a busy machine is mostly scheduling, and ``bench_overhead.py``'s
  narrower "direct overhead" (``get_batch_samples`` + ``compute_loss`` minus the forward);
* ``pp``: hf_gradfix's own loss-normalization functions, timed by wrappers: ``count_window`` (counting the window's
  targets with ``count_targets``, and the count all-reduce) and the per-stage loss function's scaling (the
  schedule's ``loss_fn`` minus the model's cross-entropy inside it). All of their time, not a difference;
* the non-finite guard ``patch()`` also adds (a finiteness check of every micro-batch loss and of the gradients, one
  all-reduce of 2 flags per step), separately: it is not part of the loss fix.

Times that contain a collective also contain the wait for the other rank. Every such figure is taken per step as the
minimum over the 2 ranks (the rank that arrived last barely waits: the collective's own cost) and reported as the
median over the measured steps; the maximum over ranks (with the wait) is printed below the table. ``--profile DIR``
adds a cProfile of the patched arm's measured steps (per rank) and lists hf_gradfix's functions by time per step.

Default workload: Llama hidden 128, 4 layers, vocabulary 259 (as ``bench_overhead.py``), Qwen3-MoE hidden 64,
2 layers, 8 experts top-2; random token sequences of 32-128 tokens padded per micro-batch, per-device batch 4, gradient
accumulation 4, AdamW, fp32, CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT, results_path  # noqa: E402
MESHES = ("zero3", "pp", "ep")
PAD = 256  # the Llama's padding id (vocabulary 259: 256 byte-like tokens + pad, bos, eos)


# ----------------------------------------------------------------------------------------------------------------
# Workload (the same on every rank and in every arm)
# ----------------------------------------------------------------------------------------------------------------


def make_samples(n: int, args) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, 256, (length,), generator=g).tolist()} for length in lengths]


def collate(samples: list[dict]) -> dict:
    import torch

    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[row, : len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_llama(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=259, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(512, args.max_len), pad_token_id=PAD, bos_token_id=257,
                         eos_token_id=258, tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()


def build_moe(args):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3MoeConfig(vocab_size=259, hidden_size=args.moe_hidden, intermediate_size=2 * args.moe_hidden,
                            moe_intermediate_size=args.moe_hidden, num_hidden_layers=args.moe_layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=args.moe_hidden // 4,
                            num_experts=args.experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            output_router_logits=True, router_aux_loss_coef=0.001, max_position_embeddings=512,
                            pad_token_id=PAD, tie_word_embeddings=False, use_cache=False)
    return Qwen3MoeForCausalLM(config).float()


def training_args(args, out_dir: str, max_steps: int, **extra):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=max_steps, learning_rate=1e-4, optim="adamw_torch", weight_decay=0.0, lr_scheduler_type="constant",
        logging_steps=100_000, save_strategy="no", eval_strategy="no", report_to="none", use_cpu=True,
        dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False, disable_tqdm=True,
        seed=args.seed, data_seed=args.seed, **extra)


# ----------------------------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------------------------


class Stopwatch:
    """Seconds spent inside wrapped callables, per named slot, since the last :meth:`take` (one per arm: only the
    thread holding the baton runs, so no two threads add to one stopwatch at once)."""

    def __init__(self) -> None:
        self.slots: dict[str, float] = {}

    def wrap(self, fn, slot: str):
        @functools.wraps(fn)
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.slots[slot] = self.slots.get(slot, 0.0) + time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        out, self.slots = self.slots, {}
        return out


def time_loss_path(trainer, watch: Stopwatch) -> None:
    """The trainer's own code around the model, as instance attributes (the classes stay untouched): slots ``batch``
    (``get_batch_samples``), ``training_step`` (the instance's: on a patched trainer the non-finite guard's wrapper
    around hf_gradfix's), ``compute_loss`` (inside it), the model's ``forward`` and ``accelerator.backward``
    (``backward``; under DeepSpeed it also steps the engine at the window's end) inside those, and the count's
    ``collective`` (stock's ``accelerator.gather``, hf_gradfix's ``accelerator.reduce``: nothing else in a step calls
    them here)."""
    for name, slot in (("get_batch_samples", "batch"), ("compute_loss", "compute_loss"),
                       ("training_step", "training_step")):
        setattr(trainer, name, watch.wrap(getattr(trainer, name), slot))
    trainer.model.forward = watch.wrap(trainer.model.forward, "forward")
    trainer.accelerator.backward = watch.wrap(trainer.accelerator.backward, "backward")
    for name in ("gather", "reduce"):
        setattr(trainer.accelerator, name, watch.wrap(getattr(trainer.accelerator, name), "collective"))


def record_losses(trainer, sink: list) -> None:
    """Every micro-batch loss ``training_step`` returns (outside the timed slots): the stock and control arms see the
    same weights and data, so equal losses show that taking turns in threads changed nothing they compute."""
    step = trainer.training_step

    def recorded(*a, **kw):
        loss = step(*a, **kw)
        sink.append(float(loss))
        return loss

    trainer.training_step = recorded


def time_guard(trainer, watch: Stopwatch) -> None:
    """hf_gradfix's non-finite guard: its per-micro-batch loss check and its per-step gradient check + all-reduce
    (and, inside that, the gradient check and the flag all-reduce apart: module attributes, looked up when called;
    only the patched arm has a guard)."""
    from hf_gradfix.integration.diagnostics import nonfinite

    guard = nonfinite.guard_of(trainer)
    if guard is not None:  # instance attributes: the training_step wrapper and the callback handler look them up
        guard.after_micro_batch = watch.wrap(guard.after_micro_batch, "guard")
        guard.on_pre_optimizer_step = watch.wrap(guard.on_pre_optimizer_step, "guard_step")
        nonfinite.grads_finite = watch.wrap(nonfinite.grads_finite, "guard_grads")
        nonfinite.agree_any = watch.wrap(nonfinite.agree_any, "guard_allreduce")


# ----------------------------------------------------------------------------------------------------------------
# Arms taking turns, one optimizer step at a time
# ----------------------------------------------------------------------------------------------------------------


class Baton:
    """Which arm may run: ``order`` lists the arms' steps in sequence. An arm's thread holds the baton from its turn
    to its ``on_step_end`` (its last turn: until its ``train()`` returned, so end-of-training collectives stay in
    order too)."""

    def __init__(self, order: list[str], timeout: float) -> None:
        self.order, self.position, self.timeout = order, 0, timeout
        self.cond = threading.Condition()
        self.failed: BaseException | None = None

    def wait_for(self, arm: str) -> None:
        with self.cond:
            ready = self.cond.wait_for(lambda: self.failed is not None or (
                self.position < len(self.order) and self.order[self.position] == arm), timeout=self.timeout)
            if self.failed is not None:
                raise RuntimeError(f"arm {arm}: another arm failed") from self.failed
            if not ready:
                raise TimeoutError(f"arm {arm}: no turn within {self.timeout:.0f} s (position {self.position})")

    def pass_on(self, arm: str) -> None:
        with self.cond:
            if self.order[self.position] != arm:
                raise RuntimeError(f"arm {arm} passed a baton it did not hold")
            self.position += 1
            self.cond.notify_all()

    def fail(self, err: BaseException) -> None:
        with self.cond:
            self.failed = self.failed or err
            self.cond.notify_all()


def turn_order(arms: list[str], rounds: int) -> list[str]:
    """One step of every arm per round; the order rotates through every permutation (2 arms: alternates), so each arm
    runs first, in the middle and last equally often."""
    import itertools

    perms = list(itertools.permutations(arms))
    return [arm for r in range(rounds) for arm in perms[r % len(perms)]]


def step_recorder(arm: str, baton: Baton, watch: Stopwatch, records: list, profiler=None, warmup: int = 0):
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Times each optimizer step of one arm and hands the baton on at its end; ``profiler`` (a cProfile, which
        profiles the thread that enables it: this arm's) runs from the end of the warm-up on."""

        def on_train_begin(self, args, state, control, **kwargs):
            watch.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            records.append({"step": time.perf_counter() - self.start, **watch.take()})
            if profiler is not None and state.global_step == warmup:
                profiler.enable()
            if state.global_step < state.max_steps:
                baton.pass_on(arm)
                baton.wait_for(arm)
                self.start = time.perf_counter()

    return StepRecorder()


def run_arms(trainers: dict, baton: Baton, profilers: dict) -> None:
    """Every arm's ``train()`` in its own thread, in the baton's order; re-raises the first failure."""

    def run(arm: str, trainer) -> None:
        try:
            baton.wait_for(arm)
            trainer.train()
            if arm in profilers:
                profilers[arm].disable()
            baton.pass_on(arm)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            baton.fail(err)

    threads = [threading.Thread(target=run, args=item, name=f"arm-{item[0]}") for item in trainers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if baton.failed is not None:
        raise baton.failed


# ----------------------------------------------------------------------------------------------------------------
# The worker (one mesh, under torch.distributed.run)
# ----------------------------------------------------------------------------------------------------------------


def _checked(trainer, patched: bool):
    from hf_gradfix.integration.trainer_fix import state_of

    if (state_of(trainer) is not None) != patched:
        raise RuntimeError(f"expected a {'patched' if patched else 'stock'} trainer")
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def build_arms_zero3(args, arms: list[str], max_steps: int, world: int, out: str) -> dict:
    import transformers

    import hf_gradfix

    ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
          "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    # every model before any TrainingArguments(deepspeed=...): built whole on every rank, then partitioned by its
    # engine (no zero.Init), from the same seed
    models = {arm: build_llama(args) for arm in arms}
    data = make_samples((max_steps + 1) * args.batch_size * args.grad_accum * world, args)
    trainers = {}
    for arm in sorted(arms, key=lambda a: a != "patched"):  # patched first: patch() warns about earlier trainers
        targs = training_args(args, f"{out}/{arm}", max_steps, deepspeed=ds)
        if arm == "patched":
            hf_gradfix.patch({"log_fixes": False})
        try:
            trainer = transformers.Trainer(model=models[arm], args=targs, train_dataset=data, data_collator=collate)
        finally:
            if arm == "patched":
                hf_gradfix.unpatch()
        trainers[arm] = _checked(trainer, arm == "patched")
    return trainers


def build_arms_ep(args, arms: list[str], max_steps: int, world: int, out: str) -> dict:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    import hf_gradfix

    path = Path(out) / "checkpoint"
    if dist.get_rank() == 0:
        build_moe(args).save_pretrained(path)
    dist.barrier()
    data = make_samples((max_steps + 1) * args.batch_size * args.grad_accum * world, args)
    trainers = {}
    for arm in sorted(arms, key=lambda a: a != "patched"):
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all"),
            dtype=torch.float32).train()
        if arm == "patched":
            hf_gradfix.patch({"loss": {"aux_loss": "micro"}, "log_fixes": False})
        try:
            trainer = transformers.Trainer(model=model, args=training_args(args, f"{out}/{arm}", max_steps),
                                           train_dataset=data, data_collator=collate)
        finally:
            if arm == "patched":
                hf_gradfix.unpatch()
        trainers[arm] = _checked(trainer, arm == "patched")
    return trainers


def build_arm_pp(args, max_steps: int, out: str, watch: Stopwatch):
    """The pipeline trainer with hf_gradfix's loss-normalization functions timed (module attributes, looked up when
    called: ``count_window`` with the ``count_targets`` and the all-reduce inside it; the loss function handed to
    torch's schedule)."""
    import torch.distributed as dist
    import transformers

    import hf_gradfix
    from hf_gradfix.integration.parallel import pipeline as glue

    count_window = glue.count_window

    def count_window_collective_timed(*a, **kw):  # its all-reduce (torch.distributed's, looked up when called)
        all_reduce = dist.all_reduce
        dist.all_reduce = watch.wrap(all_reduce, "collective")
        try:
            return count_window(*a, **kw)
        finally:
            dist.all_reduce = all_reduce

    glue.count_window = watch.wrap(count_window_collective_timed, "count_window")
    glue.count_targets = watch.wrap(glue.count_targets, "counting")
    make_loss_fn = glue.window_loss_fn

    def timed_window_loss_fn(model, dp_degree):
        return watch.wrap(make_loss_fn(model, dp_degree), "loss_fn")

    glue.window_loss_fn = timed_window_loss_fn
    model = build_llama(args)
    model.loss_function = watch.wrap(model.loss_function, "cross_entropy")  # read by window_loss_fn at setup
    data = make_samples((max_steps + 1) * args.batch_size * args.grad_accum, args)  # one data rank: same batches
    hf_gradfix.patch({"parallel": {"pp": 2, "pp_schedule": "1f1b"}, "log_fixes": False})
    try:
        trainer = transformers.Trainer(model=model, args=training_args(args, f"{out}/patched", max_steps),
                                       train_dataset=data, data_collator=collate)
    finally:
        hf_gradfix.unpatch()
    return _checked(trainer, True)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import hf_gradfix

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    if args.mesh == "zero3":
        import deepspeed
        import deepspeed.ops

        # no shared-memory all-reduce op (its g++ build takes minutes): DeepSpeed's own fallback when the op cannot be
        # built, its collectives then go through torch's gloo (as tests/support/deepspeed_worker.py)
        deepspeed.ops.__compatible_ops__ = {}
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tempfile.mkdtemp(prefix=f"hgf_bench_overhead_{args.mesh}_") if rank == 0 else None
    holder = [out]
    dist.broadcast_object_list(holder)  # one folder for both ranks (the ep checkpoint is read by both)
    out = holder[0]
    arms = ["patched"] if args.mesh == "pp" else ["stock", "patched"] + (["control"] if args.control else [])
    order = turn_order(arms, args.warmup + args.rounds)
    max_steps = args.warmup + args.rounds
    watches = {arm: Stopwatch() for arm in arms}
    if args.mesh == "zero3":
        trainers = build_arms_zero3(args, arms, max_steps, world, out)
    elif args.mesh == "ep":
        trainers = build_arms_ep(args, arms, max_steps, world, out)
    else:
        trainers = {"patched": build_arm_pp(args, max_steps, out, watches["patched"])}
    baton = Baton(order, timeout=args.turn_timeout)
    records: dict[str, list] = {arm: [] for arm in arms}
    losses: dict[str, list] = {arm: [] for arm in arms}
    profilers = {arm: cProfile.Profile() for arm in arms} if args.profile else {}
    for arm, trainer in trainers.items():
        if args.mesh != "pp":
            time_loss_path(trainer, watches[arm])
            record_losses(trainer, losses[arm])
            if arm == "patched":
                from hf_gradfix.integration.trainer import window_steps  # only this arm's trainer is fixed

                window_steps.count_window = watches[arm].wrap(window_steps.count_window, "count_window")
                if args.mesh == "ep":  # the router loss's share of each micro-batch (imported per call)
                    from hf_gradfix.integration import moe

                    moe.aux_share = watches[arm].wrap(moe.aux_share, "aux_share")
        time_guard(trainer, watches[arm])
        trainer.add_callback(step_recorder(arm, baton, watches[arm], records[arm], profilers.get(arm), args.warmup))
    start = time.perf_counter()
    run_arms(trainers, baton, profilers)
    for arm, profiler in profilers.items():
        profiler.dump_stats(str(Path(args.profile) / f"{args.mesh}-{arm}-rank{rank}.prof"))
    state = hf_gradfix.state_of(trainers["patched"])
    if state is None or not state.fixes:
        raise RuntimeError("hf_gradfix did not fix the patched trainer; the benchmark would measure nothing")
    mine = dict(rank=rank, records=records, losses=losses, order=order, seconds=time.perf_counter() - start,
                fixes=list(state.fixes),
                wrapped={arm: type(t.model_wrapped).__name__ for arm, t in trainers.items()})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(args.record).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# The parent: launches, summary, table
# ----------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mesh: str, args, record: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker", "--mesh", mesh,
           "--record", str(record)]
    for key in ("rounds", "warmup", "hidden", "layers", "moe_hidden", "moe_layers", "experts", "min_len", "max_len",
                "batch_size", "grad_accum", "threads", "seed", "turn_timeout"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.profile:
        cmd += ["--profile", args.profile]
    if not args.control:
        cmd.append("--no-control")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("HF_GRADFIX_CONFIG", None)  # a launch file's section would combine with the worker's own
    if mesh == "zero3":
        env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench_overhead_distributed: mesh {mesh} failed (exit {proc.returncode})")
    return json.loads(record.read_text()), time.perf_counter() - t0


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Per arm: per measured step, the slower rank's step time and each timed slot taken over the ranks (min: the
    collective's own cost, max: with the wait for the other rank); medians over the steps; paired per-round ratios."""
    arms = list(ranks[0]["records"])
    per_arm = {}
    for arm in arms:
        steps = list(zip(*(r["records"][arm] for r in ranks)))[warmup:]  # per step: one record per rank

        def over_ranks(slot_of, pick):
            return [pick(slot_of(rec) for rec in step) for step in steps]

        def get(rec, *names):
            return sum(rec.get(n, 0.0) for n in names)

        def own(rec):  # the loss path outside the forward (bench_overhead.py's measure)
            return get(rec, "batch", "compute_loss") - get(rec, "forward")

        def wide(rec):  # all of the trainer's step outside forward, backward and the optimizer, guard apart
            return get(rec, "batch", "training_step") - get(rec, "forward", "backward", "guard")

        slots = {
            "step": over_ranks(lambda rec: rec["step"], max),
            "loss_path": over_ranks(own, min),
            "step_path": over_ranks(wide, min), "step_path_max": over_ranks(wide, max),
            "step_path_compute": over_ranks(lambda rec: wide(rec) - rec.get("collective", 0.0), min),
            "collective": over_ranks(lambda rec: rec.get("collective", 0.0), min),
            "guard": over_ranks(lambda rec: rec.get("guard", 0.0) + rec.get("guard_step", 0.0), min),
            "guard_max": over_ranks(lambda rec: rec.get("guard", 0.0) + rec.get("guard_step", 0.0), max),
            "guard_loss_checks": over_ranks(lambda rec: rec.get("guard", 0.0), min),
            "guard_grads": over_ranks(lambda rec: rec.get("guard_grads", 0.0), min),
            "guard_allreduce": over_ranks(lambda rec: rec.get("guard_allreduce", 0.0), min),
            "count_window": over_ranks(lambda rec: rec.get("count_window", 0.0), min),
            "count_window_max": over_ranks(lambda rec: rec.get("count_window", 0.0), max),
            "counting": over_ranks(lambda rec: rec.get("counting", 0.0), min),
            "aux_share": over_ranks(lambda rec: rec.get("aux_share", 0.0), min),
            # the scaling of the schedule's loss_fn: on the last stage (the first stage computes no loss)
            "scaling": over_ranks(lambda rec: rec.get("loss_fn", 0.0) - rec.get("cross_entropy", 0.0), max),
            "cross_entropy": over_ranks(lambda rec: rec.get("cross_entropy", 0.0), max),
        }
        per_arm[arm] = {"series": slots, **{k: statistics.median(v) for k, v in slots.items()}, "n": len(steps)}
    out = {"arms": per_arm}
    if "stock" in per_arm:
        for arm in ("patched", "control"):
            if arm in per_arm:
                ratios = [a / b for a, b in zip(per_arm[arm]["series"]["step"], per_arm["stock"]["series"]["step"])]
                out[f"{arm}_ratio"] = quartiles(ratios)
                out[f"{arm}_direct"] = per_arm[arm]["loss_path"] - per_arm["stock"]["loss_path"]
                for key in ("step_path", "step_path_max", "step_path_compute"):
                    out[f"{arm}_{key}"] = per_arm[arm][key] - per_arm["stock"][key]
    return out


def profile_lines(path: Path, steps: int, top: int = 12) -> list[str]:
    """hf_gradfix's functions in a cProfile dump, by cumulative time per measured step (nested ones overlap)."""
    import pstats

    package = str(ROOT / "hf_gradfix")
    rows = [(ct, nc, f"{Path(file).relative_to(ROOT)}:{line} {func}")
            for (file, line, func), (cc, nc, tt, ct, callers) in pstats.Stats(str(path)).stats.items()
            if file.startswith(package)]
    rows.sort(reverse=True)
    return [f"    {ct / steps * 1e3:8.3f} ms/step {nc / steps:6.1f} calls/step  {name}" for ct, nc, name in rows[:top]]


MESH_NAMES = {
    "zero3": "DeepSpeed ZeRO-3, 2 ranks (Llama)",
    "pp": "pp 2, 1F1B (Llama, 2 stages)",
    "ep": "ep 2 x dp_shard 2 (Qwen3-MoE)",
}


def loss_fix(res: dict) -> tuple[float, float, float]:
    """(the loss fix's seconds per step, the same without its collective, the step it is a share of)."""
    arms = res["arms"]
    if "stock" in arms:  # what the patched trainer's step adds outside the model, guard apart
        return res["patched_step_path"], res["patched_step_path_compute"], arms["stock"]["step"]
    p = arms["patched"]  # pp: hf_gradfix's own functions, all of them
    return p["count_window"] + p["scaling"], p["count_window"] - p["collective"] + p["scaling"], p["step"]


def table(results: dict) -> list[str]:
    lines = ["| mesh | step ms, stock | step ms, patched | patched / stock (IQR of the per-round ratios) | "
             "A/A control / stock (IQR) | loss fix, ms/step | loss fix, % of a step | without its collective, % of a "
             "step | non-finite guard, ms/step (% of a step) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mesh, res in results.items():
        arms = res["arms"]
        patched, stock = arms["patched"], arms.get("stock")
        fix, compute, base = loss_fix(res)

        def ratio(key):
            if key not in res:
                return "-"
            lo, mid, hi = res[key]
            return f"**{mid:.3f}** ({lo:.3f}-{hi:.3f})"

        stock_ms = f"{stock['step'] * 1e3:.0f}" if stock else "-"
        lines.append(f"| {MESH_NAMES[mesh]} | {stock_ms} | "
                     f"{patched['step'] * 1e3:.0f} | {ratio('patched_ratio')} | {ratio('control_ratio')} | "
                     f"{fix * 1e3:+.2f} | **{fix / base * 100:+.2f}%** | {compute / base * 100:+.2f}% | "
                     f"{patched['guard'] * 1e3:.2f} ({patched['guard'] / base * 100:.2f}%) |")
    return lines


def details(results: dict) -> list[str]:
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = []
    for mesh, res in results.items():
        arms = res["arms"]
        p = arms["patched"]
        guard = (f"non-finite guard {ms(p['guard'])} ms (gradient check {ms(p['guard_grads'])}, flag all-reduce "
                 f"{ms(p['guard_allreduce'])}, loss checks {ms(p['guard_loss_checks'])}; {ms(p['guard_max'])} with the "
                 "wait)")
        if mesh == "pp":
            lines.append(
                f"- **{mesh}**: step {ms(p['step'])} ms; loss fix {ms(p['count_window'] + p['scaling'])} ms/step = "
                f"`count_window` {ms(p['count_window'])} (counting the targets {ms(p['counting'])}, the count "
                f"all-reduce {ms(p['collective'])}; {ms(p['count_window_max'])} with the wait) + the loss's scaling on "
                f"the last stage {ms(p['scaling'])} (the cross-entropy around it, which any pipeline computes: "
                f"{ms(p['cross_entropy'])}); {guard}; {p['n']} measured steps.")
            continue
        s, c = arms["stock"], arms.get("control")

        def change(key, a_key=None):
            text = f"{ms(s[key])} -> {ms(p[key])} ms ({res['patched_' + (a_key or key)] * 1e3:+.2f}"
            return text + (f"; A/A {res['control_' + (a_key or key)] * 1e3:+.2f})" if c else ")")

        lines.append(
            f"- **{mesh}**: the step outside model, backward and optimizer, stock -> patched: {change('step_path')}; "
            f"with the wait (max over ranks) {change('step_path_max')}; the count's one collective, stock's gather "
            f"{ms(s['collective'])} -> hf_gradfix's all-reduce {ms(p['collective'])} ms, without it "
            f"{change('step_path_compute')}. bench_overhead.py's narrower loss path (`get_batch_samples` + "
            f"`compute_loss` minus the forward): {change('loss_path', 'direct')}. Inside it hf_gradfix's "
            f"`count_window` (counting + the count all-reduce) {ms(p['count_window'])} ms "
            f"({ms(p['count_window_max'])} with the wait)"
            + (f", the router loss's share (`moe.aux_share`, every micro-batch) {ms(p['aux_share'])} ms"
               if mesh == "ep" else "")
            + f". {guard[0].upper() + guard[1:]}; {p['n']} measured steps per arm.")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default=",".join(MESHES), help="comma-separated: " + ", ".join(MESHES))
    p.add_argument("--rounds", type=int, default=60, help="measured rounds (one step of every arm each; default 60)")
    p.add_argument("--warmup", type=int, default=2, help="rounds left out at the start (default 2)")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="no A/A control arm (a second stock trainer) on zero3 and ep")
    p.add_argument("--hidden", type=int, default=128, help="Llama hidden size (zero3, pp)")
    p.add_argument("--layers", type=int, default=4, help="Llama layers (zero3, pp)")
    p.add_argument("--moe-hidden", type=int, default=64, help="Qwen3-MoE hidden size (ep)")
    p.add_argument("--moe-layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turn-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--launch-timeout", type=float, default=1200, help=argparse.SUPPRESS)
    p.add_argument("--profile", default="", metavar="DIR",
                   help="cProfile the patched arm's measured steps on every rank into DIR and print hf_gradfix's share "
                        "per function (the profiler slows the steps: read the split, not the totals)")
    p.add_argument("--note", default="", help="a line added to the results file (e.g. what else ran)")
    p.add_argument("--write", default=results_path("overhead-distributed.md"))
    p.add_argument("--no-write", dest="write", action="store_const", const="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    import torch
    import transformers

    import hf_gradfix

    try:
        from importlib.metadata import version

        ds_version = version("deepspeed")
    except Exception:  # noqa: BLE001 - not installed
        ds_version = "not installed"
    cli = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python benchmarks/bench_overhead_distributed.py", *map(shlex.quote, cli)])
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="hgf_bench_overhead_dist_"))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results, raw, walls = {}, {}, {}
    for mesh in [m.strip() for m in args.mesh.split(",") if m.strip()]:
        if mesh not in MESHES:
            raise SystemExit(f"--mesh {mesh!r}: one of {', '.join(MESHES)}")
        raw[mesh], walls[mesh] = launch(mesh, args, tmp / f"{mesh}.json")
        results[mesh] = summarize(raw[mesh], args.warmup)
        print(f"bench_overhead_distributed: {mesh}: {walls[mesh]:.0f} s launch", file=sys.stderr, flush=True)
        for rank in range(2) if args.profile else ():
            print(f"profile of the patched arm, {mesh}, rank {rank} (cumulative, with the profiler's own overhead):")
            print("\n".join(profile_lines(Path(args.profile) / f"{mesh}-patched-rank{rank}.prof", args.rounds)))
    shutil.rmtree(tmp, ignore_errors=True)
    total = time.perf_counter() - start
    load = os.getloadavg()
    lines = [
        "# Overhead of the loss fix on 2 processes: DeepSpeed ZeRO-3, pp 2, ep 2 (CPU, gloo)", "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {total:.0f} s: "
        + ", ".join(f"{m} {w:.0f} s" for m, w in walls.items()) + "). "
        f"**{os.cpu_count()}-core CPU shared with other jobs, gloo over loopback; not a GPU number.** "
        f"{platform.machine()}, python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, deepspeed {ds_version}, hf_gradfix {hf_gradfix.__version__}; 2 processes x "
        f"{args.threads} torch thread(s); load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) at the end.", "",
        f"Workload: per-device batch {args.batch_size} x gradient accumulation {args.grad_accum}, random sequences of "
        f"{args.min_len}-{args.max_len} tokens padded per micro-batch, AdamW fp32; Llama hidden {args.hidden}, "
        f"{args.layers} layers ({n_params(build_llama(args)) / 1e6:.2f}M parameters); Qwen3-MoE hidden "
        f"{args.moe_hidden}, {args.moe_layers} layers, {args.experts} experts top-2 "
        f"({n_params(build_moe(args)) / 1e6:.2f}M). "
        f"{args.warmup} warm-up + {args.rounds} measured rounds per mesh; every arm of a mesh in the same 2 processes, "
        "one optimizer step at a time in rotating order.", "",
        *table(results), "",
        "Step ms: median over the measured steps of the slower rank's step. patched / stock: median of the paired "
        "per-round ratios (IQR in brackets); A/A control / stock: the same for two stock trainers (this machine's "
        "noise floor for the ratio). Loss fix: zero3 and ep, the trainer's step outside the model, its backward and "
        "the optimizer (`get_batch_samples` + `training_step` minus the model forward and `accelerator.backward`), "
        "patched minus stock, the guard's loss checks apart; pp, hf_gradfix's own `count_window` (counting + the "
        "count all-reduce) and the loss scaling inside the schedule's loss function, all of it (no stock pipeline to "
        "subtract). % of a step: of the stock step (pp: of the patched step). Without its collective: the same less "
        "the count's one collective (zero3 / ep: stock's gather, hf_gradfix's all-reduce; pp: the all-reduce), whose "
        "latency here is mostly the scheduling of 2 busy processes on 2 shared cores. Non-finite guard: what "
        "`patch()` adds besides the loss fix (`loss.on_nonfinite`, default `warn`): a finiteness check of each "
        "micro-batch loss and of the gradients plus a 2-flag all-reduce per step. Figures containing a collective: "
        "minimum over the 2 ranks per step (the rank that arrived last: the collective's own cost, not the wait for "
        "the other rank).", "",
        "Details:", "",
        *details(results), "",
    ]
    for mesh, ranks in raw.items():
        lines.append(f"- {mesh}: hf_gradfix: {'; '.join(ranks[0]['fixes'])}; models "
                     + ", ".join(f"{a} `{w}`" for a, w in ranks[0]["wrapped"].items()) + ".")
    for mesh, ranks in raw.items():
        losses = [r["losses"] for r in ranks]
        if "control" in losses[0]:
            same = all(r["stock"] == r["control"] for r in losses)
            n = sum(len(r["stock"]) for r in losses)
            gap = max(abs(a - b) for r in losses for a, b in zip(r["patched"], r["stock"]))
            lines.append(f"- {mesh}: stock and control, interleaved in threads, "
                         + (f"returned the same {n} micro-batch losses (bit for bit)" if same else
                            "returned DIFFERENT micro-batch losses: the interleaving disturbed a run, the numbers "
                            "above are not to be trusted")
                         + f"; patched vs stock: largest difference {gap:.2g}.")
    if args.note:
        lines += ["", args.note]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
