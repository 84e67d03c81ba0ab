"""Unit tests of hf_gradfix.optim (GaLoreAdamW, ApolloAdamW, apollo_mini and their helpers).

Every correctness claim is checked against an independent reference: ``torch.optim.AdamW``, galore-torch 1.0,
apollo-torch 1.0.3, or plain math written out here (an SVD of the gradient computed in the test, an EMA of the
gradients).  No expected number is taken from the code under test.  Several tests carry a *negative control*: the
same comparison with a deliberately different setting must fail the tolerance, so the tolerance is shown to catch a
real difference.

Trajectories are compared with ``||a - b|| / ||b - b0||`` (the difference relative to how far the reference weight
moved; see ``optim_refs.rel_change_diff``), which is much stricter than relative to the weights themselves.

What holds and what does not (see /work/shared/research/galore.md, section 7): a full-rank *SVD* basis is not AdamW
(Adam is not rotation-invariant), so no such equivalence is tested; the identity basis is AdamW; with a full-rank
orthogonal basis and ``on_switch="reproject"`` the back-projected first moment is the EMA of the gradients; the first
GaLore step is ``-lr * scale * P (R / (|R| + eps))`` in the basis of the top singular vectors, whatever their signs.
"""

from __future__ import annotations

import copy
import warnings

import re

import pytest
import torch
from torch import nn

import optim_refs as R
from hf_gradfix.optim import (
    ApolloAdamW,
    GaLoreAdamW,
    OptimizerConfigError,
    apollo_mini,
    expected_state_bytes,
    low_rank_param_groups,
    state_bytes,
)
from hf_gradfix.optim import projection as P

TOL = 1e-6


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.fixture(scope="module")
def galore_ref():
    try:
        return R.load_reference("galore_torch", "adamw")
    except ImportError:  # pragma: no cover - the reference is a test dependency
        pytest.skip("galore-torch is not installed")


@pytest.fixture(scope="module")
def apollo_ref():
    try:
        return R.load_reference("apollo_torch", "apollo")
    except ImportError:  # pragma: no cover
        pytest.skip("apollo-torch is not installed")


def _weights(m):
    return [m.a.weight, m.b.weight, m.c.weight]


def _biases(m):
    return [m.a.bias, m.b.bias, m.c.bias]


def _worst(diffs: dict[str, float]) -> float:
    return max(diffs.values())


# =========================================================================== 1. identity projection == AdamW


def _identity_groups(m, side):
    dim = 1 if side == "auto" else 0  # auto reduces the in-features, left the out-features
    return [{"params": [w], "rank": w.shape[dim], "project": True} for w in _weights(m)] + [
        {"params": _biases(m), "project": False}
    ]


