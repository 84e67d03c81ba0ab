"""Training diagnostics that need only torch: the gradient noise scale (:mod:`.noise_scale`).

>>> from hf_gradfix.diagnostics import NoiseScaleEstimator
>>> NoiseScaleEstimator(beta=0.9).update(small_sq=13.6, b_small=8, big_sq=1.79, b_big=128).b_simple > 0
True
"""

from .noise_scale import (
    NoiseScaleEstimate,
    NoiseScaleEstimator,
    NoiseScaleMonitor,
    plot_noise_scale,
    resolve_window,
    unbiased_estimates,
)

__all__ = [
    "NoiseScaleEstimate",
    "NoiseScaleEstimator",
    "NoiseScaleMonitor",
    "plot_noise_scale",
    "resolve_window",
    "unbiased_estimates",
]
