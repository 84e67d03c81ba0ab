"""APOLLO's random projection drawn on the parameter's device (issue 53 item 2).

Before issue 53 the Gaussian projection was drawn on the CPU every step and copied to the parameter's device (623 ms
per step on an H100 for two 7B-shaped layers, 33x AdamW).  Now it is drawn with a generator on the parameter's
device, seeded from the stored ``proj_seed``.  What is checked here, on CPU:

* the update equals the one of a frozen copy of the pre-issue-53 draw (``_projection_before_53`` below, copied from
  ``hf_gradfix/optim/apollo.py`` and ``projection.gaussian_projection`` as they were), bit for bit, across refreshes,
  for the channel-wise and the tensor-wise (APOLLO-Mini) scale; control: the same reference drawing from a shifted
  seed differs;
* resume: k steps, ``state_dict`` through ``torch.save`` / ``torch.load(weights_only=True)``, a fresh optimizer on a
  copy of the model, n more steps, is bit-identical to k + n uninterrupted steps; control: the same resume with the
  generator's seed (``proj_seed``) dropped from the loaded state differs;
* the draw asks for the parameter's device (the random numbers are generated there, no host-to-device copy).

On a CUDA machine one more test checks the draw on the GPU: the same seed gives the same matrix, and it is made on
the GPU.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from hf_gradfix.optim import ApolloAdamW, apollo_mini
from hf_gradfix.optim import projection as P


# ----------------------------------------------------------------------------- the frozen pre-issue-53 draw
def _gaussian_projection_before_53(d, rank, seed, dtype=torch.float32, device=None, transposed=False):
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    shape = (rank, d) if transposed else (d, rank)
    p = torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(rank)
    p = p.T if transposed else p
    return p.to(device=device, dtype=dtype)


def _projection_before_53(self, state, side, shape, rank, device, dtype):
    seed = int(state["proj_seed"])
    m, n = shape
    if side == P.LEFT:
        return _gaussian_projection_before_53(m, rank, seed, dtype=dtype, device=device)
    return _gaussian_projection_before_53(n, rank, seed, dtype=dtype, device=device, transposed=True)


class _Before53(ApolloAdamW):
    """ApolloAdamW with the projection drawn as before issue 53 (everything else is the code under test)."""

    _seed_shift = 0

    def _projection(self, state, side, shape, rank, device, dtype):
        if self._seed_shift:
            state = {**state, "proj_seed": torch.tensor(int(state["proj_seed"]) + self._seed_shift)}
        return _projection_before_53(self, state, side, shape, rank, device, dtype)


class _Shifted(_Before53):
    _seed_shift = 1


# ----------------------------------------------------------------------------- a tiny model and its batches
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # a tall, a wide and a square matrix; biases go to plain AdamW
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 8), nn.Tanh(), nn.Linear(8, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 12, generator=g), torch.randn(6, 8, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        x, y = _batch(s)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()


def _make(cls, model, mini: bool):
    kw = dict(lr=1e-2, update_proj_gap=5, weight_decay=0.1, targets=["0", "2", "4"])
    if mini:
        kw.update(rank=1, scale_type="tensor", scale=128.0)
    else:
        kw.update(rank=3, scale_type="channel", scale=2.0)
    return cls(model, **kw)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("mini", [False, True], ids=["channel", "mini"])
def test_device_draw_equals_the_pre_53_update_on_cpu(mini):
    base = _model()
    runs = {}
    for name, cls in (("new", ApolloAdamW), ("before", _Before53), ("control", _Shifted)):
        model = copy.deepcopy(base)
        opt = _make(cls, model, mini)
        _train(model, opt, range(17))  # refreshes at steps 0, 5, 10, 15
        runs[name] = _params(model)
    assert all(torch.equal(a, b) for a, b in zip(runs["new"], runs["before"])), _max_diff(runs["new"], runs["before"])
    # control: a different projection (the next seed) moves the weights differently, far above fp32 rounding
    assert _max_diff(runs["control"], runs["before"]) > 1e-4


def _resume_run(mini: bool, k: int, n: int, drop_seed: bool) -> list[torch.Tensor]:
    model = _model()
    opt = _make(ApolloAdamW, model, mini)
    _train(model, opt, range(k))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    if drop_seed:  # control: the generator's seed is not restored
        for entry in saved["opt"]["state"].values():
            entry.pop("proj_seed", None)
    fresh = _model(seed=123)  # other weights: everything must come from the checkpoint
    fresh.load_state_dict(saved["model"])
    opt2 = _make(ApolloAdamW, fresh, mini)
    opt2.load_state_dict(saved["opt"])
    _train(fresh, opt2, range(k, k + n))
    return _params(fresh)


@pytest.mark.parametrize("mini", [False, True], ids=["channel", "mini"])
def test_resume_is_bit_identical(mini):
    k, n = 7, 9  # k after the refresh at step 5; the continuation refreshes at 10 and 15
    model = _model()
    opt = _make(ApolloAdamW, model, mini)
    _train(model, opt, range(k + n))
    straight = _params(model)
    resumed = _resume_run(mini, k, n, drop_seed=False)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed)), _max_diff(straight, resumed)
    control = _resume_run(mini, k, n, drop_seed=True)
    assert _max_diff(straight, control) > 1e-4


def test_draw_happens_on_the_requested_device(monkeypatch):
    """The random numbers are generated with a generator of the parameter's device and on that device."""
    seen = []
    real = torch.randn

    def spy(*args, **kwargs):
        gen = kwargs.get("generator")
        seen.append((str(kwargs.get("device")), None if gen is None else str(gen.device)))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "randn", spy)
    out = P.gaussian_projection(10, 3, seed=5, device=torch.device("cpu"))
    assert seen == [("cpu", "cpu")], seen
    ref = _gaussian_projection_before_53(10, 3, 5)
    assert torch.equal(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draw_on_cuda():  # pragma: no cover - GPU only
    a = P.gaussian_projection(4096, 64, seed=7, device="cuda", transposed=True)
    b = P.gaussian_projection(4096, 64, seed=7, device="cuda", transposed=True)
    assert a.device.type == "cuda" and torch.equal(a, b)
    assert abs(a.float().std().item() - 1 / math.sqrt(64)) < 0.01
    model = _model().cuda()
    opt = apollo_mini(model, lr=1e-2, targets=["0", "2", "4"])
    x, y = (t.cuda() for t in _batch(0))
    (model(x) - y).square().mean().backward()
    opt.step()
    opt2 = apollo_mini(model, lr=1e-2, targets=["0", "2", "4"])
    opt2.load_state_dict(opt.state_dict())
    # int(state["proj_seed"]) runs every step: a seed moved to the GPU by torch's load would sync the stream each time
    assert all(st[k].device.type == "cpu" for st in opt2.state.values() for k in ("proj_seed", "side") if k in st)


@pytest.mark.parametrize("same", [True, False], ids=["one_gpu_model", "mixed_gpu_models"])
def test_ranks_on_different_gpu_models_draw_on_the_host(monkeypatch, same):
    """A seeded CUDA draw depends on the GPU model (Philox's grid follows the SM count): when the ranks' device
    models differ, the projection is drawn on the host (one matrix everywhere) with one warning; else on the device."""
    import warnings

    from hf_gradfix.optim import apollo as A

    opt = _make(ApolloAdamW, _model(), False)
    monkeypatch.setattr(A, "_world", lambda: 2)
    monkeypatch.setattr(A, "_device_model", lambda dev: ("cuda", "H100", 132))
    other = ("cuda", "H100", 132) if same else ("cuda", "A100", 108)

    def gather(out, obj):
        out[:] = [obj, other]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = opt._draw_device(torch.device("cuda", 0))
        again = opt._draw_device(torch.device("cuda", 0))
    assert first == again
    assert first.type == ("cuda" if same else "cpu")
    assert len([w for w in caught if "different cuda models" in str(w.message)]) == (0 if same else 1)
    assert opt._draw_device(torch.device("cpu")).type == "cpu"
