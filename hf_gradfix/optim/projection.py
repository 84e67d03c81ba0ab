"""Projection math shared by the low-rank optimizers (pure torch).

A projected matrix ``W`` of shape ``(m, n)`` keeps its Adam moments in a rank-``r`` subspace of one of
its sides.  The *reduced* side is the one the basis spans:

* ``right`` reduces the in-features ``n``: basis ``P`` is ``(n, r)``, ``R = G @ P`` is ``(m, r)``,
  back-projection ``R @ P.T``;
* ``left`` reduces the out-features ``m``: basis ``P`` is ``(m, r)``, ``R = P.T @ G`` is ``(r, n)``,
  back-projection ``P @ R``.

The basis is always stored as a ``(d, r)`` matrix (``d`` = the reduced dimension) and the side is stored
next to it, so back-projection never has to guess the side from a shape (galore-torch guesses, and is
wrong for square low-rank tensors: modelscope/ms-swift#10146).

This module imports only torch.

>>> import torch
>>> g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
>>> p = top_basis(g, 2, RIGHT, method="svd")
>>> tuple(p.shape), tuple(project(g, p, RIGHT).shape), tuple(project_back(project(g, p, RIGHT), p, RIGHT).shape)
((4, 2), (6, 2), (6, 4))
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgumentError

__all__ = [
    "LEFT",
    "RIGHT",
    "reduced_dim",
    "resolve_side",
    "top_basis",
    "randomized_svd",
    "random_basis",
    "gaussian_projection",
    "canonicalize_signs",
    "project",
    "project_back",
    "transfer_moments",
]

LEFT = 0  # basis spans the out-features (rows): R = P^T G
RIGHT = 1  # basis spans the in-features (columns): R = G P

_SIDES = ("auto", "right", "left", "std", "reverse_std")


def reduced_dim(side: int) -> int:
    """The dimension of ``W`` that the basis spans (0 for LEFT, 1 for RIGHT)."""
    return 0 if side == LEFT else 1


def resolve_side(shape: tuple[int, int], proj_side: str, sharded_dims: frozenset[int] = frozenset()) -> int:
    """The side (LEFT/RIGHT) to project a ``shape`` matrix on.

    ``auto`` reduces the in-features (RIGHT): it stores the same or less state than galore-torch's ``std``
    rule on every shape (the larger side goes into the basis, stored once, not into the two moments) and
    keeps FSDP2's row shards local.  It switches to LEFT only when the in-features are sharded (a row-wise
    tensor-parallel weight).  ``std`` / ``reverse_std`` are galore-torch's rules (reduce the smaller / the
    larger side).

    >>> resolve_side((8, 4), "auto"), resolve_side((4, 8), "auto"), resolve_side((4, 8), "std")
    (1, 1, 0)
    >>> resolve_side((4, 8), "auto", frozenset({1}))
    0
    """
    m, n = shape
    if proj_side == "auto":
        return LEFT if (1 in sharded_dims and 0 not in sharded_dims) else RIGHT
    if proj_side == "right":
        return RIGHT
    if proj_side == "left":
        return LEFT
    if proj_side == "std":
        return RIGHT if m >= n else LEFT
    if proj_side == "reverse_std":
        return LEFT if m >= n else RIGHT
    raise InvalidArgumentError(f"proj_side={proj_side!r}; allowed: {', '.join(map(repr, _SIDES))}")


def canonicalize_signs(basis: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its largest-magnitude entry is positive (in place; returns ``basis``).

    Singular vectors are defined up to sign; fixing the sign makes a basis computed from two nearly equal
    gradients (one process vs several) nearly equal too, which matters because the moments are kept
    across refreshes in basis coordinates.
    """
    idx = basis.abs().argmax(dim=0, keepdim=True)
    signs = torch.sign(torch.gather(basis, 0, idx))
    signs[signs == 0] = 1
    basis.mul_(signs)
    return basis


