"""Training diagnostics that need only torch: the gradient noise scale (:mod:`.noise_scale`), the memory
timeline of a training step (:mod:`.memory_timeline`), the fast finiteness check of gradients (:mod:`.finite`) and
the counter of device-to-host syncs (:mod:`.host_syncs`).

>>> from hf_gradfix.diagnostics import NoiseScaleEstimator
>>> NoiseScaleEstimator(beta=0.9).update(small_sq=13.6, b_small=8, big_sq=1.79, b_big=128).b_simple > 0
True
"""

from .host_syncs import HostSyncCounter
from .memory_timeline import MemoryTimeline, MemoryTimelineRecorder, plot_memory_timeline
from .noise_scale import (
    NoiseScaleEstimate,
    NoiseScaleEstimator,
    NoiseScaleMonitor,
    plot_noise_scale,
    resolve_window,
    unbiased_estimates,
)

__all__ = [
    "HostSyncCounter",
    "MemoryTimeline",
    "MemoryTimelineRecorder",
    "plot_memory_timeline",
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "NoiseScaleMonitor",
    "plot_noise_scale",
    "resolve_window",
    "unbiased_estimates",
]
