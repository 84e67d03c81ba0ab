"""``--simulate``: trace one real training step under fake tensors and report per-category memory of rank 0.

The model is built from its config inside ``FakeTensorMode`` (no storage is ever allocated), tensor-parallel
from its tp plan and/or sharded with FSDP2 (``MixedPrecisionPolicy(bf16, reduce fp32)`` for ``amp-bf16``) over a
fake process group of the configured world size (``init_process_group("fake")``: collectives return at once,
shapes are real), and run through forward (under autocast for unsharded ``amp-bf16``), backward and
``optimizer.step()`` twice (the second step is the steady state: the optimizer state exists during the
forward); with gradient accumulation the second step runs ``grad_accum`` micro-batches (at most
``TRACED_MICRO_BATCHES``: from the second on they hold the accumulated gradients and are all alike).  Attention is the same fused-profile function the closed form counts with (``activations.py``).
torch's ``MemTracker`` / ``FSDPMemTracker`` classify every storage (parameters, gradients, activations,
optimizer state, temporaries, FSDP all-gather / reduce-scatter buffers); this module records each plan
component's own maximum over the step (categories summed at every instant) and where the total peak happens.
Not traced: context parallelism (torch's ring attention has no sharding rule for the CPU SDPA kernel) and DDP
buckets (one replica is traced).  Private torch APIs (torch.distributed._tools, the fake process group,
``DeviceMesh._concatenate``): tested with torch 2.13.  ``timeline``: the last step sample by sample
(:class:`hf_gradfix.diagnostics.memory_timeline.MemoryTimeline`, the picture of ``--timeline``).  With
``Settings.loss_head="lean"`` the output layer computes the lean cross-entropy in its forward, as the run's
``loss.head: lean`` does (:func:`_lean_loss`).  With ``Settings.rl`` (``--rl grpo|rloo``) the step traced is a TRL
GRPO / RLOO optimizer step:
:func:`hf_gradfix.plan.rl_simulate.simulate_rl`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ..torch_private import private
from .estimate import PlanError, Settings
# shared with rl_simulate, which must not import this module (simulate() dispatches to it)
from .trace_setup import _MAP, TRACED_MICRO_BATCHES, _make_optimizer, check_traced_dtype

_SIM = "hf-gradfix plan --simulate"  # what needs torch's private fake-tensor and memory-tracker APIs

__all__ = ["TRACED_MICRO_BATCHES", "simulate"]

def _apply_tp(model, config, tp_mesh) -> None:
    """DTensor TP of every decoder layer from the config's ``base_model_tp_plan`` (colwise / rowwise)."""
    import re

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise PlanError(f"--simulate: {type(config).__name__} has no base_model_tp_plan; tp > 1 cannot be simulated")
    from .activations import decoder_layers

    for _, layer in decoder_layers(model):
        sub = {}
        for pattern, style in plan.items():
            m = re.fullmatch(r"layers\.\*\.(.+)", pattern)
            if not m:
                continue
            if "colwise" in style:
                sub[m.group(1)] = ColwiseParallel()
            elif "rowwise" in style:
                sub[m.group(1)] = RowwiseParallel()
        parallelize_module(layer, tp_mesh, sub)


@contextlib.contextmanager
def _device_meshes_built_for_real():
    """FSDP2 on a TP-sharded parameter concatenates the dp and tp meshes (``DeviceMesh._concatenate``) while the
    model is being sharded, i.e. inside ``FakeTensorMode``, where the mesh's rank tensor would become fake and
    the mesh unusable.  For the length of the trace, build those meshes outside fake mode (torch's own
    ``unset_fake_temporarily``); restored on exit."""
    unset_fake_temporarily = private("torch._subclasses.fake_tensor", "unset_fake_temporarily", feature=_SIM)
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if not isinstance(original, staticmethod):  # a torch that builds 2-D FSDP meshes another way: nothing to do
        yield
        return
    fn = original.__func__

    def _concatenate(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(_concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


def _lean_loss(model, ids):
    """The lean head's step on ``ids``, as ``loss.head: lean`` runs it (hf_gradfix/integration/lean_head.py, which a
    capability does not import): for the length of the model call the output layer's ``forward`` computes the summed
    cross-entropy of its input (the final hidden states) against the next-token targets
    (:func:`hf_gradfix.loss.lean_head.head_cross_entropy_sum`, in autocast's dtype where it is on) with the weight it
    holds then (FSDP2 has unsharded it for the forward), and returns a zero-cost stand-in for the logits; the loss is
    that sum over the targets. (The run computes the same sum where the model calls its loss function, right after
    the head, with the same weight and hidden states alive: the same memory.)"""
    from ..loss.lean_head import head_cross_entropy_sum, next_token_targets

    head = model.get_output_embeddings()
    targets = next_token_targets(ids)
    got = {}

    def forward(hidden):
        got["sum"] = head_cross_entropy_sum(hidden, head.weight, head.bias, targets)
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], head.weight.shape[0])

    head.forward = forward  # an instance attribute, removed below: the class's forward is untouched
    try:
        model(input_ids=ids)  # no labels: the model computes no loss of its own
    finally:
        del head.forward
    if "sum" not in got:
        raise PlanError(f"--simulate with --loss-head lean: {type(model).__name__}'s forward did not call its output "
                        "layer (get_output_embeddings) once; simulate it with --loss-head stock")
    return got["sum"] / targets.numel()


