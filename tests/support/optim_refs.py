"""Helpers for tests/optim/test_optim_unit.py: tiny models, deterministic data, comparison metrics, reference loaders.

Nothing here computes an expected optimizer result: references are ``torch.optim.AdamW``, galore-torch,
apollo-torch, or plain math written in the test itself.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import io
import sys
import types

import torch
from torch import nn

# --------------------------------------------------------------------------- reference packages


def load_reference(pkg: str, submodule: str):
    """Import ``pkg.submodule`` without running ``pkg/__init__.py``.

    galore-torch's and apollo-torch's ``__init__`` import their 8-bit optimizers, i.e. bitsandbytes (slow, prints a
    warning).  The package directory is mounted under a private alias (``_ref_<pkg>``), so relative imports inside
    the reference work and the real ``pkg`` name stays untouched for other tests.
    """
    alias = f"_ref_{pkg}"
    if alias not in sys.modules:
        spec = importlib.util.find_spec(pkg)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(pkg)
        stub = types.ModuleType(alias)
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules[alias] = stub
    return importlib.import_module(f"{alias}.{submodule}")


# --------------------------------------------------------------------------- models and data


class MLP(nn.Module):
    """Weights: ``a`` tall (24, 12), ``b`` square (24, 24), ``c`` wide (8, 24); every layer has a bias."""

    def __init__(self, d_in: int = 12, hidden: int = 24, d_out: int = 8):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.c = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_mlp(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


def batch(step: int, d_in: int = 12, d_out: int = 8, n: int = 16, seed: int = 1234):
    """The data of optimizer step ``step`` (a pure function of the step: resumed runs see the same data)."""
    g = torch.Generator().manual_seed(seed + 7919 * step)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    return x, y


def compute_grads(model: nn.Module, step: int) -> None:
    for p in model.parameters():
        p.grad = None
    x, y = batch(step, model.a.in_features, model.c.out_features)
    ((model(x) - y) ** 2).mean().backward()


def copy_grads(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` exactly ``src``'s gradients (so two optimizers see identical gradients)."""
    for (n1, p), (n2, q) in zip(src.named_parameters(), dst.named_parameters()):
        assert n1 == n2
        q.grad = None if p.grad is None else p.grad.detach().clone()


def train(model: nn.Module, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        compute_grads(model, step)
        opt.step()


def train_pair(model_a, opt_a, model_b, opt_b, steps: int, callback=None) -> None:
    """Step both optimizers with ``model_a``'s gradients."""
    for step in range(steps):
        compute_grads(model_a, step)
        copy_grads(model_a, model_b)
        opt_a.step()
        opt_b.step()
        if callback is not None:
            callback(step)


def twins(seed: int = 0, **kw):
    a = make_mlp(seed, **kw)
    return a, copy.deepcopy(a)


# --------------------------------------------------------------------------- metrics


def rel_change_diff(a: torch.Tensor, b: torch.Tensor, b0: torch.Tensor) -> float:
    """``||a - b|| / ||b - b0||``: the difference of two trajectories relative to how far ``b`` moved.

    Stricter than relative to ``||b||`` (the weights move little in a short run, so a difference relative to the
    weights themselves would hide real bugs).
    """
    a, b, b0 = a.double(), b.double(), b0.double()
    return float((a - b).norm() / (b - b0).norm().clamp_min(1e-30))


def max_rel_change_diff(model_a, model_b, init: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        n: rel_change_diff(pa.detach(), pb.detach(), init[n])
        for (n, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters())
    }


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def roundtrip(state_dict: dict) -> dict:
    """``torch.save`` -> ``torch.load(weights_only=True)``, as Trainer's resume does."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class StateView:
    """An object with a ``state`` mapping, for measuring arbitrary tensors with ``hf_gradfix.optim.state_bytes``."""

    def __init__(self, state: dict):
        self.state = state
        self.param_groups: list = []