@pytest.mark.parametrize("side", ["auto", "left"])
def test_identity_projection_equals_torch_adamw(side):
    ma, mb = R.twins(0)
    init = R.snapshot(mb)
    ours = GaLoreAdamW(_identity_groups(ma, side), lr=1e-2, weight_decay=0.1, proj_method="identity", scale=1.0,
                       proj_side=side, update_proj_gap=5)
    ref = torch.optim.AdamW(mb.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    R.train_pair(ma, ours, mb, ref, 20)
    assert all(ours.is_projected(w) for w in _weights(ma))
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert _worst(diffs) <= TOL, diffs
    # the weights did move (a relative difference of a frozen run would prove nothing)
    assert all((p - init[n]).norm() > 1e-2 for n, p in mb.named_parameters())


def test_identity_negative_control_catches_arithmetic_difference():
    """galore-torch arithmetic (decay after the update, eps outside the bias correction) must fail the tolerance."""
    ma, mb = R.twins(0)
    init = R.snapshot(mb)
    ours = GaLoreAdamW(_identity_groups(ma, "auto"), lr=1e-2, weight_decay=0.1, proj_method="identity", scale=1.0,
                       compat="galore_torch")
    ref = torch.optim.AdamW(mb.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    R.train_pair(ma, ours, mb, ref, 20)
    assert _worst(R.max_rel_change_diff(ma, mb, init)) > 100 * TOL


# =========================================================================== 2. parity with galore-torch


def _galore_pair(galore_ref, *, gap_ours=20, **ours_kw):
    ma, mb = R.twins(0)
    init = R.snapshot(mb)
    kw = dict(lr=1e-2, weight_decay=0.1, eps=1e-6, rank=4, update_proj_gap=gap_ours, scale=0.5)
    ours = GaLoreAdamW([{"params": _biases(ma), "project": False}, {"params": _weights(ma), "project": True}],
                       compat="galore_torch", proj_side="std", proj_method="svd", on_switch="keep", **{**kw, **ours_kw})
    ref = galore_ref.AdamW(
        [{"params": _biases(mb)},
         {"params": _weights(mb), "rank": 4, "update_proj_gap": 20, "scale": 0.5, "proj_type": "std"}],
        lr=1e-2, weight_decay=0.1, eps=1e-6, no_deprecation_warning=True,
    )
    return ma, ours, mb, ref, init


def test_galore_torch_parity(galore_ref):
    ma, ours, mb, ref, init = _galore_pair(galore_ref)
    bases = {}

    def watch(step):
        bases[step] = ours.state[ma.a.weight]["proj"].clone()

    R.train_pair(ma, ours, mb, ref, 50, callback=watch)
    # refreshes at optimizer steps 0, 20 and 40 (galore-torch: iter % gap == 0 before the increment)
    changed = [s for s in range(1, 50) if not torch.equal(bases[s], bases[s - 1])]
    assert changed == [20, 40]
    # our shapes follow galore-torch's std rule: tall and square reduce the in-features, wide the out-features
    assert tuple(ours.state[ma.a.weight]["exp_avg"].shape) == (24, 4)
    assert tuple(ours.state[ma.b.weight]["exp_avg"].shape) == (24, 4)
    assert tuple(ours.state[ma.c.weight]["exp_avg"].shape) == (4, 24)
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert _worst(diffs) <= TOL, diffs


def test_galore_torch_parity_negative_control(galore_ref):
    """Without the refreshes at 20 and 40 the trajectories must differ far beyond the tolerance."""
    ma, ours, mb, ref, init = _galore_pair(galore_ref, gap_ours=1000)
    R.train_pair(ma, ours, mb, ref, 50)
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert max(diffs[n] for n in ("a.weight", "b.weight", "c.weight")) > 1e3 * TOL


# =========================================================================== 3. parity with apollo-torch


def _apollo_pair(apollo_ref, mini: bool, seed: int = 0):
    ma, mb = R.twins(0)
    init = R.snapshot(mb)
    groups = [{"params": _biases(ma), "project": False}, {"params": _weights(ma), "project": True}]
    common = dict(lr=1e-2, weight_decay=0.1, eps=1e-6, update_proj_gap=10, compat="apollo_torch", proj_side="std",
                  seed=seed)
    if mini:
        ours = apollo_mini(groups, **common)
        ref_group = {"rank": 1, "scale_type": "tensor", "scale": 128.0}
    else:
        ours = ApolloAdamW(groups, rank=4, scale=2.0, scale_type="channel", **common)
        ref_group = {"rank": 4, "scale_type": "channel", "scale": 2.0}
    # same group structure and order: the projection seeds are the 1-based parameter index over all groups
    ref = apollo_ref.AdamW(
        [{"params": _biases(mb)},
         {"params": _weights(mb), "proj": "random", "update_proj_gap": 10, "proj_type": "std", **ref_group}],
        lr=1e-2, weight_decay=0.1, eps=1e-6,
    )
    return ma, ours, mb, ref, init


@pytest.mark.parametrize("mini", [False, True], ids=["apollo", "apollo_mini"])
def test_apollo_torch_parity(apollo_ref, mini):
    ma, ours, mb, ref, init = _apollo_pair(apollo_ref, mini)
    seeds = {}

    def watch(step):
        seeds[step] = int(ours.state[ma.a.weight]["proj_seed"])

    R.train_pair(ma, ours, mb, ref, 30, callback=watch)
    assert seeds[0] == 4  # a.weight is the 4th parameter (3 biases first), apollo-torch's params_idx
    changed = [s for s in range(1, 30) if seeds[s] != seeds[s - 1]]
    assert changed == [10, 20]
    rank = 1 if mini else 4
    assert tuple(ours.state[ma.c.weight]["exp_avg"].shape) == (rank, 24)  # wide: left side under std
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert _worst(diffs) <= TOL, diffs


def test_apollo_torch_parity_negative_control(apollo_ref):
    """Another projection seed must fail the tolerance (the parity is not insensitive to the projection)."""
    ma, ours, mb, ref, init = _apollo_pair(apollo_ref, mini=False, seed=1)
    R.train_pair(ma, ours, mb, ref, 30)
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert max(diffs[n] for n in ("a.weight", "b.weight", "c.weight")) > 1e3 * TOL


# =========================================================================== 4. resume


RESUME_GAP, RESUME_STEPS = 4, 14

RESUME_CASES = [
    ("galore", dict(proj_method="svd", on_switch="keep")),
    ("galore", dict(proj_method="svd", on_switch="reproject")),
    ("galore", dict(proj_method="svd", on_switch="reset")),
    ("galore", dict(proj_method="randomized", on_switch="keep")),
    ("galore", dict(proj_method="randomized", on_switch="reproject")),
    ("galore", dict(proj_method="randomized", on_switch="reset")),
    ("apollo", dict()),
    ("apollo_mini", dict()),
]


def _make_opt(kind, model, **kw):
    common = dict(lr=1e-2, weight_decay=0.1, update_proj_gap=RESUME_GAP, targets=["a", "b", "c"])
    if kind == "galore":
        return GaLoreAdamW(model, rank=4, **common, **kw)
    if kind == "apollo":
        return ApolloAdamW(model, rank=4, **common, **kw)
    return apollo_mini(model, **common, **kw)


def _state_only_tensors(opt):
    for st in opt.state.values():
        for key, value in st.items():
            assert isinstance(value, torch.Tensor), (key, type(value))


@pytest.mark.parametrize("kind,kw", RESUME_CASES, ids=[f"{k}-{'-'.join(v.values())}" for k, v in RESUME_CASES])
@pytest.mark.parametrize("stop", [RESUME_GAP, RESUME_GAP + 1, RESUME_GAP + RESUME_GAP // 2],
                         ids=["before_refresh", "after_refresh", "mid_gap"])
def test_resume_continues_identically(kind, kw, stop):
    model0 = R.make_mlp(0)
    full = copy.deepcopy(model0)
    opt_full = _make_opt(kind, full, **kw)
    R.train(full, opt_full, 0, RESUME_STEPS)

    first = copy.deepcopy(model0)
    opt_first = _make_opt(kind, first, **kw)
    R.train(first, opt_first, 0, stop)
    _state_only_tensors(opt_first)
    opt_sd, model_sd = R.roundtrip(opt_first.state_dict()), R.roundtrip(first.state_dict())

    resumed = copy.deepcopy(model0)
    resumed.load_state_dict(model_sd)
    opt_resumed = _make_opt(kind, resumed, **kw)
    opt_resumed.load_state_dict(opt_sd)
    for p, q in zip(_weights(resumed), _weights(first)):  # saved dtypes and values, bit for bit (an int64 seed
        for key, value in opt_first.state[q].items():      # must not pass through fp32)
            loaded = opt_resumed.state[p][key]
            assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
    R.train(resumed, opt_resumed, stop, RESUME_STEPS)
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), (n, float((a - b).abs().max()))


def test_resume_bf16_keeps_fp32_state():
    """bf16 weights, fp32 moments and basis: the load must not round the state through bf16."""
    model0 = R.make_mlp(0).to(torch.bfloat16)

    def run(model, start, stop, opt):
        for step in range(start, stop):
            for p in model.parameters():
                p.grad = None
            x, y = R.batch(step)
            ((model(x.bfloat16()) - y.bfloat16()).float() ** 2).mean().backward()
            opt.step()

    full = copy.deepcopy(model0)
    opt_full = GaLoreAdamW(full, lr=1e-2, rank=4, update_proj_gap=4, targets=["a", "b", "c"], proj_method="svd")
    run(full, 0, 10, opt_full)
    first = copy.deepcopy(model0)
    opt_first = GaLoreAdamW(first, lr=1e-2, rank=4, update_proj_gap=4, targets=["a", "b", "c"], proj_method="svd")
    run(first, 0, 6, opt_first)
    assert opt_first.state[first.a.weight]["exp_avg"].dtype == torch.float32
    opt_sd, model_sd = R.roundtrip(opt_first.state_dict()), R.roundtrip(first.state_dict())
    resumed = copy.deepcopy(model0)
    resumed.load_state_dict(model_sd)
    opt_resumed = GaLoreAdamW(resumed, lr=1e-2, rank=4, update_proj_gap=4, targets=["a", "b", "c"], proj_method="svd")
    opt_resumed.load_state_dict(opt_sd)
    for key in ("exp_avg", "exp_avg_sq", "proj"):
        assert torch.equal(opt_resumed.state[resumed.a.weight][key], opt_first.state[first.a.weight][key]), key
    run(resumed, 6, 10, opt_resumed)
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), n


# =========================================================================== 5. memory


def _analytic_galore(model, rank):
    """Right side (auto): basis d = in-features, moments k = out-features; fp32 everything, int8 side."""
    total = 0
    for w in _weights(model):
        k, d = w.shape
        total += 2 * k * rank * 4 + d * rank * 4 + 4 + 1
    for b in _biases(model):
        total += 2 * b.numel() * 4 + 4
    return total


def _analytic_apollo(model, rank):
    """Moments 2 k r fp32, step fp32, side int8, proj_seed int64, limiter norm fp32; no projection matrix."""
    total = 0
    for w in _weights(model):
        k, _ = w.shape
        total += 2 * k * rank * 4 + 4 + 1 + 8 + 4
    for b in _biases(model):
        total += 2 * b.numel() * 4 + 4
    return total


@pytest.mark.parametrize("method", ["svd", "randomized"])
def test_memory_galore_exact(method):
    m = R.make_mlp(0)
    opt = GaLoreAdamW(m, lr=1e-3, rank=4, update_proj_gap=3, targets=["a", "b", "c"], proj_method=method)
    R.train(m, opt, 0, 4)  # through a refresh
    assert state_bytes(opt) == expected_state_bytes(opt) == _analytic_galore(m, 4)


@pytest.mark.parametrize("mini", [False, True], ids=["apollo", "apollo_mini"])
def test_memory_apollo_exact(mini):
    m = R.make_mlp(0)
    kw = dict(lr=1e-3, update_proj_gap=3, targets=["a", "b", "c"])
    opt = apollo_mini(m, **kw) if mini else ApolloAdamW(m, rank=4, **kw)
    R.train(m, opt, 0, 4)
    assert state_bytes(opt) == expected_state_bytes(opt) == _analytic_apollo(m, 1 if mini else 4)


def test_memory_adamw_reference_formula():
    m = R.make_mlp(0)
    opt = torch.optim.AdamW(m.parameters(), foreach=False)
    R.train(m, opt, 0, 1)
    assert state_bytes(opt) == expected_state_bytes(opt) == sum(2 * p.numel() * 4 + 4 for p in m.parameters())


def test_memory_galore_torch_keeps_full_svd_factor(galore_ref):
    """galore-torch's basis is a slice of the full SVD factor, so the whole factor stays allocated."""
    rank = 4
    mb = R.make_mlp(0)
    ref = galore_ref.AdamW(
        [{"params": _weights(mb), "rank": rank, "update_proj_gap": 20, "scale": 1.0, "proj_type": "std"}],
        lr=1e-3, no_deprecation_warning=True,
    )
    R.train(mb, ref, 0, 1)
    view = R.StateView({p: {"exp_avg": ref.state[p]["exp_avg"], "exp_avg_sq": ref.state[p]["exp_avg_sq"],
                            "basis": ref.state[p]["projector"].ortho_matrix} for p in _weights(mb)})
    analytic, full_factor = 0, 0
    for w in _weights(mb):
        m, n = w.shape
        d, k = (n, m) if m >= n else (m, n)  # std: reduce the smaller side
        analytic += 2 * k * rank * 4 + d * rank * 4
        full_factor += 2 * k * rank * 4 + d * min(m, n) * 4  # (min, n) Vh or (m, min) U kept alive
    measured = state_bytes(view)
    assert measured > analytic
    assert measured == full_factor

    ma = R.make_mlp(0)
    ours = GaLoreAdamW([{"params": _weights(ma)}], lr=1e-3, rank=rank, update_proj_gap=20, proj_side="std",
                       proj_method="svd", compat="galore_torch")
    R.train(ma, ours, 0, 1)
    assert state_bytes(ours) == analytic + len(_weights(ma)) * (4 + 1)  # + step (fp32) and side (int8) each


# =========================================================================== 6. shapes x ranks x sides


SHAPES = {"tall": (10, 6), "wide": (6, 10), "square": (8, 8)}
# fp32 SVD + fp32 Adam (the optimizer) vs an fp64 SVD (the reference): measured up to 2e-6; a wrong side, basis,
# scale, eps or bias correction is an O(1) error.
SVD_TOL = 1e-5


def _expected_side(shape, side):
    """galore-torch's documented rules; ``auto`` reduces the in-features."""
    m, n = shape
    return {"auto": "right", "right": "right", "left": "left",
            "std": "right" if m >= n else "left", "reverse_std": "left" if m >= n else "right"}[side]


def _first_step_reference(g, rank, side, lr, scale, eps):
    """First GaLore step from the math: P = top-r singular vectors of G on ``side``, R = coordinates of G,
    update = -lr * scale * back(R / (|R| + eps)).  Invariant under the signs of the singular vectors."""
    g = g.double()
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    if side == "right":
        basis = vh[:rank].T
        r = g @ basis
        return -lr * scale * (r / (r.abs() + eps)) @ basis.T
    basis = u[:, :rank]
    r = basis.T @ g
    return -lr * scale * basis @ (r / (r.abs() + eps))


def _cases():
    for shape_name, (m, n) in SHAPES.items():
        for side in ("auto", "right", "left", "std", "reverse_std"):
            d = n if _expected_side((m, n), side) == "right" else m
            ranks = {1, min(m, n) - 2}
            if d > min(m, n):  # the low-rank tensor is square when rank == the other dimension
                ranks.add(min(m, n))
            for rank in sorted(ranks):
                yield pytest.param(shape_name, side, rank, id=f"{shape_name}-{side}-r{rank}")


@pytest.mark.parametrize("shape_name,side,rank", list(_cases()))
def test_shapes_sides_ranks(shape_name, side, rank):
    m, n = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(sum(map(ord, f"{shape_name}{side}{rank}")))
    w = nn.Parameter(torch.zeros(m, n))  # zero start: the update is read without fp32 cancellation
    w0 = w.detach().clone()
    g = torch.randn(m, n, generator=gen)
    lr, scale, eps = 1e-2, 0.7, 1e-8
    opt = GaLoreAdamW([w], lr=lr, weight_decay=0.0, eps=eps, rank=rank, scale=scale, proj_side=side,
                      proj_method="svd", update_proj_gap=10)
    w.grad = g.clone()
    opt.step()
    exp_side = _expected_side((m, n), side)
    st = opt.state[w]
    assert int(st["side"]) == (P.RIGHT if exp_side == "right" else P.LEFT)
    low = (m, rank) if exp_side == "right" else (rank, n)
    assert tuple(st["exp_avg"].shape) == low and tuple(st["exp_avg_sq"].shape) == low
    d = n if exp_side == "right" else m
    assert tuple(st["proj"].shape) == (d, rank)
    update = w.detach() - w0
    assert update.shape == w.shape
    ref = _first_step_reference(g, rank, exp_side, lr, scale, eps)
    err = float((update.double() - ref).norm() / ref.norm())
    assert err <= SVD_TOL, err


@pytest.mark.parametrize("shape,side", [((10, 6), "left"), ((6, 10), "right"), ((6, 10), "reverse_std")])
def test_square_low_rank_tensor_uses_stored_side(shape, side, galore_ref):
    """rank == the smaller dimension of a non-square weight makes the low-rank tensor square, where a side guessed
    from shapes goes wrong (modelscope/ms-swift#10146).  Ours follows the stored side, checked against the math."""
    m, n = shape
    rank = min(m, n)
    gen = torch.Generator().manual_seed(3)
    w = nn.Parameter(torch.zeros(m, n))
    w0 = w.detach().clone()
    g = torch.randn(m, n, generator=gen)
    opt = GaLoreAdamW([w], lr=1e-2, weight_decay=0.0, eps=1e-8, rank=rank, scale=1.0, proj_side=side,
                      proj_method="svd")
    w.grad = g.clone()
    opt.step()
    assert tuple(opt.state[w]["exp_avg"].shape) == (rank, rank)
    ref = _first_step_reference(g, rank, _expected_side(shape, side), 1e-2, 1.0, 1e-8)
    assert float(((w.detach() - w0).double() - ref).norm() / ref.norm()) <= SVD_TOL
    if side == "reverse_std":  # galore-torch guesses the side from the square tensor and fails here
        v = nn.Parameter(w0.clone())
        ref_opt = galore_ref.AdamW([{"params": [v], "rank": rank, "update_proj_gap": 10, "scale": 1.0,
                                     "proj_type": "reverse_std"}], lr=1e-2, no_deprecation_warning=True)
        v.grad = g.clone()
        with pytest.raises(RuntimeError):
            ref_opt.step()


def test_rank_above_the_smaller_side_keeps_adamw_or_is_refused():
    """A sequence-classification head (3 labels x 32) under rank 4, found by the composition matrix: the projected
    side (32) is above the rank, but the gradient's SVD has 3 directions, so the basis had 3 columns and the rank-4
    moments crashed the second step. Selected by the model (all-linear): plain AdamW, listed in ``skipped_small``,
    and its steps equal AdamW's; named explicitly: refused in one line. APOLLO's random projection has no such bound."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 3))
    ref = copy.deepcopy(model)
    opt = GaLoreAdamW(model, rank=4, lr=1e-2, weight_decay=0.0, eps=1e-8, proj_method="svd", update_proj_gap=10)
    assert opt.skipped_small == ["1.weight"] and "0.weight" in opt.projected_names
    adam = torch.optim.AdamW(ref[1].parameters(), lr=1e-2, weight_decay=0.0, eps=1e-8)
    for step in range(3):  # the crash was at the second step
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        for m in (model, ref):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        opt.step()
        adam.step()
        with torch.no_grad():  # the projected layer below: the same weights in both, so the head sees one input
            ref[0].load_state_dict(model[0].state_dict())
    assert torch.allclose(model[1].weight, ref[1].weight, rtol=0, atol=1e-7)
    with pytest.raises(OptimizerConfigError, match=r"rank=4 is above the smaller side 3 of .*1\.weight.*min_size=4"):
        GaLoreAdamW(model, targets=["1"], rank=4, proj_method="svd")
    assert "1.weight" in ApolloAdamW(model, rank=4).projected_names


# =========================================================================== 7. robustness


def _single_matrix_opt(method="svd", gap=3, **kw):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 8))
    opt = GaLoreAdamW([w], lr=1e-2, rank=3, update_proj_gap=gap, proj_method=method, **kw)
    return w, opt


def _grad(step, shape=(12, 8)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + step))


def test_nan_gradient_at_refresh_keeps_basis_and_warns():
    w, opt = _single_matrix_opt(gap=3)
    for step in range(3):
        w.grad = _grad(step)
        opt.step()
    before = opt.state[w]["proj"].clone()
    g = _grad(3)
    g[2, 5] = float("nan")
    w.grad = g
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()  # step 3 is a refresh step
    assert torch.equal(opt.state[w]["proj"], before)


def test_svd_failure_keeps_basis_and_warns(monkeypatch):
    w, opt = _single_matrix_opt(gap=3)
    for step in range(3):
        w.grad = _grad(step)
        opt.step()
    before = opt.state[w]["proj"].clone()
    calls = []

    def broken_svd(*args, **kwargs):
        calls.append(args[0].dtype)
        raise torch.linalg.LinAlgError("SVD did not converge (test)")

    monkeypatch.setattr(torch.linalg, "svd", broken_svd)
    w.grad = _grad(3)
    with pytest.warns(RuntimeWarning, match="SVD failed"):
        opt.step()
    assert calls  # the refresh did try the SVD
    assert torch.equal(opt.state[w]["proj"], before)
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("kind", ["galore_randomized", "apollo"])
def test_refresh_leaves_global_rng_untouched(kind):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 8))
    if kind == "apollo":
        opt = ApolloAdamW([w], lr=1e-2, rank=3, update_proj_gap=2)
        key = "proj_seed"
    else:
        opt = GaLoreAdamW([w], lr=1e-2, rank=3, update_proj_gap=2, proj_method="randomized")
        key = "proj"
    torch.manual_seed(1234)
    for step in range(3):  # steps 0 and 2 refresh
        before_state = opt.state[w].get(key)
        before_state = None if before_state is None else before_state.clone()
        w.grad = _grad(step)
        rng = torch.get_rng_state()
        opt.step()
        assert torch.equal(torch.get_rng_state(), rng), step
        if step in (0, 2):
            assert before_state is None or not torch.equal(opt.state[w][key], before_state)


def test_one_dim_params_in_projected_group_are_adamw():
    ma, mb = R.twins(0)
    init = R.snapshot(mb)
    ours = GaLoreAdamW([{"params": list(ma.parameters()), "project": True}], lr=1e-2, weight_decay=0.1, rank=3,
                       update_proj_gap=4, proj_method="svd")
    ref = torch.optim.AdamW(mb.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    R.train_pair(ma, ours, mb, ref, 10)
    for b in _biases(ma):
        assert not ours.is_projected(b)
        assert ours.state[b]["exp_avg"].shape == b.shape
    assert all(ours.is_projected(w) for w in _weights(ma))
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert max(diffs[n] for n in ("a.bias", "b.bias", "c.bias")) <= TOL, diffs


# =========================================================================== 8. on_switch


def _random_orthogonal_bases(monkeypatch):
    """Replace the basis computation by a fresh random full-rank orthogonal matrix at every refresh."""
    counter = [0]

    def fake_top_basis(g, rank, side, **kw):
        counter[0] += 1
        d = g.shape[P.reduced_dim(side)]
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(counter[0]), dtype=torch.float64))
        return q[:, :rank].to(g.dtype).contiguous()

    monkeypatch.setattr(P, "top_basis", fake_top_basis)
    return counter


def _full_first_moment(st):
    m, basis, side = st["exp_avg"].double(), st["proj"].double(), int(st["side"])
    return m @ basis.T if side == P.RIGHT else basis @ m


@pytest.mark.parametrize("on_switch", ["reproject", "keep"])
def test_reproject_full_rank_keeps_first_moment(monkeypatch, on_switch):
    """Full rank, orthogonal bases changing at every refresh: with ``reproject`` the back-projected first moment is
    the EMA of the gradients (torch.optim.AdamW's exp_avg) across refreshes; with ``keep`` it is not (control)."""
    counter = _random_orthogonal_bases(monkeypatch)
    ma, mb = R.twins(0)
    ours = GaLoreAdamW(_identity_groups(ma, "auto"), lr=1e-2, weight_decay=0.0, proj_method="identity", scale=1.0,
                       update_proj_gap=3, on_switch=on_switch)
    ref = torch.optim.AdamW(mb.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    errs = []

    def check(step):
        for wa, wb in zip(_weights(ma), _weights(mb)):
            full = _full_first_moment(ours.state[wa])
            ema = ref.state[wb]["exp_avg"].double()
            errs.append((step, float((full - ema).norm() / ema.norm())))

    R.train_pair(ma, ours, mb, ref, 10, callback=check)
    assert counter[0] == 3 * 4  # refreshes at steps 0, 3, 6, 9 for each of the 3 matrices
    worst_after_refresh = max(e for s, e in errs if s >= 3)
    if on_switch == "reproject":
        assert max(e for _, e in errs) <= 1e-6, errs
    else:
        assert worst_after_refresh > 1e-2


def test_reproject_partial_rank_projects_old_moment():
    """rank < d: the moment carried into the new basis, back-projected, is the old back-projected moment projected
    onto the new subspace (P_new P_new^T M_old)."""
    beta1 = 0.9
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 8))
    opt = GaLoreAdamW([w], lr=1e-2, rank=3, update_proj_gap=3, proj_method="svd", on_switch="reproject",
                      betas=(beta1, 0.999), weight_decay=0.0)
    for step in range(3):
        w.grad = _grad(step)
        opt.step()
    st = opt.state[w]
    old_full = _full_first_moment(st)
    w.grad = _grad(3)
    opt.step()  # refresh
    new_basis = st["proj"].double()
    r_new = _grad(3).double() @ new_basis  # right side (auto)
    carried = (st["exp_avg"].double() - (1 - beta1) * r_new) / beta1
    expected = old_full @ new_basis @ new_basis.T
    assert float((carried @ new_basis.T - expected).norm() / expected.norm()) <= 1e-5


def test_reset_zeroes_moments_and_restarts_bias_correction():
    lr, eps, beta1, beta2, scale = 1e-2, 1e-8, 0.9, 0.999, 0.5
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(12, 8))
    opt = GaLoreAdamW([w], lr=lr, rank=3, update_proj_gap=3, proj_method="svd", on_switch="reset",
                      betas=(beta1, beta2), eps=eps, weight_decay=0.0, scale=scale)
    for step in range(3):
        w.grad = _grad(step)
        opt.step()
    before = w.detach().clone()
    g = _grad(3)
    w.grad = g.clone()
    opt.step()  # refresh: moments restart from zero
    st = opt.state[w]
    r = g.double() @ st["proj"].double()
    assert torch.allclose(st["exp_avg"].double(), (1 - beta1) * r, rtol=1e-6, atol=1e-9)
    assert torch.allclose(st["exp_avg_sq"].double(), (1 - beta2) * r * r, rtol=1e-5, atol=1e-12)
    # bias correction restarted: this is a first Adam step in the new basis
    expected = _first_step_reference(g, 3, "right", lr, scale, eps)
    assert float(((w.detach() - before).double() - expected).norm() / expected.norm()) <= 1e-5


