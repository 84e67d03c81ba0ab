"""The pure math of hf_gradfix.loss (no transformers): counting, window scaling, probes on synthetic losses."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_gradfix.loss.counting import (
    CountRule,
    count_targets,
    mean_term_share,
    window_loss_from_mean,
    window_loss_from_sum,
)
from hf_gradfix.loss.probe import ProbeError, detect_count_rule, probe_honors_num_items, probe_loss


def test_the_loss_package_imports_neither_transformers_nor_accelerate():
    code = "import sys, hf_gradfix.loss.counting, hf_gradfix.loss.probe; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_count_rules():
    labels = torch.tensor([[-100, 5, 6, 7], [8, 9, -100, -100]])
    assert int(count_targets({"labels": labels}, CountRule.SHIFTED)) == 4
    assert int(count_targets({"labels": labels}, CountRule.UNSHIFTED)) == 5
    assert int(count_targets({"labels": torch.tensor([0, 2, 1])}, "elements")) == 3
    assert int(count_targets({"labels": labels, "shift_labels": torch.tensor([[1, -100]])}, "shifted")) == 1
    assert int(count_targets({"input_ids": labels}, "shifted")) == 0


def test_window_normalization_reproduces_the_global_token_mean():
    # Two ranks, two micro-batches each: per-token losses of very different counts.
    torch.manual_seed(0)
    tokens = [[torch.rand(n) for n in (3, 17)], [torch.rand(n) for n in (40, 1)]]
    global_count = sum(t.numel() for rank in tokens for t in rank)
    truth = torch.cat([t for rank in tokens for t in rank]).mean()
    world = len(tokens)
    # what each replica back-propagates, then DDP's average over replicas
    from_mean = sum(window_loss_from_mean(t.mean(), t.numel(), global_count, world) for rank in tokens for t in rank) / world
    from_sum = sum(window_loss_from_sum(t.sum(), global_count, world) for rank in tokens for t in rank) / world
    assert torch.allclose(from_mean, truth, rtol=1e-6) and torch.allclose(from_sum, truth, rtol=1e-6)
    # the classic bug, for contrast: mean of micro-batch means
    classic = torch.stack([t.mean() for rank in tokens for t in rank]).mean()
    assert abs(float(classic - truth)) > 1e-2
    aux = [torch.tensor(1.0), torch.tensor(3.0)]
    assert float(sum(mean_term_share(a, 2) for a in aux)) == 2.0


def _ce_loss(shift: bool, honours: bool, aux: float = 0.0):
    torch.manual_seed(0)
    table = torch.randn(50, 11)

    def loss_fn(batch, n):
        labels = batch["labels"]
        logits = table[: labels.shape[-1]].unsqueeze(0).expand(labels.shape[0], -1, -1)
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        flat = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum")
        if honours and n is not None:
            return flat / n + aux
        return flat / labels.ne(-100).sum() + aux

    return loss_fn


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("honours", [True, False])
def test_probes_find_how_a_loss_is_normalized(shift, honours):
    batch = {"labels": torch.tensor([[-100, 3, 4, 5, -100], [1, 2, -100, -100, -100]])}
    behaviour = probe_loss(_ce_loss(shift, honours), batch)
    assert behaviour.honors_num_items is honours
    assert behaviour.count_rule is (CountRule.SHIFTED if shift else CountRule.UNSHIFTED)


def test_probe_recovers_an_additive_aux_term():
    honours, additive = probe_honors_num_items(_ce_loss(True, True, aux=0.25), {"labels": torch.tensor([[1, 2, 3]])})
    assert honours and math.isclose(additive, 0.25, rel_tol=1e-5)


def test_probe_rejects_a_loss_that_is_not_sum_over_count():
    def sqrt_loss(batch, n):
        return batch["labels"].float().sum() / (1.0 if n is None else float(n) ** 0.5)

    with pytest.raises(ProbeError, match="not as sum/num_items"):
        probe_honors_num_items(sqrt_loss, {"labels": torch.tensor([[1, 2, 3]])})


def test_sequence_level_labels_count_elements():
    rule, _ = detect_count_rule(lambda b, n: torch.tensor(1.0), {"labels": torch.tensor([1, 0])}, honors=False)
    assert rule is CountRule.ELEMENTS
