"""Predicted vs measured memory of one training step, per category, on CPU.

    python benchmarks/memory_timeline.py      # ~3 min on 2 CPU cores; writes benchmarks/results/memory_timeline.md

For each configuration the same model (built from its config, fp32, ``attn_implementation="sdpa"``), batch and
optimizer run:

- **measured**: two real training steps (forward, backward, ``optimizer.step()``, ``zero_grad``) in one process;
  the second (steady state: the optimizer state exists) is recorded by ``MemoryTimelineRecorder`` (torch's
  ``MemTracker`` counting every live storage of real tensors after every op);
- **traced** (``plan --simulate``): the same step under fake tensors (``simulate``), attention counted with the
  fused-kernel profile;
- **closed form** (``plan``): ``estimate``'s components.

Per category the error is (predicted - measured) / measured of that category's own maximum over the step; the
total is the step's peak.  The closed form's activations include the backward's transient gradients (the
measured temporaries), so they are compared with the measured maximum of activations + temporaries.  Packing: one
row of concatenated documents (``position_ids`` restart per document), the plugin's reference varlen attention
on CPU (what CI runs; FlashAttention 2 needs CUDA); the planner plans it as one sequence of the row's length.
FSDP2 rows: two gloo processes, ``fully_shard`` per decoder layer and at the root (as the planner shards), rank 0
recorded with ``FSDPMemTracker`` (all-gather / reduce-scatter buffers are the comm buffers).
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

from _common import ROOT, on_path, results_path, versions  # noqa: E402

on_path(ROOT)

MiB = 1024**2
CATS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# (model, seq_len, micro_batch, optimizer, packed)
CASES = [
    ("tiny-llama", 256, 2, "adamw", False),
    ("tiny-mistral", 256, 2, "adamw", False),
    ("tiny-qwen2", 256, 2, "adamw", False),
    ("tiny-llama", 256, 2, "galore_adamw", False),
    ("tiny-qwen2", 256, 2, "galore_adamw", False),
    ("tiny-llama", 512, 1, "adamw", True),
    ("tiny-mistral", 512, 1, "galore_adamw", True),
]
# FSDP2 over 2 gloo processes (rank 0 recorded): (model, seq_len, micro_batch, optimizer)
FSDP_CASES = [("tiny-llama", 128, 2, "adamw"), ("tiny-qwen2", 128, 2, "galore_adamw")]


def _fsdp_worker(rank: int, world: int, case: tuple, path: str, port: int) -> None:
    """One rank of a 2-process FSDP2 (``fully_shard`` per decoder layer + root, as the planner shards) step."""
    import os
    import pickle

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from hf_gradfix.diagnostics.memory_timeline import MemoryTimelineRecorder
    from hf_gradfix.plan import Settings, load_model_config
    from hf_gradfix.plan.activations import decoder_layers
    from hf_gradfix.plan.simulate import _make_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    name, seq, micro, opt_name = case
    cfg = load_model_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").train()
    mesh = init_device_mesh("cpu", (world,))
    for _, layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _make_optimizer(model, Settings(seq_len=seq, micro_batch=micro, dtype="fp32", optimizer=opt_name, rank=16))
    rec = MemoryTimelineRecorder(model, opt)
    for step in range(2):
        ids = torch.randint(0, cfg.vocab_size, (micro, seq))
        if step:
            rec.begin()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad()
    tl = rec.end(step=2)
    if rank == 0:
        with open(path, "wb") as f:
            pickle.dump(tl, f)
    dist.destroy_process_group()


def measure_fsdp(case: tuple, port: int):
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/timeline.pkl"
        mp.spawn(_fsdp_worker, args=(2, case, path, port), nprocs=2)
        with open(path, "rb") as f:
            return pickle.load(f)


def _optimizer(model, name: str, rank: int):
    import torch

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    from hf_gradfix.optim import GaLoreAdamW

    return GaLoreAdamW(model, lr=1e-4, rank=rank)


def measure(config, seq: int, micro: int, opt_name: str, packed: bool, rank: int):
    """Two real steps; the second recorded."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_gradfix.diagnostics.memory_timeline import MemoryTimelineRecorder

    torch.manual_seed(0)
    config = copy.deepcopy(config)  # the packed case switches the config's attention
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    kw = {}
    if packed:
        from hf_gradfix.packing.attention import register_reference_varlen_attention, set_attention_implementation

        set_attention_implementation(model, register_reference_varlen_attention())
        docs = [seq // 4, seq // 2, seq - seq // 4 - seq // 2]  # three documents in one row
        kw["position_ids"] = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    opt = _optimizer(model, opt_name, rank)
    rec = MemoryTimelineRecorder(model, opt)
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (micro, seq))  # made outside the step, as the trace's are
        if step == 1:
            rec.begin()
        out = model(input_ids=ids, labels=ids, **kw)
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad()
        if step == 1:
            return rec.end(step=2)


