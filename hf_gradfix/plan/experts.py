"""Mixture-of-experts parameters under expert parallelism: which parameters are routed experts, and how many
elements of each a rank holds once transformers has sharded the model (``DistributedConfig(ep_size=...)``).

Pure arithmetic on parameter names and shapes (no torch, no transformers import).

How transformers 5.24 lays a model out with ``ep > 1`` (``transformers/distributed``, tp = cp = 1, the combination
hf_gradfix trains: :func:`hf_gradfix.parallel.ep.check_combination`):

* expert parameters: the ``grouped_gemm`` entries of the config's ``base_model_ep_plan`` (``mlp.experts.gate_up_proj``,
  ``down_proj``, gpt-oss's biases too), shape ``(num_experts, ...)``. ``Shard(0)`` over ``ep`` gives every rank
  ``num_experts / ep`` whole experts, then FSDP2 shards that local tensor's dim 0 over ``efsdp`` (= dp_shard / ep);
  expert mesh ``(dp_replicate, efsdp, ep)``, ``ep`` fastest: rank ``r`` of a replica is ep index ``r % ep``, efsdp
  index ``r // ep``.
* dense parameters (attention, norms, routers, shared experts, the dense MLPs of DeepSeek-V3's first layers,
  embeddings, head): FSDP2 over ``fsdp`` = dp_shard, shard index ``r``.
* FSDP2 pads: dim 0 of ``rows`` rows over ``n`` shards is cut into chunks of ``ceil(rows / n)`` rows (the last ones
  shorter, or empty), and every shard's storage is allocated at the full chunk size (torch's ``FSDPParam``:
  ``padded_sharded_param_size``; the reduce-scatter output that holds the gradients is padded the same way). The
  parameter a rank sees (``p.to_local()``) and the optimizer state built from it are the unpadded rows.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

__all__ = ["EXPERT_COUNT_KEYS", "moe_shape", "expert_patterns", "is_expert_param", "fsdp2_rows", "ep_rank_split"]

#: config keys transformers' MoE families name their routed expert count by (as parallel.dims)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
#: config keys of the experts each token is routed to
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


def _text(config):
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return text if text is not None else config


def moe_shape(config) -> tuple[int, int] | None:
    """``(routed experts, experts per token)`` of a mixture-of-experts config, None for a dense one.

    >>> from types import SimpleNamespace as C
    >>> moe_shape(C(num_experts=128, num_experts_per_tok=8)), moe_shape(C(n_routed_experts=256, num_experts_per_tok=8))
    ((128, 8), (256, 8))
    >>> moe_shape(C(hidden_size=64)) is None
    True
    """
    for cfg in (config, _text(config)):
        experts = next((getattr(cfg, k) for k in EXPERT_COUNT_KEYS
                        if isinstance(getattr(cfg, k, None), int) and not isinstance(getattr(cfg, k), bool)
                        and getattr(cfg, k) > 0), None)
        if experts is not None:
            top_k = next((getattr(cfg, k) for k in TOP_K_KEYS if isinstance(getattr(cfg, k, None), int)), 1)
            return experts, int(top_k)
    return None


def expert_patterns(config) -> list[str]:
    """The parameter-name patterns of the routed experts: the ``grouped_gemm`` entries of the config's
    ``base_model_ep_plan`` (the plan transformers shards by expert with), ``*`` standing for a layer index.

    >>> from types import SimpleNamespace as C
    >>> expert_patterns(C(base_model_ep_plan={"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    ...                                       "layers.*.mlp.experts": "ep_dispatch_experts"}))
    ['layers.*.mlp.experts.gate_up_proj']
    """
    for cfg in (config, _text(config)):
        plan = getattr(cfg, "base_model_ep_plan", None)
        if isinstance(plan, dict) and plan:
            return [k for k, v in plan.items() if v == "grouped_gemm"]
    return []


def is_expert_param(name: str, shape: tuple[int, ...], patterns: Iterable[str], num_experts: int | None) -> bool:
    """Whether parameter ``name`` holds routed experts: it matches an ep-plan pattern (as a dotted suffix: a VLM's
    ``model.language_model.layers.0...`` too); without an ep plan, a tensor under an ``experts`` module (not a shared
    expert) whose dim 0 is the routed expert count.

    >>> is_expert_param("model.layers.3.mlp.experts.down_proj", (8, 16, 4), ["layers.*.mlp.experts.down_proj"], 8)
    True
    >>> is_expert_param("model.layers.3.mlp.shared_experts.down_proj.weight", (16, 4), ["layers.*.mlp.experts.down_proj"], 8)
    False
    >>> is_expert_param("model.layers.0.block_sparse_moe.experts.w1", (8, 16, 4), [], 8)   # no ep plan: by shape
    True
    """
    patterns = list(patterns)
    if patterns:
        for pat in patterns:
            rx = r"(?:^|\.)" + re.escape(pat).replace(r"\*", r"\d+") + "$"
            if re.search(rx, name):
                return True
        return False
    parts = name.split(".")
    return (num_experts is not None and len(shape) >= 2 and shape[0] == num_experts and "experts" in parts[:-1]
            and not any("shared" in p for p in parts))


def fsdp2_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """``(rows shard index holds, rows its storage is padded to)`` when FSDP2 cuts dim 0 of ``rows`` over ``shards``
    (``torch.chunk``'s cut: chunks of ``ceil(rows / shards)``, the last ones short or empty).

    >>> [fsdp2_rows(97, 2, i) for i in range(2)]       # a vocabulary of 97 over 2 ranks: 49 + 48, both padded to 49
    [(49, 49), (48, 49)]
    >>> [fsdp2_rows(5, 4, i)[0] for i in range(4)]     # chunks of 2: the last shard is empty
    [2, 2, 1, 0]
    """
    if shards < 1 or not 0 <= index < shards:
        raise ValueError(f"fsdp2_rows: shard {index} of {shards}")
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - index * chunk)), chunk


def ep_rank_split(params, *, ep: int, efsdp: int, fsdp: int, rank: int) -> dict:
    """Elements of rank ``rank`` (its index inside one data-parallel replica) under expert parallelism, split into
    routed experts and the rest: ``expert_local`` / ``dense_local`` (what ``p.to_local()`` holds, summed) and
    ``expert_padded`` / ``dense_padded`` (FSDP2's padded shard storage, the same on every rank of a group).

    ``params``: rows with ``shape`` and ``expert`` (:func:`hf_gradfix.plan.estimate.param_table`).

    >>> from types import SimpleNamespace as P
    >>> rows = [P(shape=(6, 32, 16), expert=True), P(shape=(97, 32), expert=False)]
    >>> ep_rank_split(rows, ep=2, efsdp=1, fsdp=2, rank=1)   # 3 whole experts; 48 of the 97 rows, padded to 49
    {'expert_local': 1536, 'expert_padded': 1536, 'dense_local': 1536, 'dense_padded': 1568}
    """
    out = {"expert_local": 0, "expert_padded": 0, "dense_local": 0, "dense_padded": 0}
    ep_index, efsdp_index, fsdp_index = rank % ep, (rank // ep) % efsdp, rank % fsdp
    for p in params:
        shape = tuple(p.shape)
        if not shape:
            shape = (1,)
        rest = math.prod(shape[1:])
        if p.expert:
            # Shard(0) over ep (whole experts), then FSDP2 over efsdp on the ep-local tensor
            ep_rows = fsdp2_rows(shape[0], ep, ep_index)[0]
            local, padded = fsdp2_rows(ep_rows, efsdp, efsdp_index)
            out["expert_local"] += local * rest
            out["expert_padded"] += padded * rest
        else:
            local, padded = fsdp2_rows(shape[0], fsdp, fsdp_index)
            out["dense_local"] += local * rest
            out["dense_padded"] += padded * rest
    return out
