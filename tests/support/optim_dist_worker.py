"""Distributed worker for the low-rank optimizer tests (``tests/optim/test_optim_distributed.py``; gloo, CPU).

Run (normally through :func:`launch`)::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        tests/support/optim_dist_worker.py --out DIR [--cases ddp_galore,fsdp_galore,...]

Every case trains the same tiny fp32 Llama from the same initial weights for ``STEPS`` optimizer steps, each step on
the same global batch (``WORLD * GA * MB`` sequences of ``SEQ`` tokens, no padding, so every micro-batch of every rank
holds the same number of targets and "mean per micro-batch / GA, then the data-parallel average" is exactly the global
token mean).  Rank ``r``'s micro-batch ``k`` is a fixed slice of the global batch (:func:`micro_batch`).

* ``ddp_*``: ``DistributedDataParallel``, GA 2 with ``no_sync`` on the first micro-batch.
* ``fsdp_*``: FSDP2 (``fully_shard`` on each decoder layer and on the root, mesh ``init_device_mesh("cpu", (2,))``),
  GA 2 with ``set_requires_gradient_sync(False)`` on the first micro-batch.

Each rank writes ``DIR/{case}.rank{r}.pt``: ``initial_state`` (rank 0), ``final`` (full parameters, gathered with
``full_tensor()`` under FSDP2), ``proj`` / ``proj_seed`` (every projected matrix's basis / seed at the end) and
``proj_first`` / ``proj_seed_first`` (after the first step), ``moments`` (type,
placements, local and global shape and the gathered value of each projected matrix's moments), ``state_bytes`` and
``expected_state_bytes`` (this rank's optimizer state), ``projected_moment_bytes`` (local bytes of the projected
matrices' moments) and ``losses``.

The single-process reference is :func:`train_reference`; the test runs it in its own process (a reference inside the
workers would meet the other rank's basis broadcast and deadlock).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness  # noqa: E402
import multiproc  # noqa: E402

WORLD = 2  # data-parallel ranks
GA = 2  # micro-batches per optimizer step and rank
MB = 2  # sequences per micro-batch
SEQ = 16  # tokens per sequence (no padding)
STEPS = 5  # optimizer steps; refreshes at steps 0 and 3 (update_proj_gap 3)
SEED = 0
LR = 3e-3

MODEL_CONFIG = dict(harness.TINY_GQA_LLAMA, max_position_embeddings=64)

#: case -> (parallelism, optimizer, optimizer keyword arguments).  The exactness cases use the exact SVD
#: (``proj_method="svd"``): the randomized range finder (the default "auto" picks it here, rank 8 < 64 / 4) is far more
#: sensitive to the ~1e-7 rounding difference between an all-reduced and a single-process gradient on the flat spectrum
#: of a random-init model (see test_optim_distributed.py), so ``ddp_galore_randomized`` only checks rank agreement.
#: FSDP2 GaLore uses the "reproject" moment rule, so the sharded moments go through transfer_moments at the refresh;
#: FSDP2 APOLLO uses tensor-wise scaling, whose norms (and the norm-growth limiter's) span every shard.
CASES: dict[str, tuple[str, str, dict]] = {
    "ddp_galore": ("ddp", "galore", dict(rank=8, update_proj_gap=3, proj_method="svd")),
    # low-rank gradient accumulation: the optimizer all-reduces rank-8 accumulators, DDP only the rest; the
    # reference is full-gradient GaLore with the same (staggered) refresh schedule
    "ddp_galore_lowrank": ("ddp", "galore", dict(rank=8, update_proj_gap=3, proj_method="svd", stagger=True, lowrank_grads=True)),
    "ddp_galore_stagger": ("ddp", "galore", dict(rank=8, update_proj_gap=3, proj_method="svd", stagger=True)),
    "ddp_galore_randomized": ("ddp", "galore", dict(rank=8, update_proj_gap=3, proj_method="randomized")),
    "ddp_apollo": ("ddp", "apollo", dict(rank=8, update_proj_gap=3)),
    "fsdp_galore": ("fsdp", "galore", dict(rank=8, update_proj_gap=3, proj_method="svd", on_switch="reproject")),
    "fsdp_apollo": ("fsdp", "apollo", dict(rank=8, update_proj_gap=3, scale_type="tensor")),
}


def build_model(seed: int = SEED) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**MODEL_CONFIG)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").float()
    model.train()
    return model


def global_batch(step: int) -> torch.Tensor:
    """The ``(WORLD * GA * MB, SEQ)`` token ids of optimizer step ``step`` (same on every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MODEL_CONFIG["vocab_size"], (WORLD * GA * MB, SEQ), generator=g)