def simulate(config, mesh, settings: Settings, *, steps: int = 2, fake: bool = True,
             progress: Any = None) -> dict[str, Any]:
    """Trace ``steps`` training steps of rank 0 (bytes): ``peak`` (total), ``at_peak`` (per component at that
    instant), ``after_step`` (what stays between steps: weights, optimizer state), ``max`` (each component's own
    maximum), ``phase`` (forward / backward / optimizer step), ``seconds``, ``loss_head`` (the head traced: the lean
    one wherever the run uses it for ``Settings.loss_head="lean"``, FSDP2 included; the stock one under tp) and
    ``stock_head_reason`` (why not lean, where it was asked for).  ``fake=False`` runs the same step
    on real tensors (one process), which is how the fake trace itself is checked.  ``progress``: called with one
    line per phase (model built, each step), e.g. ``print``."""
    if settings.rl is not None:  # a TRL GRPO / RLOO step: generation, no-grad log-prob forwards, training
        if not fake:
            raise PlanError("simulate(fake=False) with Settings.rl: the RL step is traced under fake tensors only; "
                            "the tests run the real step themselves (tests/plan/test_plan_rl_timeline.py)")
        from .rl_simulate import simulate_rl

        return simulate_rl(config, mesh, settings, progress=progress)
    say = progress or (lambda line: None)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    FakeTensorMode = private("torch._subclasses.fake_tensor", "FakeTensorMode", feature=_SIM)
    FSDPMemTracker = private("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", feature=_SIM)
    MemTracker = private("torch.distributed._tools.mem_tracker", "MemTracker", feature=_SIM)
    settings.check()
    mesh.check_model(config)
    stock_why = None
    if settings.loss_head == "lean":
        from .lean_head import stock_head_reason

        stock_why = stock_head_reason(tp=mesh.tp)
    if mesh.cp > 1:
        raise PlanError("--simulate: context parallelism is not simulated (cp > 1): torch's ring attention has no "
                        "sharding rule for the CPU SDPA kernel that fake tensors run; use the closed form")
    check_traced_dtype(settings.dtype)
    amp = settings.dtype == "amp-bf16"
    dtype = torch.bfloat16 if settings.dtype == "bf16-pure" else torch.float32
    t0 = time.perf_counter()
    sharded = mesh.dp_shard * mesh.cp > 1
    started_pg = False
    if sharded or mesh.tp > 1:
        FakeStore = private("torch.testing._internal.distributed.fake_pg", "FakeStore", feature=_SIM)

        if dist.is_initialized():
            raise PlanError("--simulate needs to start its own fake process group; one is already initialized")
        dist.init_process_group("fake", rank=0, world_size=mesh.world_size, store=FakeStore())
        started_pg = True
    cat_max: dict[str, int] = {}
    comp_max: dict[str, int] = {}
    phase = {"now": "forward", "peak": None}

    from ..diagnostics.memory_timeline import timeline_tracker_class

    def mixin(base):
        class _Tracker(timeline_tracker_class(base)):
            def _update_peak_stats(self, peak_state):  # noqa: D401
                before = dict(self._peak_mem)
                super()._update_peak_stats(peak_state)
                for dev, snap in self._curr_mem_snap.items():
                    comp: dict[str, int] = {}
                    for k, v in snap.items():
                        key = getattr(k, "value", k)
                        if v > cat_max.get(key, 0):
                            cat_max[key] = v
                        if key != "Total":
                            c = _MAP.get(key, "other")
                            comp[c] = comp.get(c, 0) + v
                    if not self._in_opt:
                        # what forward and backward hold beyond the model state: saved activations plus the
                        # backward's transient gradients (the tracker files those under Temp)
                        comp["activations_and_temporaries"] = comp.get("activations", 0) + comp.get("temporaries", 0)
                    for c, v in comp.items():  # each component's own maximum over the step (summed categories)
                        if v > comp_max.get(c, 0):
                            comp_max[c] = v
                    if self._peak_mem.get(dev, 0) != before.get(dev, 0):
                        phase["peak"] = ("optimizer step" if self._in_opt else
                                         "backward" if self._mod_tracker.is_bw else "forward")
        return _Tracker

    from .activations import (data_dependent_refused, decoder_layers, fake_kernel_mode, one_sequence_per_row,
                              prepare_config, set_trace_attention)

    try:
        config = prepare_config(config)
        dm = mesh.build_mesh("cpu") if started_pg else None
        tp_mesh = fsdp_mesh = None  # sub-meshes are sliced outside fake mode (slicing reads the mesh tensor)
        if dm is not None:
            names = dm.mesh_dim_names
            if mesh.tp > 1:
                tp_mesh = dm["tp"] if len(names) > 1 else dm
            if sharded:
                shard = "dp_shard_cp" if mesh.cp > 1 else "dp_shard"
                if len(names) == 1:
                    fsdp_mesh = dm
                elif mesh.dp_replicate > 1:
                    fsdp_mesh = dm[("dp_replicate", shard)]
                else:
                    fsdp_mesh = dm[shard]
        two_d = _device_meshes_built_for_real() if (mesh.tp > 1 and sharded) else contextlib.nullcontext()
        if not fake and started_pg:
            raise PlanError("simulate(fake=False) runs a real step and needs one process (no fake process group)")
        # fake=False: the same step on real tensors (a check of the fake trace; tiny models only)
        with (FakeTensorMode() if fake else contextlib.nullcontext()), two_d, data_dependent_refused(config):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model.train()
            set_trace_attention(model, settings.attention)  # the same attention as the closed form's count
            if settings.recompute == "full":
                if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if mesh.tp > 1:
                _apply_tp(model, config, tp_mesh)
            if sharded:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp else \
                    MixedPrecisionPolicy()
                for _, layer in decoder_layers(model):
                    fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
                fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
            opt = _make_optimizer(model, settings)
            say(f"model built{' and sharded' if sharded or mesh.tp > 1 else ''} under fake tensors "
                f"({time.perf_counter() - t0:.1f} s); tracing {steps} step(s) ...")
            tokens = settings.seq_len // mesh.cp
            # loss.head: lean where the run uses it (without pp: everywhere but a tp-sharded head, FSDP2 included)
            lean = settings.loss_head == "lean" and stock_why is None
            ids = torch.randint(0, config.vocab_size, (settings.micro_batch, tokens))
            tracker = (mixin(FSDPMemTracker)(model, opt) if sharded else mixin(MemTracker)())
            tracker.timeline_setup([m for _, m in decoder_layers(model)], torch.device("cpu"))
            if not sharded:
                tracker.track_external(model, opt)
            # Gradient accumulation: from the second micro-batch on, forward and backward run with the accumulated
            # gradients alive (the peak rises by up to the gradients' size). Micro-batches 2, 3, ... hold exactly the
            # same memory, so at most TRACED_MICRO_BATCHES are traced; the first steps only make the optimizer state.
            micro_batches = min(settings.grad_accum, TRACED_MICRO_BATCHES)
            # unpacked rows: transformers' packed-document detection would build a 4-D mask on fake tensors only
            with tracker, fake_kernel_mode(), (one_sequence_per_row() if fake else contextlib.nullcontext()):
                for step in range(steps):
                    last = step == steps - 1
                    if last:
                        tracker.reset_mod_stats()
                        cat_max.clear(); comp_max.clear()
                        tracker._peak_mem.clear(); tracker._peak_mem_snap.clear()
                        tracker.timeline_sample(("other", "step start"))  # the timeline: the last step only
                        tracker.timeline_on()
                    for _ in range(micro_batches if last else 1):
                        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if (amp and not sharded) else \
                            contextlib.nullcontext()
                        with autocast:
                            # the loss only, as Trainer.compute_loss returns it: the output (its logits) is
                            # dropped before backward
                            loss = _lean_loss(model, ids) if lean else model(input_ids=ids, labels=ids).loss
                        loss.backward()
                        del loss
                    opt.step()
                    opt.zero_grad()
                    say(f"step {step + 1}/{steps} traced ({micro_batches if last else 1} micro-batch(es) forward and "
                        f"backward, optimizer step; {time.perf_counter() - t0:.1f} s)")
                tracker.timeline_on(False)
                tracker.timeline_sample(("other", "after step"))
                after_snap = tracker.get_tracker_snapshot()  # steady state, after the step
            peak_snap = tracker.get_tracker_snapshot("peak")
    finally:
        if started_pg:
            dist.destroy_process_group()
    snap = next(iter(peak_snap.values()))

    def by_component(snapshot):
        out: dict[str, int] = {}
        for k, v in snapshot.items():
            key = getattr(k, "value", k)
            if key != "Total":
                comp = _MAP.get(key, "other")
                out[comp] = out.get(comp, 0) + v
        return out

    at_peak = by_component(snap)
    after_step = by_component(next(iter(after_snap.values()))) if after_snap else {}
    timeline = tracker.timeline(source="fake-tensor trace", title=f"rank 0 of {mesh.world_size}")
    timeline.meta.update(grad_accum=settings.grad_accum, micro_batches_traced=micro_batches)
    timeline.meta.update(loss_head="lean" if lean else "stock",
                         **({"stock_head_reason": stock_why} if stock_why is not None else {}))
    return {"peak": snap["Total"], "at_peak": at_peak, "timeline": timeline, "after_step": after_step,
            "loss_head": "lean" if lean else "stock", "stock_head_reason": stock_why,
            "max": dict(comp_max),
            "phase": phase["peak"],
            "seconds": time.perf_counter() - t0, "raw_max": cat_max}
