"""galore-torch's documented recipe works unchanged with hf_gradfix's GaLoreAdamW (issue 17, item 5).

galore-torch's README builds two groups, ``[{"params": regular}, {"params": galore_params, "rank": 128,
"update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}]``, and projects exactly the group that has a
``rank``.  The reference here is galore-torch 1.0 itself, run on the same model and gradients.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import optim_refs as R
from hf_gradfix.optim import GaLoreAdamW, OptimizerConfigError


@pytest.fixture(scope="module")
def galore_ref():
    try:
        return R.load_reference("galore_torch", "adamw")
    except ImportError:  # pragma: no cover - the reference is a test dependency
        pytest.skip("galore-torch is not installed")


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=160, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _readme_groups(model):
    """galore-torch's README / torchrun_main.py recipe, verbatim in spirit: nn.Linear modules whose name contains
    'attn' or 'mlp' are GaLore params, everything else is regular."""
    galore_params = []
    target_modules_list = ["attn", "mlp"]
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if not any(target_key in module_name for target_key in target_modules_list):
            continue
        galore_params.append(module.weight)
    id_galore_params = [id(p) for p in galore_params]
    regular_params = [p for p in model.parameters() if id(p) not in id_galore_params]
    return [{"params": regular_params},
            {"params": galore_params, "rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}]


def _step_both(ma, oa, mb, ob, steps: int):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 256, (2, 24), generator=g)
        for m in (ma, mb):
            m.zero_grad(set_to_none=True)
        ma(input_ids=ids, labels=ids).loss.backward()
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = pa.grad.clone()
        oa.step()
        ob.step()


def test_readme_recipe_projects_what_galore_torch_projects(galore_ref):
    ma = _tiny_llama()
    mb = copy.deepcopy(ma)
    ours = GaLoreAdamW(_readme_groups(ma), lr=0.01)  # unchanged recipe, our class
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = galore_ref.AdamW(_readme_groups(mb), lr=0.01, no_deprecation_warning=True)
    _step_both(ma, ours, mb, ref, 2)
    ref_projected = {n for (n, _), pb in zip(ma.named_parameters(), mb.parameters()) if "projector" in ref.state[pb]}
    ours_projected = {n for n, p in ma.named_parameters() if ours.is_projected(p)}
    assert ours_projected == ref_projected and len(ours_projected) == 14  # 2 layers x (4 attn + 3 mlp)
    # embeddings, norms and the head are plain AdamW (galore-torch never projects a group without rank)
    assert not ours.is_projected(ma.model.embed_tokens.weight) and not ours.is_projected(ma.lm_head.weight)
    g = next(g for g in ours.param_groups if g["project"])
    assert (g["rank"], g["update_proj_gap"], g["scale"], g["proj_side"]) == (128, 200, 0.25, "std")
    # the same moment shapes as galore-torch's std rule (reduce the smaller side)
    for (n, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        if n in ours_projected:
            assert ours.state[pa]["exp_avg"].shape == ref.state[pb]["exp_avg"].shape, n


def test_readme_recipe_trajectory_equals_galore_torch(galore_ref):
    """With galore-torch's arithmetic and defaults (eps 1e-6, no weight decay), the README recipe's trajectory is
    galore-torch's, over steps that include a basis refresh."""
    ma = _tiny_llama()
    mb = copy.deepcopy(ma)
    init = R.snapshot(mb)
    groups_a, groups_b = _readme_groups(ma), _readme_groups(mb)
    groups_a[1]["update_proj_gap"] = groups_b[1]["update_proj_gap"] = 3
    ours = GaLoreAdamW(groups_a, lr=0.01, eps=1e-6, weight_decay=0.0, compat="galore_torch", proj_method="svd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = galore_ref.AdamW(groups_b, lr=0.01, no_deprecation_warning=True)
    _step_both(ma, ours, mb, ref, 5)
    diffs = R.max_rel_change_diff(ma, mb, init)
    assert max(diffs.values()) <= 1e-6, diffs


def test_group_without_rank_is_plain_when_another_group_has_rank():
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    opt = GaLoreAdamW([{"params": [m[0].weight]}, {"params": [m[1].weight], "rank": 4}], lr=1e-3)
    assert not opt.is_projected(m[0].weight) and opt.is_projected(m[1].weight)
    # no group names a rank: every group is projected at the constructor's rank (hf_gradfix's own form)
    opt = GaLoreAdamW([{"params": [m[0].weight]}, {"params": [m[1].weight]}], lr=1e-3, rank=4)
    assert opt.is_projected(m[0].weight) and opt.is_projected(m[1].weight)
    # an explicit project key wins
    opt = GaLoreAdamW([{"params": [m[0].weight], "project": True}, {"params": [m[1].weight], "rank": 4}], lr=1e-3, rank=2)
    assert opt.is_projected(m[0].weight) and opt.param_groups[0]["rank"] == 2


def test_proj_type_full_is_refused_with_the_key():
    m = nn.Linear(16, 16)
    with pytest.raises(OptimizerConfigError, match="proj_type='full'"):
        GaLoreAdamW([{"params": [m.weight], "rank": 4, "proj_type": "full"}], lr=1e-3)
