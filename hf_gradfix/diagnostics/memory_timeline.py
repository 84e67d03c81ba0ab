"""Memory over one training step, by category: traced under fake tensors (the planner) or measured on a real run.

One *sample* is taken after every op torch dispatches (the instant memory can rise) plus one at the start and
one at the end of the step; each sample holds the bytes of every live storage, sorted into the plan's categories
(parameters, gradients, optimizer state, activations, temporaries, FSDP communication buffers).  The storages
are counted by torch's ``MemTracker`` / ``FSDPMemTracker`` (``torch.distributed._tools``), which sees every
storage an op creates and drops it when the storage is freed; it works on real CPU or CUDA tensors and on fake
tensors alike, so the planner's trace and a measured step give the same picture.  On CUDA each sample also
reads ``torch.cuda.memory_allocated()`` (the caching allocator's own count, which includes what the tracker cannot
see: allocator rounding, workspace buffers).

Samples are grouped into *events*, consecutive samples under the same label: ``forward: embeddings``,
``forward layer i``, ``forward: head + loss``, ``backward: loss + head``, ``backward layer i``,
``backward: embeddings + grad reduction``, ``after backward``, ``optimizer step``, ``after step``.

Any loop (a ``TokenWindow`` loop, plain PyTorch, accelerate)::

    rec = MemoryTimelineRecorder(model, optimizer)
    with rec.step():                      # one optimizer step (all its micro-batches)
        ...forward, backward, optimizer.step(), zero_grad...
    rec.last.plot("step.png"); rec.last.at_peak

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> rec = MemoryTimelineRecorder(model, opt)
>>> with rec.step():
...     model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
>>> rec.last.totals[-1] == sum(p.numel() * 4 for p in model.parameters())   # after the step: the weights
True
>>> rec.last.peak_phase
'backward'
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import UsageError

__all__ = ["CATEGORIES", "TRACKER_CATEGORIES", "MemoryTimeline", "MemoryTimelineRecorder", "decoder_layer_modules",
           "peak_log_values", "plot_memory_timeline", "timeline_tracker_class"]

#: the timeline's categories, bottom to top of the stacked plot
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "comm_buffers", "other")

#: torch tracker category -> timeline category (FSDP2's unsharded parameters / gradients are communication buffers:
#: they exist only around a unit's all-gather and reduce-scatter)
TRACKER_CATEGORIES = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "comm_buffers",
    "Buffer": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "comm_buffers",
    "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer_state", "OptState": "optimizer_state",
    "Other": "other", "All Gather": "comm_buffers", "Reduce Scatter": "comm_buffers",
}

_COLORS = {"parameters": "#4C72B0", "master_weights": "#8DA0CB", "gradients": "#55A868", "optimizer_state": "#C44E52",
           "activations": "#8172B2", "temporaries": "#CCB974", "comm_buffers": "#937860", "other": "#8C8C8C",
           "fragmentation": "#DDDDDD"}


@dataclass
class MemoryTimeline:
    """Memory of one step, sample by sample (bytes).

    ``series[c][i]``: bytes of category ``c`` live at sample ``i``; ``totals[i]``: the tracker's own total there
    (the categories sum to it); ``labels[i]`` / ``phases[i]``: the event and phase (forward, backward,
    optimizer, other) the sample belongs to; ``allocated[i]``: ``torch.cuda.memory_allocated()`` (CUDA only);
    ``micro_batches[i]``: the micro-batch (1, 2, ... within the step; 0 before the first forward) whose forward,
    backward or aftermath the sample belongs to: with gradient accumulation every later micro-batch runs with
    the accumulated gradients alive."""

    labels: list[str]
    phases: list[str]
    series: dict[str, list[int]]
    totals: list[int]
    source: str = "measured"
    title: str = ""
    allocated: list[int] | None = None
    step: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    micro_batches: list[int] | None = None

    # -- summary -------------------------------------------------------------------------------------------------
    @property
    def peak_index(self) -> int:
        """The first sample where the total is at its maximum."""
        return max(range(len(self.totals)), key=lambda i: (self.totals[i], -i))

    @property
    def peak(self) -> int:
        return self.totals[self.peak_index]

    @property
    def peak_label(self) -> str:
        return self.labels[self.peak_index]

    @property
    def peak_phase(self) -> str:
        return self.phases[self.peak_index]

    @property
    def peak_micro_batch(self) -> int | None:
        """The micro-batch the peak happens in (None when not recorded)."""
        return self.micro_batches[self.peak_index] if self.micro_batches else None

    @property
    def micro_batch_count(self) -> int:
        """Micro-batches (forward passes) in the step."""
        return max(self.micro_batches) if self.micro_batches else 1

    def at(self, i: int) -> dict[str, int]:
        return {c: self.series[c][i] for c in CATEGORIES}

    @property
    def at_peak(self) -> dict[str, int]:
        """Bytes per category at the peak instant."""
        return self.at(self.peak_index)

    def category_max(self) -> dict[str, int]:
        """Each category's own maximum over the step."""
        return {c: max(v) if v else 0 for c, v in self.series.items()}

    def events(self) -> list[dict[str, Any]]:
        """Consecutive samples with the same label: ``label``, ``phase``, ``first``/``last`` sample, ``max`` (bytes per
        category at the event's highest total) and ``end`` (per category at its last sample)."""
        out: list[dict[str, Any]] = []
        start = 0
        for i in range(1, len(self.labels) + 1):
            if i == len(self.labels) or self.labels[i] != self.labels[start] or (
                    self.micro_batches and self.micro_batches[i] != self.micro_batches[start]):
                top = max(range(start, i), key=lambda j: (self.totals[j], -j))
                out.append({"label": self.labels[start], "phase": self.phases[start], "first": start, "last": i - 1,
                            "max_total": self.totals[top], "max": self.at(top), "end": self.at(i - 1),
                            **({"micro_batch": self.micro_batches[start]} if self.micro_batches else {})})
                start = i
        return out

    def to_dict(self) -> dict[str, Any]:
        """The per-event series and the peak (JSON-ready)."""
        return {"source": self.source, "title": self.title, "samples": len(self.totals), "step": self.step,
                "peak": self.peak, "peak_label": self.peak_label, "peak_phase": self.peak_phase,
                "at_peak": self.at_peak, "category_max": self.category_max(), "events": self.events(),
                "micro_batches": self.micro_batch_count, "peak_micro_batch": self.peak_micro_batch,
                **({"allocated_max": max(self.allocated)} if self.allocated else {}), **self.meta}

    def plot(self, path: str, **kwargs: Any) -> str:
        """See :func:`plot_memory_timeline`."""
        return plot_memory_timeline(self, path, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------------------------
def timeline_tracker_class(base: type) -> type:
    """A subclass of torch's ``MemTracker`` / ``FSDPMemTracker`` (``base``) that samples its current snapshot after
    every op while ``timeline_on()`` is in force, labelling each sample with the event it belongs to.

    Module statistics are reset whenever the root module's forward starts again, so gradient accumulation
    (several forwards per step) works; the tracker's peak and categories are untouched."""

    class _TimelineTracker(base):
        def timeline_setup(self, layers: Sequence[Any], device: Any) -> None:
            self._tl_layers = list(layers)
            self._tl_fqn: dict[str, int] = {}
            self._tl_device = device
            self._tl_on = False
            self._tl_labels: list[str] = []
            self._tl_phases: list[str] = []
            self._tl_series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
            self._tl_totals: list[int] = []
            self._tl_alloc: list[int] | None = [] if getattr(device, "type", "cpu") == "cuda" else None
            self._tl_pass = ("", False)  # (phase of the current pass, a decoder layer seen in it)
            self._tl_micro = 0  # micro-batches begun in this step (the root module's forward, counted)
            self._tl_micro_of: list[int] = []

        def timeline_on(self, on: bool = True) -> None:
            self._tl_on = on

        def _layer_of(self, parents) -> int | None:
            if len(self._tl_fqn) < len(self._tl_layers):
                for i, m in enumerate(self._tl_layers):
                    fqn = self._mod_tracker.get_known_fqn(m)
                    if fqn is not None:
                        self._tl_fqn[fqn] = i
            found = [self._tl_fqn[p] for p in parents if p in self._tl_fqn]
            return max(found) if found else None

        def _label(self) -> tuple[str, str]:
            if self._in_opt:
                self._tl_pass = ("optimizer", False)
                return "optimizer", "optimizer step"
            bw = bool(self._mod_tracker.is_bw)
            phase = "backward" if bw else "forward"
            parents = self._mod_tracker.parents
            layer = self._layer_of(parents)
            last_phase, seen = self._tl_pass
            if phase != last_phase:
                seen = False
            if layer is not None:
                self._tl_pass = (phase, True)
                return phase, f"{phase} layer {layer}"
            if not bw and len(parents) <= 1:  # no module running, not in backward
                if last_phase == "backward":
                    return "other", "after backward"
                if last_phase == "optimizer":
                    return "other", "after optimizer step"
                if last_phase == "":
                    return "other", "step start"
            self._tl_pass = (phase, seen)
            if bw:
                return phase, ("backward: embeddings + grad reduction" if seen else "backward: loss + head")
            return phase, ("forward: head + loss" if seen else "forward: embeddings")

        def timeline_sample(self, label: tuple[str, str] | None = None) -> None:
            phase, name = label or self._label()
            snap = self._curr_mem_snap.get(self._tl_device, {})
            comp = dict.fromkeys(CATEGORIES, 0)
            total = 0
            for k, v in snap.items():
                key = getattr(k, "value", k)
                if key == "Total":
                    total = v
                else:
                    comp[TRACKER_CATEGORIES.get(key, "other")] += v
            for c in CATEGORIES:
                self._tl_series[c].append(comp[c])
            self._tl_totals.append(total)
            self._tl_labels.append(name)
            self._tl_phases.append(phase)
            self._tl_micro_of.append(self._tl_micro)
            if self._tl_alloc is not None:
                import torch

                self._tl_alloc.append(torch.cuda.memory_allocated(self._tl_device))

        def _root_forward_begins(self, module) -> None:
            # the root module's forward: a new micro-batch; again within one step (gradient accumulation): new stats
            name = self._mod_tracker.get_known_fqn(module)
            if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {name} == {"Global"}:
                if self._tl_on:
                    self._tl_micro += 1
                if module in self.memory_tracking:
                    self.reset_mod_stats()

        def _pre_fw_hook(self, module, inputs):  # noqa: D401
            self._root_forward_begins(module)
            super()._pre_fw_hook(module, inputs)

        if hasattr(base, "_fsdp_state_pre_forward"):  # FSDPMemTracker: the same, at FSDP2's pre-forward
            def _fsdp_state_pre_forward(self, fsdp_mod, orig):
                inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def pre_forward(*args, **kwargs):
                    self._root_forward_begins(fsdp_mod)
                    return inner(*args, **kwargs)

                return pre_forward

        def _update_peak_stats(self, peak_state):  # noqa: D401
            super()._update_peak_stats(peak_state)
            if self._tl_on:
                self.timeline_sample()

        def timeline(self, **kw: Any) -> MemoryTimeline:
            return MemoryTimeline(labels=_merge_between_layers(self._tl_labels, self._tl_phases),
                                  phases=list(self._tl_phases),
                                  series={c: list(v) for c, v in self._tl_series.items()},
                                  totals=list(self._tl_totals),
                                  allocated=list(self._tl_alloc) if self._tl_alloc is not None else None,
                                  micro_batches=list(self._tl_micro_of), **kw)

    _TimelineTracker.__name__ = f"Timeline{base.__name__}"
    return _TimelineTracker


def _merge_between_layers(labels: list[str], phases: list[str]) -> list[str]:
    """Ops between two decoder layers of the same pass (FSDP2's reshard / prefetch, a hook) join the layer before:
    an ``... head + loss`` / ``... embeddings`` label is only right after the last / before the first layer."""
    out = list(labels)
    layer = re.compile(r"(forward|backward) layer \d+$")
    i = 0
    while i < len(out):
        if layer.match(out[i]):
            j = i + 1
            while j < len(out) and out[j] == out[i]:
                j += 1
            k = j
            while k < len(out) and not layer.match(out[k]) and phases[k] == phases[i] and out[k] in _SHORT:
                k += 1
            if j < k < len(out) and layer.match(out[k]) and phases[k] == phases[i]:
                out[j:k] = [out[i]] * (k - j)
            i = j
        else:
            i += 1
    return out


def decoder_layer_modules(model: Any) -> list[Any]:
    """The repeated blocks of ``model``: the longest ``nn.ModuleList`` (decoder layers of every architecture
    ``AutoModelForCausalLM`` builds; empty when there is none)."""
    import torch

    best: list[Any] = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best):
            best = list(mod)
    return best