def randomized_svd(
    g: torch.Tensor, rank: int, *, oversample: int = 8, niter: int = 2, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` left and right singular vectors ``(U (m, r), V (n, r))`` by a randomized range finder.

    Halko, Martinsson & Tropp (2011), algorithm 4.4 with QR-stabilized power iterations.  Written here
    rather than calling ``torch.svd_lowrank`` because that draws from the *global* RNG, which would shift
    dropout masks and data shuffling of the training run; here the sketch comes from ``generator``.
    """
    m, n = g.shape
    k = min(rank + oversample, m, n)
    omega = torch.randn(n, k, generator=generator, dtype=g.dtype, device="cpu").to(g.device)
    q, _ = torch.linalg.qr(g @ omega)
    for _ in range(niter):
        q, _ = torch.linalg.qr(g.T @ q)
        q, _ = torch.linalg.qr(g @ q)
    b = q.T @ g  # (k, n)
    ub, _, vh = torch.linalg.svd(b, full_matrices=False)
    u = q @ ub
    return u[:, :rank], vh[:rank].T


def top_basis(
    g: torch.Tensor,
    rank: int,
    side: int,
    *,
    method: str = "svd",
    oversample: int = 8,
    niter: int = 2,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The ``(d, rank)`` orthonormal basis of the top singular subspace of ``g`` on ``side`` (fp32 in, fp32 out).

    ``method``: ``svd`` (exact, ``torch.linalg.svd``), ``randomized`` (:func:`randomized_svd`) or ``identity``
    (the first ``rank`` unit vectors; with full rank this is no projection at all, used by tests).

    >>> import torch
    >>> top_basis(torch.eye(3), 3, LEFT, method="identity").equal(torch.eye(3))
    True
    """
    d = g.shape[reduced_dim(side)]
    if method == "identity":
        return torch.eye(d, rank, dtype=g.dtype, device=g.device)
    if method == "randomized":
        u, v = randomized_svd(g, rank, oversample=oversample, niter=niter, generator=generator)
    elif method == "svd":
        u_full, _, vh = torch.linalg.svd(g, full_matrices=False)
        u, v = u_full[:, :rank], vh[:rank].T
    else:
        raise InvalidArgumentError(f"proj_method={method!r}; allowed: 'svd', 'randomized', 'identity'")
    basis = u if side == LEFT else v
    return basis.contiguous()


def random_basis(d: int, rank: int, generator: torch.Generator, dtype=torch.float32, device=None) -> torch.Tensor:
    """A random ``(d, rank)`` orthonormal basis (QR of a Gaussian): the fallback when no SVD is possible."""
    q, _ = torch.linalg.qr(torch.randn(d, rank, generator=generator, dtype=dtype))
    return q.to(device) if device is not None else q


def gaussian_projection(
    d: int, rank: int, seed: int, dtype=torch.float32, device=None, transposed: bool = False
) -> torch.Tensor:
    """APOLLO's random projection: a ``(d, rank)`` Gaussian matrix with variance ``1/rank``, from ``seed``.

    Regenerated from the seed whenever it is needed, so the optimizer stores one integer instead of it (the
    generator's whole state is ``seed``: a fresh generator is seeded with it for every draw, so a resumed run that
    restored ``proj_seed`` draws the same matrix).  The draw happens on ``device`` with a generator of that device
    (issue 53: drawing on the CPU and copying cost 0.6 s per step for two 7B-shaped layers on an H100).  On the CPU
    this is the same stream of numbers as before; a CUDA generator gives other numbers than the CPU one for the same
    seed, identical on every GPU of one model (torch's Philox kernels size their grid by the SM count, so a
    different GPU model, or a MIG slice, may draw another matrix from the same seed).  A device without its own
    generator (``meta``, a fake tensor's) draws on the CPU as before.
    ``transposed=True`` draws it as ``(rank, d)`` and returns the transpose (apollo-torch's layout for
    the right side, so that the same seed gives the same matrix as apollo-torch on the CPU).
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    try:
        gen = torch.Generator(device=dev)
    except (RuntimeError, ValueError):  # no generator on this device type: the host draws
        gen, dev = torch.Generator(device="cpu"), torch.device("cpu")
    gen.manual_seed(int(seed))
    shape = (rank, d) if transposed else (d, rank)
    p = torch.randn(shape, generator=gen, dtype=torch.float32, device=dev) / math.sqrt(rank)
    p = p.T if transposed else p
    return p.to(device=device, dtype=dtype)


def project(g: torch.Tensor, basis: torch.Tensor, side: int) -> torch.Tensor:
    """Coordinates of ``g`` in ``basis``: ``g @ P`` (RIGHT) or ``P.T @ g`` (LEFT)."""
    return g @ basis if side == RIGHT else basis.T @ g


def project_back(r: torch.Tensor, basis: torch.Tensor, side: int) -> torch.Tensor:
    """Back to the weight's shape: ``r @ P.T`` (RIGHT) or ``P @ r`` (LEFT)."""
    return r @ basis.T if side == RIGHT else basis @ r


def transfer_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    old_basis: torch.Tensor,
    new_basis: torch.Tensor,
    side: int,
    bias_correction1: float,
    bias_correction2: float,
) -> None:
    """Re-express Adam's moments in a new basis (in place), the ``reproject`` moment rule.

    With ``C = P_new^T P_old`` the first moment maps linearly (``C m`` or ``m C^T``).  The second moment
    is carried as variance plus squared mean of the bias-corrected statistics, the variance mapped by
    ``C * C`` (coordinates treated as independent), as in LDAdam (arXiv 2410.16103).  With a full-rank
    orthogonal basis the back-projected first moment is unchanged.
    """
    c = new_basis.T @ old_basis  # (r, r)
    m_hat = exp_avg / bias_correction1
    var = (exp_avg_sq / bias_correction2 - m_hat * m_hat).clamp_(min=0)
    if side == LEFT:
        m_new, var_new = c @ m_hat, (c * c) @ var
    else:
        m_new, var_new = m_hat @ c.T, var @ (c * c).T
    exp_avg.copy_(m_new * bias_correction1)
    exp_avg_sq.copy_((var_new + m_new * m_new) * bias_correction2)