def _err(pred: float, meas: float) -> str:
    if not meas:
        return "-" if not pred else "+inf"
    return f"{100 * (pred - meas) / meas:+.1f} %"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=results_path("memory_timeline.md"))
    ap.add_argument("--plot", help="also draw the first case's measured timeline with the prediction beside it")
    ns = ap.parse_args(argv)
    import torch

    from hf_gradfix.parallel import ParallelDims
    from hf_gradfix.plan import Settings, estimate, load_model_config
    from hf_gradfix.plan.simulate import simulate

    torch.set_num_threads(1)
    head = ("| model | mesh | batch | optimizer | measured peak MiB | traced: parameters | gradients | optimizer state "
            "| activations | temporaries | comm buffers | peak | closed form: activations (+temp.) | peak "
            "| measure / trace s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    cases = [(c, None) for c in CASES] + [((n, sq, mb, o, False), ParallelDims(2, dp_shard=2))
                                          for n, sq, mb, o in FSDP_CASES]
    for k, ((name, seq, micro, opt_name, packed), mesh) in enumerate(cases):
        cfg = load_model_config(name)
        rank = 16
        s = Settings(seq_len=seq, micro_batch=micro, dtype="fp32", optimizer=opt_name, rank=rank)
        t0 = time.perf_counter()
        meas = (measure(cfg, seq, micro, opt_name, packed, rank) if mesh is None
                else measure_fsdp((name, seq, micro, opt_name), 29600 + k))
        t1 = time.perf_counter()
        mesh = mesh or ParallelDims(1)
        sim = simulate(cfg, mesh, s)
        t2 = time.perf_counter()
        plan = estimate(cfg, mesh, s)
        pred = sim["timeline"]
        mmax, pmax = meas.category_max(), pred.category_max()
        cells = [_err(pmax[c], mmax[c]) for c in CATS + ("comm_buffers",)] + [_err(pred.peak, meas.peak)]
        act_temp = max(a + t for a, t in zip(meas.series["activations"], meas.series["temporaries"]))
        cells += [_err(plan.components["activations"], act_temp), _err(plan.peak, meas.peak)]
        batch = f"{micro} x {seq}" + (" packed (3 docs)" if packed else "")
        where = "1 process" if mesh.world_size == 1 else f"FSDP2 dp_shard {mesh.dp_shard} (gloo, rank 0)"
        rows.append(f"| {name} | {where} | {batch} | {opt_name} | {meas.peak / MiB:.2f} | " + " | ".join(cells)
                    + f" | {t1 - t0:.1f} / {t2 - t1:.1f} |")
        print(rows[-1], flush=True)
        if ns.plot and len(rows) == 1:
            meas.plot(ns.plot, compare=pred, estimate=plan.components,
                      title=f"{name}, {batch}, {opt_name}: measured step (CPU storages), the planner beside it")
    text = (f"# Memory of one training step: predicted vs measured\n\n`python benchmarks/memory_timeline.py` "
            f"({versions('torch', 'transformers')}, {platform.machine()}, CPU, one "
            "process unless stated, fp32). Error = (predicted - measured) / measured of each category's maximum "
            "over the "
            "step (the peak column: the step's peak). Traced: `plan --simulate` (fake tensors); closed form: "
            "`plan` (its peak adds a 10 % margin by design).\n\n" + head + "\n" + "\n".join(rows) + "\n")
    Path(ns.out).write_text(text, encoding="utf-8")
    print(f"written to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