def micro_batch(step: int, rank: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s ``k``-th micro-batch of step ``step``: rows ``[(rank * GA + k) * MB, ... + MB)``."""
    start = (rank * GA + k) * MB
    return global_batch(step)[start : start + MB]


def mean_ce(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over every target of ``ids`` (from the logits; no padding, no ignore)."""
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def make_optimizer(case: str, model: torch.nn.Module, **over):
    from hf_gradfix.optim import ApolloAdamW, GaLoreAdamW

    _, kind, kw = CASES[case]
    cls = GaLoreAdamW if kind == "galore" else ApolloAdamW
    return cls(model, lr=LR, **{**kw, **over})


def projected(opt) -> dict[str, torch.Tensor]:
    """name -> parameter for every matrix the optimizer projects."""
    return {plan.name: p for p, plan in opt._plans.items()}


def train_reference(case: str, initial_state: dict, spectra: list | None = None):
    """One process, the whole global batch per step (the test's reference).  Returns ``(model, optimizer, losses)``.

    ``spectra``: if a list, the singular values of every projected matrix's gradient at each refresh step are
    appended as ``(step, name, svdvals)``.
    """
    model = build_model()
    model.load_state_dict(initial_state)
    opt = make_optimizer(case, model, lowrank_grads=False)  # the reference always holds full gradients
    mats = projected(opt)
    gap = CASES[case][2]["update_proj_gap"]
    losses = []
    for step in range(STEPS):
        loss = mean_ce(model, global_batch(step))
        loss.backward()
        if spectra is not None and step % gap == 0:
            for name, p in mats.items():
                spectra.append((step, name, torch.linalg.svdvals(p.grad.double())))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return model, opt, losses


# ----------------------------------------------------------------------------------------------------------------------
# distributed side


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t


def _wrap(case: str, model: torch.nn.Module, mesh):
    parallel = CASES[case][0]
    if parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_case(case: str, rank: int, world: int, mesh) -> dict:
    from hf_gradfix.optim import expected_state_bytes, state_bytes

    parallel = CASES[case][0]
    model = build_model()
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lowrank = CASES[case][2].get("lowrank_grads", False)
    if lowrank:  # built before DDP wraps the model, so DDP leaves the projected weights to the optimizer
        opt = make_optimizer(case, model)
    wrapped = _wrap(case, model, mesh)
    if not lowrank:
        opt = make_optimizer(case, model)  # DDP: the inner model (names without "module."); FSDP2: DTensor parameters
    mats = projected(opt)
    ddp_bytes = [0]
    if parallel == "ddp":  # count what DDP all-reduces (its gradient buckets)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            ddp_bytes[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, counting_hook)
    full_grads_at_step = []
    losses = []
    for step in range(STEPS):
        step_loss = 0.0
        for k in range(GA):
            last = k == GA - 1
            ids = micro_batch(step, rank, k)
            if parallel == "ddp":
                if last:
                    loss = mean_ce(wrapped, ids) / GA
                    loss.backward()
                else:
                    with wrapped.no_sync():
                        loss = mean_ce(wrapped, ids) / GA
                        loss.backward()
            else:
                wrapped.set_requires_gradient_sync(last)
                loss = mean_ce(wrapped, ids) / GA
                loss.backward()
            step_loss += float(loss.detach())
        full_grads_at_step.append(sum(p.grad is not None for p in mats.values()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step == 0:  # the bases / seeds of the first refresh, to show that a later refresh replaced them
            proj_first = {n: opt.state[p]["proj"].clone() for n, p in mats.items() if "proj" in opt.state[p]}
            seed_first = {n: int(opt.state[p]["proj_seed"]) for n, p in mats.items() if "proj_seed" in opt.state[p]}

    final = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    proj, seeds, moments = {}, {}, {}
    moment_bytes = 0
    for name, p in mats.items():
        st = opt.state[p]
        if "proj" in st:
            proj[name] = st["proj"].clone()
        if "proj_seed" in st:
            seeds[name] = int(st["proj_seed"])
        info = {}
        for key in ("exp_avg", "exp_avg_sq"):
            t = st[key]
            local = t.to_local() if _is_dtensor(t) else t
            moment_bytes += local.numel() * local.element_size()
            info[key] = dict(
                is_dtensor=_is_dtensor(t),
                placements=[repr(pl) for pl in t.placements] if _is_dtensor(t) else None,
                local_shape=tuple(local.shape),
                global_shape=tuple(t.shape),
                param_local_shape=tuple((p.to_local() if _is_dtensor(p) else p).shape),
                side=int(st["side"]),
                full=_full(t).clone(),
            )
        moments[name] = info
    return dict(
        case=case,
        rank=rank,
        world=world,
        initial_state=initial_state if rank == 0 else None,
        final=final,
        proj=proj,
        proj_seed=seeds,
        proj_first=proj_first,
        proj_seed_first=seed_first,
        moments=moments,
        state_bytes=state_bytes(opt),
        expected_state_bytes=expected_state_bytes(opt),
        projected_moment_bytes=moment_bytes,
        projected_names=list(mats),
        losses=losses,
        ddp_bytes=ddp_bytes[0],
        optimizer_bytes=getattr(opt, "bytes_all_reduced", 0),
        full_grads_at_step=full_grads_at_step,
    )


def launch(out: str | os.PathLike, cases=None) -> dict[str, list[dict]]:
    """Run this worker on ``WORLD`` processes (``torch.distributed.run``, gloo, 127.0.0.1) and load the records.

    Returns ``{case: [rank 0's record, rank 1's record, ...]}``.  Raises ``RuntimeError`` with the workers' output
    if they fail; a hang fails with ``HANG: ...`` (``hang_bound``).
    """
    cases = list(cases or CASES)
    out = Path(out)
    cmd = multiproc.torchrun(Path(__file__).resolve(), "--out", str(out), "--cases", ",".join(cases), nproc=WORLD)
    proc = multiproc.run_launch(cmd, step="optim_dist_worker.py launch", cwd=str(_TESTS.parents[1]),
                                env=multiproc.worker_env())
    if proc.returncode != 0:
        raise RuntimeError(
            f"optimizer workers failed (rc {proc.returncode})\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-12000:]}"
        )
    return {c: [torch.load(out / f"{c}.rank{r}.pt", weights_only=False) for r in range(WORLD)] for c in cases}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    import torch.distributed as dist

    # a rank stuck in a collective the other never joins fails the launch instead of hanging it (a hang bound)
    import hang_bound

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=hang_bound.bound("optim_dist_worker.py gloo collective")))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == WORLD, f"this worker expects {WORLD} processes, got {world}"
    mesh = None
    cases = [c for c in args.cases.split(",") if c]
    if any(CASES[c][0] == "fsdp" for c in cases):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for case in cases:
        record = run_case(case, rank, world, mesh)
        torch.save(record, out / f"{case}.rank{rank}.pt")
        dist.barrier()
    multiproc.finish_distributed()


if __name__ == "__main__":
    main()
