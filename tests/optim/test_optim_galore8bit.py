"""GaLoreAdamW8bit (bitsandbytes blockwise 8-bit moments): parity with galore-torch's GaLoreAdamW8bit and with
bitsandbytes' AdamW8bit, state bytes equal to the analytic formula and to the planner, low-rank accumulation.

galore-torch 1.0's ``GaLoreAdamW8bit.step`` calls ``torch.cuda.synchronize()`` after every parameter (a no-op for
correctness); on a CPU-only torch that call raises, so the reference runs here with it replaced by a no-op
(``monkeypatch``, this test only).  Everything else in the reference is galore-torch's and bitsandbytes' own code.

Found on the way (galore-torch 1.0 with bitsandbytes >= 0.45, whose ``Optimizer2State`` dropped the
``percentile_clipping`` / ``block_wise`` arguments): galore-torch passes them positionally, so they land in
``max_unorm=100`` and ``skip_zeros=True``.  The blockwise 8-bit kernel ignores ``max_unorm``, but the 32-bit one (tensors
below ``min_8bit_size``: projected matrices whose R has < 4096 elements) scales the update to at most 100 x the
parameter norm, and galore-torch runs Adam on a zeroed buffer (norm 0): those matrices never move.  Parity is
therefore checked on every tensor that takes the 8-bit path; ours updates the small matrix (fp32 moments).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import optim_refs as R

bnb = pytest.importorskip("bitsandbytes")

from hf_gradfix.optim import GaLoreAdamW8bit, expected_state_bytes, state_bytes  # noqa: E402

TOL = 1e-6


class Net(nn.Module):
    """Projected: a (256, 64) and b (256, 256) (R = 256 x 16 = 4096: 8-bit), s (64, 32) (R < 4096: fp32 moments);
    plain: e (32, 256) (8192 elements: 8-bit) and every bias (fp32)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.e = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 32)
        self.s = nn.Linear(32, 64)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.s(torch.tanh(self.e(h)))


def _data(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)


def _grads(model, step):
    model.zero_grad(set_to_none=True)
    x, y = _data(step)
    ((model(x) - y) ** 2).mean().backward()


def _groups(m):
    return [{"params": [m.e.weight] + [l.bias for l in (m.a, m.b, m.e, m.s)]},
            {"params": [m.a.weight, m.b.weight, m.s.weight], "rank": 16, "update_proj_gap": 4, "scale": 0.5,
             "proj_type": "std"}]


@pytest.fixture
def galore8_ref(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return R.load_reference("galore_torch", "adamw8bit")


def test_parity_with_galore_torch_8bit(galore8_ref):
    torch.manual_seed(0)
    ma = Net()
    mb = copy.deepcopy(ma)
    init = R.snapshot(mb)
    ours = GaLoreAdamW8bit(_groups(ma), lr=1e-2, weight_decay=1e-2, eps=1e-8, compat="galore_torch",
                           proj_method="svd")
    ref = galore8_ref.AdamW8bit(_groups(mb), lr=1e-2, weight_decay=1e-2, eps=1e-8)
    for step in range(10):  # refreshes at 0, 4, 8
        _grads(ma, step)
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = pa.grad.clone()
        ours.step()
        ref.step()
    assert ours.state[ma.b.weight]["exp_avg"].dtype == torch.uint8
    assert ours.state[ma.s.weight]["exp_avg"].dtype == torch.float32  # R has 64 x 16 < 4096 elements
    assert ours.state[ma.e.weight]["exp_avg"].dtype == torch.uint8
    diffs = R.max_rel_change_diff(ma, mb, init)
    small = diffs.pop("s.weight")  # galore-torch's frozen small matrix (module docstring)
    assert max(diffs.values()) <= TOL, diffs
    assert min(float((p - init[n]).norm()) for n, p in mb.named_parameters() if n != "s.weight") > 1e-3
    assert float((ma.s.weight - init["s.weight"]).norm()) > 1e-2 and small > 1.0


def test_plain_parameters_equal_bitsandbytes_adamw8bit():
    torch.manual_seed(0)
    ma = Net()
    mb = copy.deepcopy(ma)
    ours = GaLoreAdamW8bit([{"params": list(ma.parameters()), "project": False}], lr=1e-2, weight_decay=0.1)
    ref = bnb.optim.AdamW8bit(mb.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        _grads(ma, step)
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = pa.grad.clone()
        ours.step()
        ref.step()
    for (n, a), b in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(a, b), n


def test_state_bytes_equal_the_formula_and_resume_weights_only():
    torch.manual_seed(0)
    m = Net()
    opt = GaLoreAdamW8bit(_groups(m), lr=1e-2, proj_method="svd")
    for step in range(3):
        _grads(m, step)
        opt.step()
    assert state_bytes(opt) == expected_state_bytes(opt)
    # the 8-bit state is ~1/4 of fp32 moments for the large tensors
    b = opt.state[m.b.weight]
    assert b["exp_avg"].numel() * 1 + b["absmax1"].numel() * 4 == 4096 + 16 * 4
    # resume: tensors only, weights_only=True, identical continuation
    twin = copy.deepcopy(m)
    opt2 = GaLoreAdamW8bit(_groups(twin), lr=1e-2, proj_method="svd")
    opt2.load_state_dict(R.roundtrip(opt.state_dict()))
    for step in range(3, 6):
        _grads(m, step)
        _grads(twin, step)
        opt.step()
        opt2.step()
    for (n, a), b in zip(m.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n


def test_lowrank_grads_8bit_equals_full_gradients():
    """8-bit GaLore with low-rank gradient accumulation (GA 4) vs the same optimizer with full gradients."""
    torch.manual_seed(0)
    ma = Net()
    mb = copy.deepcopy(ma)
    kw = dict(lr=1e-2, proj_method="svd", stagger=True)
    ours = GaLoreAdamW8bit(_groups(ma), lowrank_grads=True, **kw)
    ref = GaLoreAdamW8bit(_groups(mb), lowrank_grads=False, **kw)
    for step in range(6):
        for model in (ma, mb):
            for k in range(4):
                x, y = _data(100 * step + k)
                (((model(x) - y) ** 2).mean() / 4).backward()
        ours.step(), ref.step()
        ours.zero_grad(), ref.zero_grad()
    diffs = {n: float((a - b).norm() / b.norm()) for (n, a), b in zip(ma.named_parameters(), mb.parameters())}
    assert max(diffs.values()) <= TOL, diffs


def test_planner_counts_the_8bit_state_to_the_byte():
    from transformers import AutoModelForCausalLM

    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, load_model_config

    cfg = load_model_config("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = GaLoreAdamW8bit(model, lr=1e-3, rank=16, proj_method="svd")
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    p = estimate(cfg, ParallelDims(1), Settings(dtype="fp32", seq_len=16, micro_batch=2, optimizer="galore_adamw8bit",
                                               rank=16))
    assert state_bytes(opt) == expected_state_bytes(opt)
    assert p.components["optimizer_state"] == state_bytes(opt)