# =========================================================================== 9. stagger


@pytest.mark.parametrize("stagger", [True, False])
def test_stagger_spreads_refreshes(stagger):
    gap, steps = 6, 20
    m = R.make_mlp(0)
    opt = GaLoreAdamW(m, lr=1e-3, rank=3, update_proj_gap=gap, targets=["a", "b", "c"], proj_method="svd",
                      stagger=stagger)
    refreshes = {n: [] for n in ("a", "b", "c")}
    prev = {}
    for step in range(steps):
        R.compute_grads(m, step)
        opt.step()
        for n, w in zip("abc", _weights(m)):
            cur = opt.state[w]["proj"]
            if n in prev and not torch.equal(cur, prev[n]):
                refreshes[n].append(step)
            prev[n] = cur.clone()
    for n, steps_n in refreshes.items():
        assert len(steps_n) >= 2, refreshes
        assert all(b - a == gap for a, b in zip(steps_n, steps_n[1:])), refreshes
    phases = {steps_n[0] % gap for steps_n in refreshes.values()}
    if stagger:
        assert len(phases) == 3, refreshes  # three matrices, three different refresh steps within each gap
    else:
        assert phases == {0}, refreshes


# =========================================================================== 10. errors


@pytest.mark.parametrize("rank", [12, 16])  # == and > the reduced dimension (full-rank SVD GaLore is refused)
def test_error_rank_larger_than_matrix(rank):
    m = R.make_mlp(0)
    with pytest.raises(OptimizerConfigError) as e:
        GaLoreAdamW(m, rank=rank, targets=["a"], proj_method="svd")  # a.weight is (24, 12): in-features 12
    msg = str(e.value)
    assert f"rank={rank}" in msg and "12" in msg and "a.weight" in msg
    assert "lower the rank" in msg and "min_size" in msg


