"""Per optimizer window, how unevenly the data-parallel ranks were loaded, in the Trainer's logs (issue 40).

A synchronous step waits for its slowest rank. For every window each rank sums the tokens of the packed rows it
really trained on and their compute cost (``packing.balance``'s model, ``L * (c + L)`` per document,
:func:`hf_gradfix.packing.balance.document_cost`); at each training log the windows since the last one are gathered
from every rank (one all_gather of ``2 x windows`` numbers) and ``packing/imbalance_tokens`` and
``packing/imbalance_compute`` are logged: the mean over those windows of max / mean over ranks (1.0 = no rank
waits). Measured from the batches, not from the sampler's plan, so a resumed run, a short last window or another
sampler are reported as they ran. Installed on the trainer instance at train begin (its ``get_batch_samples`` and
``log``), removed at train end; a second train() reuses it.

>>> document_lengths({"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
[3, 2]
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from ...packing.balance import document_cost
from ..instance_methods import InstanceMethods

TOKENS_KEY, COMPUTE_KEY = "packing/imbalance_tokens", "packing/imbalance_compute"


def document_lengths(batch: Any) -> list[int]:
    """The documents of a packed micro-batch: from ``cu_seq_lens_q`` (varlen) or the restarts of ``position_ids``;
    one document per row of ``input_ids`` otherwise (real tokens by ``attention_mask`` where given)."""
    cu = batch.get("cu_seq_lens_q") if hasattr(batch, "get") else None
    if torch.is_tensor(cu) and cu.numel() > 1:
        return [int(v) for v in torch.diff(cu.reshape(-1)).tolist() if v > 0]
    positions = batch.get("position_ids") if hasattr(batch, "get") else None
    if torch.is_tensor(positions) and positions.dim() == 2:
        out: list[int] = []
        for row in positions.tolist():
            starts = [i for i, p in enumerate(row) if p == 0] or [0]
            out += [b - a for a, b in zip(starts, starts[1:] + [len(row)]) if b > a]
        return out
    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    if torch.is_tensor(mask) and mask.dim() == 2:
        return [int(n) for n in mask.sum(dim=1).tolist() if n > 0]
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return [int(ids.shape[-1])] * int(ids.shape[0]) if torch.is_tensor(ids) and ids.dim() == 2 else []


class PackingBalanceLog(TrainerCallback):
    """Adds ``packing/imbalance_tokens`` and ``packing/imbalance_compute`` to every training log of a packed
    multi-rank run (attached by the packing integration; ``cost_coeff`` None: tokens only)."""

    def __init__(self, trainer, cost_coeff: float | None) -> None:
        self.trainer, self.cost_coeff = trainer, cost_coeff
        self.windows: list[tuple[float, float]] = []  # this rank's (tokens, cost) per window since the last log
        self.methods = InstanceMethods()  # get_batch_samples and log, wrapped on the trainer for one train()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.methods.all_installed():
            return  # still installed (a train() that ended by an exception)

        def wrap_get_batch_samples(original):
            def get_batch_samples(epoch_iterator, num_batches, *rest, **kw):
                batches, num_items = original(epoch_iterator, num_batches, *rest, **kw)
                if self.methods.live(get_batch_samples) and batches:
                    lengths = [n for batch in batches for n in document_lengths(batch)]
                    cost = float(document_cost(lengths, self.cost_coeff).sum()) if self.cost_coeff is not None else 0.0
                    self.windows.append((float(sum(lengths)), cost))
                return batches, num_items
            return get_batch_samples

        def wrap_log(original):
            def log(logs, *a, **kw):
                if self.methods.live(log) and isinstance(logs, dict) and "loss" in logs and self.windows:
                    logs.update(self._values())
                return original(logs, *a, **kw)
            return log

        self.methods.wrap(self.trainer, "get_batch_samples", wrap_get_batch_samples)
        self.methods.wrap(self.trainer, "log", wrap_log)

    def on_train_end(self, args, state, control, **kwargs):
        self.methods.remove_all()
        self.windows.clear()

    def _values(self) -> dict[str, float]:
        local = torch.tensor(self.windows, dtype=torch.float64, device=self.trainer.args.device)
        self.windows.clear()
        every = self.trainer.accelerator.gather(local.unsqueeze(0)).cpu()  # (ranks, windows, 2)
        mean = every.mean(dim=0)
        ratio = torch.where(mean > 0, every.max(dim=0).values / mean.clamp_min(1e-300), torch.ones_like(mean))
        out = {TOKENS_KEY: round(float(ratio[:, 0].mean()), 4)}
        if self.cost_coeff is not None:
            out[COMPUTE_KEY] = round(float(ratio[:, 1].mean()), 4)
        return out


__all__ = ["COMPUTE_KEY", "PackingBalanceLog", "TOKENS_KEY", "document_lengths"]
