"""The mode the plugin's probes run a model in, and every module's own mode put back after.

The probes (the loss probe, the packing guard, the state probe of hybrid layers, the pipeline plan check) run a few
forwards before or between training steps and compare them exactly, so they switch dropout and router jitter off
with eval mode. Two things eval mode must not do to a model that is about to train:

- change its weights: bitsandbytes' 4-bit layers repack their weights in place into an inference-only layout on the
  first eval-mode forward without gradients on a CPU with AVX512-BF16 (bitsandbytes 0.50), after which QLoRA
  training fails (measured: an assertion on some shapes, an in-place error on a leaf view on others; stock fails the
  same way after one such forward). A module that holds non-floating-point (quantized) parameters keeps its own
  mode during a probe: decided by what it holds, and it has no dropout of its own to switch off;
- leave modes changed: a submodule the user keeps in eval mode (a frozen tower) stays in eval mode after a probe.
  Every module's flag is put back as it was, not the whole model's.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
>>> model[0].eval()  # the user's choice for one submodule
Linear(in_features=2, out_features=2, bias=True)
>>> with probe_mode(model):
...     [m.training for m in model]
[False, False]
>>> [m.training for m in model]
[False, True]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["probe_mode"]


def _holds_quantized_weights(module: torch.nn.Module) -> bool:
    return any(not p.is_floating_point() for p in module.parameters(recurse=False))


@contextlib.contextmanager
def probe_mode(module: torch.nn.Module, training: bool = False) -> Iterator[torch.nn.Module]:
    """``module`` in eval mode (``training=False``) or train mode for a probe, except modules holding quantized
    parameters, which keep their mode in eval; every module's own flag is restored on exit."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    if not training:
        for m, was in flags:
            if was and _holds_quantized_weights(m):
                m.training = True
    try:
        yield module
    finally:
        for m, was in flags:
            m.training = was