def test_error_target_matches_nothing():
    m = R.make_mlp(0)
    with pytest.raises(OptimizerConfigError) as e:
        GaLoreAdamW(m, rank=2, targets=["a", "attention"])
    msg = str(e.value)
    assert "['attention']" in msg  # only the pattern that matched nothing
    assert "fix the pattern" in msg and "all-linear" in msg


def test_error_update_proj_gap_zero():
    with pytest.raises(OptimizerConfigError) as e:
        GaLoreAdamW(R.make_mlp(0), rank=2, update_proj_gap=0, targets=["a"])
    msg = str(e.value)
    assert "update_proj_gap=0" in msg and ">= 1" in msg


@pytest.mark.parametrize("kw,needle", [({"rank": True}, "rank=True must be an integer"),
                                       ({"update_proj_gap": True}, "update_proj_gap=True must be an integer"),
                                       ({"lr": True}, "lr=True must be a number"),
                                       ({"betas": (0.9,)}, "betas=(0.9,) must be two numbers in [0, 1)"),
                                       ({"eps": "1e-8"}, "eps='1e-8' must be a number"),
                                       ({"min_size": False}, "min_size=False must be an integer")])
def test_error_a_bool_or_a_string_where_a_number_belongs(kw, needle):
    """Python's True is an int and a tuple of one beta unpacked with a traceback: each is one line naming the key."""
    with pytest.raises(OptimizerConfigError, match=re.escape(needle)):
        GaLoreAdamW(R.make_mlp(0), **{"rank": 2, "targets": ["a"], **kw})