class MemoryTimelineRecorder:
    """Record the memory timeline of chosen training steps of ``model`` / ``optimizer`` on real tensors.

    Storages are classified by torch's ``MemTracker``: the model's parameters and buffers, gradients, the
    optimizer's state, and what forward (activations) and backward (temporaries) allocate while a step is
    recorded.  Tensors created outside a recorded step and not owned by the model or the optimizer (the
    batch the data loader made) are not counted.  ``begin()`` / ``end()`` (or ``with rec.step():``) bracket one
    optimizer step; ``timelines`` holds the recorded steps, ``last`` the latest."""

    def __init__(self, model: Any, optimizer: Any = None, *, layers: Sequence[Any] | None = None,
                 device: Any = None, title: str = "") -> None:
        import torch

        self.model = model
        self.optimizer = optimizer
        self.layers = list(layers) if layers is not None else decoder_layer_modules(model)
        if device is None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.title = title
        self.timelines: list[MemoryTimeline] = []
        self._tracker: Any = None

    @property
    def last(self) -> MemoryTimeline | None:
        return self.timelines[-1] if self.timelines else None

    @property
    def recording(self) -> bool:
        return self._tracker is not None

    def begin(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        if self._tracker is not None:
            raise UsageError("MemoryTimelineRecorder.begin(): a step is already being recorded; call end() first")
        if _is_fsdp2(self.model):  # FSDP2: sharded / unsharded parameters, all-gather and reduce-scatter buffers
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            tracker = timeline_tracker_class(FSDPMemTracker)(self.model, _inner_optimizer(self.optimizer))
        else:
            tracker = timeline_tracker_class(MemTracker)()
            tracker.track_external(*(x for x in (self.model, _inner_optimizer(self.optimizer)) if x is not None))
        tracker.timeline_setup(self.layers, self.device)
        tracker.__enter__()
        self._tracker = tracker
        tracker.timeline_sample(("other", "step start"))
        tracker.timeline_on()

    def end(self, step: int | None = None) -> MemoryTimeline:
        tracker = self._tracker
        if tracker is None:
            raise UsageError("MemoryTimelineRecorder.end() without begin()")
        tracker.timeline_on(False)
        if self.optimizer is not None:  # state the optimizer created lazily in this step, under its final category
            tracker._track_optimizer_states(tracker._ref_class.OPT, _inner_optimizer(self.optimizer))
        tracker.timeline_sample(("other", "after step"))
        self._tracker = None
        tracker.__exit__(None, None, None)
        src = f"measured ({self.device.type} storages)"
        tl = tracker.timeline(source=src, title=self.title, step=step)
        self.timelines.append(tl)
        return tl

    def mark(self, label: str = "mark", phase: str = "other") -> None:
        """Take a sample now, under ``label`` (between ops: e.g. right after the forward, before ``backward()``)."""
        if self._tracker is None:
            raise UsageError("MemoryTimelineRecorder.mark() outside a recorded step")
        self._tracker.timeline_sample((phase, label))

    def abort(self) -> None:
        """Stop recording without keeping the step (an exception inside the step)."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)

    @contextlib.contextmanager
    def step(self):
        self.begin()
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        self.end()


def peak_log_values(tl: MemoryTimeline, prefix: str = "memory/") -> dict[str, float]:
    """The step's peak and what is live there, in MiB, as training-log scalars
    (``memory/peak_MiB``, ``memory/peak_activations_MiB``, ...; ``memory/cuda_max_allocated_MiB`` on CUDA)."""
    mib = 1024.0**2
    out = {f"{prefix}peak_MiB": round(tl.peak / mib, 4)}
    out.update({f"{prefix}peak_{c}_MiB": round(v / mib, 4) for c, v in tl.at_peak.items() if v or c != "other"})
    if tl.allocated:
        out[f"{prefix}cuda_max_allocated_MiB"] = round(max(tl.allocated) / mib, 4)
    return out


def _is_fsdp2(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


def _inner_optimizer(opt: Any) -> Any:
    # accelerate's AcceleratedOptimizer wraps the torch optimizer (its ``state`` is the inner one's)
    import torch

    while opt is not None and not type(opt).__module__.startswith("torch.") and isinstance(
            getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


# ---------------------------------------------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------------------------------------------
def _event_x(tl: MemoryTimeline) -> tuple[list[float], list[dict[str, Any]]]:
    """Each event gets one unit of x (a few-op event a third of one), its samples spread evenly inside: layers
    line up across timelines.  Adds ``x0`` / ``x1`` to each event."""
    events = tl.events()
    xs: list[float] = []
    x0 = 0.0
    for ev in events:
        n = ev["last"] - ev["first"] + 1
        w = 1.0 if n > 3 else 0.35
        xs.extend(x0 + w * (j + 0.5) / n for j in range(n))
        ev["x0"], ev["x1"] = x0, x0 + w
        x0 += w
    return xs, events


def _aligned(other: MemoryTimeline, events: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """``other``'s samples placed on ``events``' x, event by event with the same label in the same micro-batch.
    Where ``other`` has fewer micro-batches (the planner traces at most a few: the later ones are all alike), its
    last micro-batch is drawn again on each later one; the optimizer step goes on the optimizer step.  Events
    without a match are left out (the line breaks there)."""
    if not other.micro_batches or not any("micro_batch" in e for e in events):
        return _aligned_from_end(other, events)
    last = other.micro_batch_count
    mine: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for ev in other.events():
        mine.setdefault((ev["label"], ev["micro_batch"]), []).append(ev)
    seen: dict[tuple[str, int], int] = {}
    xs, ys = [], []
    prev_x1 = None
    for target in events:
        mb = target.get("micro_batch", 0)
        n = seen.get((target["label"], mb), 0)
        seen[(target["label"], mb)] = n + 1
        candidates = mine.get((target["label"], min(mb, last)), [])
        if n >= len(candidates):
            continue
        ev = candidates[n]
        if prev_x1 is not None and abs(target["x0"] - prev_x1) > 1e-9:
            xs.append(float("nan"))  # not adjacent in this timeline: break the line
            ys.append(float("nan"))
        prev_x1 = target["x1"]
        k = ev["last"] - ev["first"] + 1
        w = target["x1"] - target["x0"]
        xs.extend(target["x0"] + w * (j + 0.5) / k for j in range(k))
        ys.extend(other.totals[ev["first"]:ev["last"] + 1])
    return xs, ys


def _aligned_from_end(other: MemoryTimeline, events: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """``other``'s samples placed on ``events``' x: each of its events on the event with the same label, matched
    from the end (so a one-micro-batch prediction lines up with the last micro-batch and the optimizer step of a
    step with gradient accumulation); events without a match are left out."""
    xs, ys = [], []
    oev = other.events()
    k = len(events) - 1
    placed = []
    for ev in reversed(oev):
        while k >= 0 and events[k]["label"] != ev["label"]:
            k -= 1
        if k < 0:
            break
        placed.append((ev, events[k]))
        k -= 1
    prev_x1 = None
    for ev, target in reversed(placed):
        if prev_x1 is not None and abs(target["x0"] - prev_x1) > 1e-9:
            xs.append(float("nan"))  # not adjacent in this timeline: break the line
            ys.append(float("nan"))
        prev_x1 = target["x1"]
        n = ev["last"] - ev["first"] + 1
        w = target["x1"] - target["x0"]
        xs.extend(target["x0"] + w * (j + 0.5) / n for j in range(n))
        ys.extend(other.totals[ev["first"]:ev["last"] + 1])
    return xs, ys


_SHORT = {"forward: embeddings": "emb", "forward: head + loss": "head\n+loss", "backward: loss + head": "loss\n+head",
          "backward: embeddings + grad reduction": "emb\n+reduce"}


def _short(label: str) -> str:
    return _SHORT.get(label) or label.replace("forward layer ", "F").replace("backward layer ", "B")


#: the GPU's size is drawn to scale when it is at most this many times the plotted data; above that the y axis
#: would squash the step into a flat line, so the size is written inside the axes instead
GPU_IN_SCALE = 4.0


def _with_gpu_in_scale(top: float, gpu_memory: float | None) -> float:
    """The y range's top: the data's, raised to the GPU's size when that is drawn as a line (so it is inside the axes)."""
    return max(top, gpu_memory) if gpu_memory and gpu_memory <= GPU_IN_SCALE * top else top


def draw_gpu_reference(axes: list, gpu_memory: float | None, top: float, div: float, unit: str, ymax: float) -> list:
    """The GPU's size on ``axes``: a dashed line inside the y range when it is in scale (``top`` includes it,
    :func:`_with_gpu_in_scale`), else one line of text inside the first axes saying how far above it is.
    Returns the legend handles."""
    if not gpu_memory:
        return []
    label = f"GPU {gpu_memory / div:.3g} {unit}"
    if gpu_memory <= top:
        line = None
        for a in axes:
            line = a.axhline(gpu_memory / div, color="r", ls="--", lw=1, label=label)
        return [line]
    # bottom left: the step's start (weights only, flat), where the peak's note and the phase bands never are
    size = next(f"{gpu_memory / d:.3g} {u}" for u, d in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))
                if gpu_memory >= d or d == 1)
    axes[0].text(0.01, 0.02, f"GPU {size}: above this scale ({gpu_memory / top:,.0f} x the highest value plotted)",
                 transform=axes[0].transAxes, ha="left", va="bottom", fontsize=8, color="r",
                 bbox=dict(boxstyle="round,pad=0.25", fc="white", ec="r", lw=0.8, alpha=0.9))
    return []


