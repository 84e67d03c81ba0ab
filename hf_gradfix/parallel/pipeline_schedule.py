"""Pipeline schedules in numbers (used by the planner, ``config check`` and the run time): which stage holds what, how many micro-batches a schedule keeps in
flight, and how much of the step is bubble.  Pure arithmetic (no torch).

Split rule (what the stages are built with): the ``L`` decoder layers are cut into ``n = pp x v`` consecutive
chunks as evenly as possible (the first ``L mod n`` chunks take one layer more, ``torch.tensor_split``'s
rule); chunk ``c`` runs on stage ``c mod pp`` (Megatron's interleaved assignment; ``v = 1``: chunk = stage).
The input embeddings go with chunk 0 (the first stage), the final norm and the output head with the last chunk
(the last stage); tied input/output embeddings are held on both.

Micro-batches in flight on stage ``s`` (each holds its saved activations until its backward), with ``m`` the
schedule's micro-batches (the accumulation window's) and ``p`` stages:

* GPipe: all ``m`` forwards run before any backward: ``m``.
* 1F1B: ``min(m, p - s)`` (``p`` on the first stage): torch's ``Schedule1F1B`` warms up with
  ``min(m, p - s)`` forwards (``torch/distributed/pipelining/schedules.py``), Megatron-LM's
  ``forward_backward_pipelining_without_interleaving`` with ``p - s - 1`` and one more in steady state.
* Interleaved 1F1B (``v`` chunks per stage): warm-up forwards ``w_s = (v - 1) r + 2 (p - 1 - s)`` chunk
  passes, capped at ``m v``, with ``r = m // max(1, m // p)`` micro-batches per round (torch's
  ``_get_warmup_ops``; ``r = p`` when ``p`` divides ``m``, Megatron-LM's ``get_num_warmup_microbatches``),
  plus the steady state's one: ``min(w_s + 1, m v)`` chunk activations, i.e. ``/ v`` stage-micro-batches.
  On the first stage that is ``p (1 + (p - 1) / (p v))``: Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", Sec. 4.2.3, and Megatron-LM's
  ``interleaved_schedule_memory_penalty`` (``megatron/training/theoretical_memory_usage.py``).
* Zero bubble (torch's ``ScheduleInterleavedZeroBubble``, ZB-H1 / ZB1P of Qi et al. 2024, "Zero Bubble
  Pipeline Parallelism"): the backward is split into input gradients (I) and weight gradients (W) that fill
  the bubble; a micro-batch's activations stay until its W (the weight gradients need the layer inputs).
  torch warms up with ``(v - 1) r + (p - 1 - s)`` forwards (``_get_warmup_ops`` with factor 1) and the
  deferred W keep every stage at the first stage's level: ``min((v - 1) r + p, m v)`` chunk activations on
  every stage (``min(m, p)`` micro-batches for ``v = 1``: the paper's H1 bound, 1F1B's first stage), found by
  replaying torch's own op order (tests/plan/test_plan_pipeline.py).

Bubble fraction (idle time / step time, equal forward and backward times per stage, Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 2.2: bubble time
``(p - 1)`` forward+backward slots, ``/ v`` when interleaved, against ``m`` slots of work):

* GPipe, 1F1B: ``(p - 1) / (m + p - 1)``;
* interleaved 1F1B: ``(p - 1) / (v m + p - 1)``; with fewer micro-batches than stages (``m < p``) each round
  leaves ``(p - m) (v - 1)`` more chunk slots idle: ``e / (v m + e)``, ``e = p - 1 + (p - m)(v - 1)`` (not in
  the paper, which assumes ``m >= p``; it is what torch's op order gives, replayed in the tests);
* zero bubble (ZB-H1, with ``T_F = T_B = T_W``, i.e. a forward, an input-gradient and a weight-gradient pass of
  equal length): the bubble shrinks to ``(p - 1) (T_F + T_B - T_W)`` = a third of 1F1B's (Qi et al. 2024,
  Sec. 3.1): ``(p - 1) / (3 v m + p - 1)``, for ``m >= p`` (below that the planner refuses it).

The tests replay GPipe and 1F1B op orders written there, and torch's own ``ScheduleInterleaved1F1B`` /
``ScheduleInterleavedZeroBubble`` op orders, on a time-slot simulation: the bubble and the peak chunk
activations per stage equal these formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "PipelineSpec", "chunk_layer_counts", "stage_chunks", "stage_layers", "in_flight",
           "bubble_fraction", "check_pipeline"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline degree ``pp``, schedule, virtual stages per rank ``v`` and micro-batches ``m`` per step."""

    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1

    @property
    def chunks(self) -> int:
        return self.pp * self.virtual_stages