def test_error_bad_proj_side():
    with pytest.raises(OptimizerConfigError) as e:
        GaLoreAdamW(R.make_mlp(0), rank=2, proj_side="diagonal", targets=["a"])
    msg = str(e.value)
    assert "proj_side='diagonal'" in msg and "'auto'" in msg and "'reverse_std'" in msg


def test_error_targets_with_unnamed_params():
    with pytest.raises(OptimizerConfigError) as e:
        GaLoreAdamW(list(R.make_mlp(0).parameters()), rank=2, targets=["a"])
    msg = str(e.value)
    assert "targets=['a']" in msg and "names" in msg and "named_parameters()" in msg


@pytest.mark.parametrize("cls", [GaLoreAdamW, ApolloAdamW])
def test_error_deepspeed_params_refused(cls):
    m = R.make_mlp(0)
    m.b.weight.ds_id = 7
    with pytest.raises(OptimizerConfigError) as e:
        cls(m, rank=2, targets=["a"])
    msg = str(e.value)
    assert "DeepSpeed" in msg and "FSDP2" in msg


def test_named_parameters_with_targets_are_accepted():
    m = R.make_mlp(0)
    opt = GaLoreAdamW(m.named_parameters(), rank=2, targets=["b"])
    assert opt.projected_names == ["b.weight"]