def plot_memory_timeline(tl: MemoryTimeline, path: str, *, estimate: dict[str, int] | None = None,
                         compare: MemoryTimeline | None = None, gpu_memory: float | None = None,
                         title: str | None = None, compare_label: str = "predicted (fake-tensor trace)") -> str:
    """Stacked categories over the step's events, the peak marked with what is live there, and (optional) the
    closed-form estimate as a stacked bar beside it (``estimate``: component -> bytes, e.g. ``Plan.components``),
    another timeline's total as a line (``compare``, e.g. the planner's trace beside a measured step) and the
    GPU's size.  Writes a PNG; returns ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting the memory timeline needs matplotlib: pip install matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not tl.totals:
        raise ValueError("plot_memory_timeline: the timeline has no samples")
    top = max([tl.peak] + ([sum(estimate.values())] if estimate else []) + ([compare.peak] if compare else [])
              + ([max(tl.allocated)] if tl.allocated else []))
    top = _with_gpu_in_scale(top, gpu_memory)
    unit, div = next((u, d) for u, d in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))
                     if top >= 2 * d or d == 1)
    xs, events = _event_x(tl)
    x_end = events[-1]["x1"]
    cats = [c for c in CATEGORIES if any(tl.series[c])]
    if estimate:
        fig, (ax, axb) = plt.subplots(1, 2, figsize=(11, 5), sharey=True,
                                      gridspec_kw={"width_ratios": [9, 1], "wspace": 0.03})
    else:
        fig, ax = plt.subplots(figsize=(10, 5))
        axb = None
    handles = ax.stackplot(xs, [[v / div for v in tl.series[c]] for c in cats], colors=[_COLORS[c] for c in cats],
                           labels=[c.replace("_", " ") for c in cats], lw=0)
    lines = []
    if tl.allocated:
        lines += ax.plot(xs, [v / div for v in tl.allocated], color="k", lw=0.8, ls=":",
                         label="cuda memory_allocated")
    if compare is not None:
        cx, cy = _aligned(compare, events)
        lines += ax.plot(cx, [v / div for v in cy], color="k", lw=1.2, label=compare_label)
    ymax = top / div * 1.42
    ax.set_ylim(0, ymax)
    ax.set_xlim(0, x_end)
    # phase bands along the top, layer / event ticks along the bottom
    band = {"forward": "#DCE9F5", "backward": "#F8E1CF", "optimizer": "#F5D0D0", "other": "#EEEEEE"}
    accumulating = tl.micro_batch_count > 1  # gradient accumulation: each band names its micro-batch
    k = 0
    while k < len(events):
        ph, mb = events[k]["phase"], events[k].get("micro_batch")
        j = k
        while j + 1 < len(events) and events[j + 1]["phase"] == ph and (
                ph == "optimizer" or events[j + 1].get("micro_batch") == mb):
            j += 1
        a, b = events[k]["x0"], events[j]["x1"]
        ax.axvspan(a, b, ymin=0.93, ymax=1.0, color=band[ph], lw=0)
        if ph != "other":
            name = ph if b - a >= x_end * 0.1 else {"forward": "fw", "backward": "bw", "optimizer": "opt."}[ph]
            if accumulating and ph != "optimizer" and mb:
                name = f"{name} {mb}"
            ax.text((a + b) / 2, ymax * 0.965, name, ha="center", va="center", fontsize=8)
            ax.axvline(a, color="#999999", lw=0.5)
            ax.axvline(b, color="#999999", lw=0.5)
        k = j + 1
    named = [e for e in events if re.search(r"layer \d+$", e["label"]) or e["label"] in _SHORT]
    n_layers = sum(1 for e in named if e["label"] not in _SHORT)
    stride = max(1, math.ceil(n_layers / 16))
    ticks, seen = [], 0
    for e in named:
        if e["label"] in _SHORT:
            if n_layers <= 16:
                ticks.append(e)
            continue
        if seen % stride == 0:
            ticks.append(e)
        seen += 1
    ax.set_xticks([(e["x0"] + e["x1"]) / 2 for e in ticks], [_short(e["label"]) for e in ticks], fontsize=7)
    xlabel = "the step's events (F3 / B3: forward / backward of decoder layer 3)"
    if accumulating:
        xlabel += (f"\ngradient accumulation: {tl.micro_batch_count} micro-batches (fw 2 / bw 2: the second), "
                   "the gradients live from the first backward on")
        ga = tl.meta.get("grad_accum")
        if ga and ga > tl.micro_batch_count:
            xlabel += f"; micro-batches {tl.micro_batch_count + 1}-{ga} repeat the last (not traced)"
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(unit)
    # the peak, and what is live there
    pi = tl.peak_index
    px, py = xs[pi], tl.peak / div
    live = sorted(((v, c) for c, v in tl.at_peak.items() if v), reverse=True)
    where = tl.peak_label + (f" (micro-batch {tl.peak_micro_batch})" if accumulating and tl.peak_micro_batch else "")
    text = f"peak {py:.3g} {unit}: {where}\n" + "\n".join(
        f"  {c.replace('_', ' ')} {v / div:.3g}" for v, c in live[:6])
    right = px > x_end * 0.55
    ax.annotate(text, (px, py), xytext=(px + (-0.04 if right else 0.04) * x_end, ymax * 0.9),
                fontsize=7.5, ha="right" if right else "left", va="top", multialignment="left",
                arrowprops=dict(arrowstyle="->", color="k", lw=0.8),
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#666666"))
    ax.plot([px], [py], marker="o", color="k", ms=4)
    lines += draw_gpu_reference([a for a in (ax, axb) if a is not None], gpu_memory, top, div, unit, ymax)
    extra = []
    if axb is not None:
        comps = [c for c in ("parameters", "master_weights", "gradients", "optimizer_state", "activations",
                             "temporaries", "comm_buffers", "other", "fragmentation") if estimate.get(c)]
        bottom = 0.0
        for c in comps:
            v = estimate[c] / div
            axb.bar(0, v, bottom=bottom, color=_COLORS.get(c, "#BBBBBB"), width=0.7,
                    hatch="//" if c in ("master_weights", "fragmentation") else None, edgecolor="white", lw=0.3)
            bottom += v
        axb.text(0, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=8)
        axb.set_xticks([0], ["closed\nform"], fontsize=8)
        axb.set_xlim(-0.6, 0.6)
        axb.tick_params(axis="y", left=False)
        from matplotlib.patches import Patch

        extra = [Patch(facecolor=_COLORS[c], hatch="//", edgecolor="white", label=c.replace("_", " "))
                 for c in comps if c in ("master_weights", "fragmentation")]
    items = list(handles) + extra + lines
    rows = 1 if len(items) <= 8 else 2
    fig.legend(handles=items, fontsize=7.5, loc="lower center", ncol=math.ceil(len(items) / rows), frameon=False)
    title = title or tl.title or f"memory over one training step ({tl.source})"
    ax.set_title(title, fontsize=10)
    # a title of several lines (the planner's second line: what the trace ran) moves the axes down to keep it whole
    fig.subplots_adjust(left=0.07, right=0.98, top=0.93 - 0.035 * title.count("\n"), bottom=(0.17 if rows == 1 else 0.2) + 0.03 * accumulating)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
