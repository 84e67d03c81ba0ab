"""The host-sync counter (hf_gradfix.diagnostics.host_syncs) and the plugin's bound on the syncs it adds.

* Ground truth: hand-written functions with a known number of device-to-host syncs (and reads of host-resident
  tensors that must not count) are counted exactly, each sync attributed to this file.
* The plain Trainer path (GA 4): the patched run's steady-state syncs per optimizer window exceed stock's by at most
  ``PLAIN_EXTRA_PER_WINDOW`` (docs/testing.md, "Host syncs per path"): none per micro-batch.
* Control: a planted ``.item()`` in the plugin's per-micro-batch loss (``train_loss``) adds GA syncs per window, and
  the same check fails on it.
"""

from __future__ import annotations

import pytest
import torch

import host_sync_runs as S
from hf_gradfix.diagnostics.host_syncs import HostSyncCounter, owner_of_frame

PLAIN_EXTRA_PER_WINDOW = 1  # the window's count, read with the non-finite guard's verdict (docs/testing.md)


def _three_syncs(x: torch.Tensor) -> float:
    a = float(x.sum())  # 1
    mask = x > 0
    b = x[mask]  # 2: a boolean-mask index
    c = torch.nonzero(b)  # 3: a data-dependent size
    host = x.detach().to("cpu")  # 4: brought to the host
    return a + host.tolist()[0] + int(host[0]) + c.shape[0]  # reads of a host copy: free


def _no_syncs(x: torch.Tensor) -> torch.Tensor:
    made_here = torch.tensor([1.0, 2.0])  # no device: host-resident, as a GPU run would have it
    n = int(made_here.sum())  # free
    y = x * 2 + x.sum() / x.numel()  # device math: no read
    y = torch.where(x > 0, y, torch.zeros_like(y))
    return y.to(torch.float64)[:n]


def test_counter_counts_known_syncs_exactly():
    x = torch.randn(16)  # made before the counter: device-resident
    with HostSyncCounter() as counter:
        _three_syncs(x)
        _no_syncs(x)
        for _ in range(3):
            bool(x.any())
    assert counter.total == 4 + 3, counter.sites()
    assert counter.ops() == {"__float__": 1, "__getitem__[bool]": 1, "nonzero": 1, "to": 1, "__bool__": 3}
    assert counter.by_owner() == {"user": 7}
    assert all(e.where.startswith(__file__) for e in counter.events)


def test_counter_attributes_frames_to_their_package():
    assert owner_of_frame("/venv/lib/python3.11/site-packages/hf_gradfix/integration/trainer/loss.py") == "hf_gradfix"
    assert owner_of_frame("/venv/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py") == "trl"
    assert owner_of_frame("/repo/benchmarks/bench.py") == "user"


@pytest.fixture(scope="module")
def stock_plain():
    return [S.plain(False, n) for n in (1, 2)]


def _extra_per_window(stock, patched) -> float:
    return (patched[1].total - patched[0].total) - (stock[1].total - stock[0].total)


def test_plain_trainer_adds_no_sync_per_micro_batch(stock_plain):
    patched = [S.plain(True, n) for n in (1, 2)]
    extra = _extra_per_window(stock_plain, patched)
    assert extra <= PLAIN_EXTRA_PER_WINDOW, (extra, patched[1].plugin_sites)
    # the plugin's own reads are the window's, not the micro-batches'
    assert all(n <= 2 for site, n in patched[1].plugin_sites.items() if "probe" not in site), patched[1].plugin_sites


def test_a_planted_per_micro_batch_read_fails_the_check(stock_plain, monkeypatch):
    from hf_gradfix.integration.trainer import loss as loss_module

    original = loss_module.train_loss

    def planted(*args, **kwargs):
        loss, outputs = original(*args, **kwargs)
        loss.detach().sum().item()  # the planted sync, once per micro-batch
        return loss, outputs

    monkeypatch.setattr(loss_module, "train_loss", planted)
    patched = [S.plain(True, n) for n in (1, 2)]
    extra = _extra_per_window(stock_plain, patched)
    assert extra == PLAIN_EXTRA_PER_WINDOW + S.GA, extra
    assert not extra <= PLAIN_EXTRA_PER_WINDOW