# =========================================================================== 11. parameter selection


def _tiny_llama():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _linear_weight_names(model):
    return {f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def test_default_targets_all_linear_except_output_head():
    model = _tiny_llama()
    opt = GaLoreAdamW(model, rank=4)
    expected = _linear_weight_names(model) - {"lm_head.weight"}
    assert set(opt.projected_names) == expected
    assert len(expected) == 2 * 7
    # everything trainable is optimized; the head, embeddings and norms by plain AdamW
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    assert not opt.is_projected(model.lm_head.weight)
    assert not opt.is_projected(model.model.embed_tokens.weight)


def test_default_targets_plain_module_with_output_head():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 5)

        def get_output_embeddings(self):
            return self.head

    net = Net()
    opt = GaLoreAdamW(net, rank=2)
    assert set(opt.projected_names) == {"body.0.weight", "body.2.weight"}


def _peft_model(modules_to_save):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(
        _tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
    )


def test_peft_lora_selection():
    model = _peft_model(["lm_head"])
    opt = GaLoreAdamW(model, rank=4, targets=["lm_head"])
    names = {id(p): n for n, p in model.named_parameters()}
    optimized = {names[id(p)] for g in opt.param_groups for p in g["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert optimized == trainable  # frozen base weights are not optimized at all
    assert not any("base_layer" in n or "original_module" in n for n in optimized)
    lora = {n for n in trainable if "lora_" in n}
    assert len(lora) == 2 * 2 * 2  # A and B of q_proj and v_proj in 2 layers
    assert not lora & set(opt.projected_names)  # LoRA A/B are never projected
    assert opt.projected_names == ["base_model.model.lm_head.modules_to_save.default.weight"]


def test_peft_all_linear_projects_trainable_full_copies_not_lora():
    model = _peft_model(["lm_head", "gate_proj"])
    groups = low_rank_param_groups(model, targets="all-linear")
    projected = {n for g in groups if g["project"] for n in g["param_names"]}
    assert projected == {f"base_model.model.model.layers.{i}.mlp.gate_proj.modules_to_save.default.weight"
                         for i in range(2)}  # lm_head is the output head; LoRA A/B never; frozen never
    opt = GaLoreAdamW(model, rank=4)
    assert set(opt.projected_names) == projected
    model.train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # one real step: the projected copies got low-rank moments
    w = model.base_model.model.model.layers[0].mlp.gate_proj.modules_to_save["default"].weight
    assert tuple(opt.state[w]["exp_avg"].shape) == (128, 4)


def test_peft_targets_that_match_only_lora_or_frozen_weights_say_so():
    model = _peft_model(["lm_head"])
    with pytest.raises(OptimizerConfigError, match=r"targets \['q_proj', 'v_proj'\] match only frozen, adapter"):
        GaLoreAdamW(model, rank=2, targets=["q_proj", "v_proj"])


def test_apollo_mini_with_another_rank_is_refused_like_the_yaml():
    from hf_gradfix.optim.apollo import apollo_mini
    from hf_gradfix.optim.groups import OptimizerConfigError

    with pytest.raises(OptimizerConfigError, match="apollo_mini: rank=4: invalid value; apollo_mini is rank 1"):
        apollo_mini(torch.nn.Linear(16, 16), rank=4)
    assert apollo_mini(torch.nn.Linear(16, 16), rank=1).param_groups[0]["rank"] == 1


def test_a_state_saved_at_another_rank_or_by_adamw_is_refused_naming_the_matrix():
    """Issue 38: a rank-4 GaLore state loaded into a rank-8 GaLore was accepted (and failed later, or not at all);
    an AdamW state gave torch's own message. The matching state still loads (control)."""
    from hf_gradfix.errors import UsageError
    from hf_gradfix.optim.galore import GaLoreAdamW

    def trained(opt_cls, **kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        opt = opt_cls(model, lr=1e-3, **kw) if opt_cls is GaLoreAdamW else opt_cls(model.parameters(), lr=1e-3)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        return model, opt

    _, r4 = trained(GaLoreAdamW, rank=4)
    model8, r8 = trained(GaLoreAdamW, rank=8)
    with pytest.raises(UsageError, match=r"GaLoreAdamW.load_state_dict: 0.weight: the saved low-rank moments are \(32, 4\), this optimizer \(rank 8\)"):
        r8.load_state_dict(r4.state_dict())
    _, adamw = trained(torch.optim.AdamW)
    with pytest.raises(UsageError, match="full-rank optimizer"):
        r8.load_state_dict(adamw.state_dict())
    r8.load_state_dict(r8.state_dict())  # the control: its own state loads