def chunk_layer_counts(n_layers: int, n_chunks: int) -> list[int]:
    """Layers per model chunk: as even as possible, the first ``n_layers % n_chunks`` chunks one more.

    >>> chunk_layer_counts(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(n_layers, n_chunks)
    return [base + (1 if c < extra else 0) for c in range(n_chunks)]


def stage_chunks(stage: int, pp: int, virtual_stages: int) -> list[int]:
    """The model chunks stage ``stage`` runs: ``stage, stage + pp, stage + 2 pp, ...``.

    >>> stage_chunks(1, 4, 2)
    [1, 5]
    """
    return [stage + k * pp for k in range(virtual_stages)]


def stage_layers(n_layers: int, stage: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Global indices of the decoder layers on ``stage`` (consecutive within each of its chunks).

    >>> stage_layers(10, 0, 2, 2), stage_layers(10, 1, 2, 2)
    ([0, 1, 2, 6, 7], [3, 4, 5, 8, 9])
    """
    counts = chunk_layer_counts(n_layers, pp * virtual_stages)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [i for c in stage_chunks(stage, pp, virtual_stages) for i in range(starts[c], starts[c] + counts[c])]


def _rounds_size(m: int, pp: int) -> int:
    """torch's ``microbatches_per_round`` for the interleaved schedules: ``m // max(1, m // pp)``."""
    return m // max(1, m // pp)


def in_flight(spec: PipelineSpec, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of one micro-batch through
    all of the stage's layers (an interleaved stage's chunk counts ``1 / v``).  See the module docstring.

    >>> [in_flight(PipelineSpec(4, "1f1b", 1, 8), s) for s in range(4)], in_flight(PipelineSpec(4, "gpipe", 1, 8), 3)
    ([4, 3, 2, 1], 8)
    >>> in_flight(PipelineSpec(4, "interleaved_1f1b", 2, 8), 0) == 4 * (1 + 3 / (4 * 2))
    True
    """
    p, v, m = spec.pp, spec.virtual_stages, spec.microbatches
    if spec.schedule == "gpipe":
        return m
    if spec.schedule == "zero_bubble":
        return min((v - 1) * _rounds_size(m, p) + p, m * v) / v
    if v == 1:
        return min(m, p - stage)
    warmup = min((v - 1) * _rounds_size(m, p) + 2 * (p - 1 - stage), m * v)
    return min(warmup + 1, m * v) / v


def bubble_fraction(spec: PipelineSpec) -> float:
    """Idle share of a step (see the module docstring for the formulas and their sources).

    >>> bubble_fraction(PipelineSpec(4, "1f1b", 1, 8)) == 3 / 11
    True
    >>> bubble_fraction(PipelineSpec(4, "interleaved_1f1b", 2, 8)) == 3 / 19
    True
    """
    p, v, m = spec.pp, spec.virtual_stages, spec.microbatches
    if p == 1:
        return 0.0
    if spec.schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if spec.schedule == "interleaved_1f1b":
        idle = p - 1 + max(0, p - m) * (v - 1)
        return idle / (v * m + idle)
    return (p - 1) / (3 * v * m + p - 1)  # zero bubble (ZB-H1, T_F = T_B = T_W)


def check_pipeline(spec: PipelineSpec, *, world_size: int, n_layers: int, raise_as=ValueError) -> None:
    """Refuse a pipeline the stages cannot be built for, with one line naming the key, the value and the fix."""
    p, v, m = spec.pp, spec.virtual_stages, spec.microbatches
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise raise_as(f"--pp {p!r}: invalid value; it must be a whole number >= 1")
    if spec.schedule not in SCHEDULES:
        raise raise_as(f"--pp-schedule {spec.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise raise_as(f"--pp-virtual-stages {v!r}: invalid value; it must be a whole number >= 1")
    if world_size % p:
        raise raise_as(f"--pp {p}: does not divide the world size {world_size}; use a divisor of {world_size} "
                       f"(the other degrees share world / pp ranks)")
    if v > 1 and spec.schedule in ("gpipe", "1f1b"):
        raise raise_as(f"--pp-virtual-stages {v} with --pp-schedule {spec.schedule}: virtual stages need "
                       f"interleaved_1f1b or zero_bubble; use one of them or --pp-virtual-stages 1")
    if p > 1 and n_layers < p * v:
        raise raise_as(f"--pp {p} x --pp-virtual-stages {v} = {p * v} model chunks, but the model has {n_layers} "
                       f"decoder layers; every chunk needs at least one layer: lower pp or the virtual stages")
    if p > 1 and spec.schedule == "zero_bubble" and m < p:
        raise raise_as(f"--grad-accum {m} with --pp-schedule zero_bubble and --pp {p}: the zero-bubble schedule "
                       f"needs at least as many micro-batches as stages to fill its bubble (the planner's formula "
                       f"holds for m >= p); raise --grad-accum to {p} or use 1f1b")
    if p > 1 and spec.schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // p):
        rounds = max(1, m // p)
        raise raise_as(f"--grad-accum {m}: the interleaved schedules run the micro-batches in rounds of "
                       f"{m // rounds} ({rounds} rounds) and need m divisible by the rounds; use a multiple of "
                       f"--pp {p}")
