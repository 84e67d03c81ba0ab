"""Moved to :mod:`hf_gradfix.integration.rl.packing` (TRL's policy-gradient glue lives in ``integration/rl/``); this
documented path re-exports its names."""

from .rl.packing import (  # noqa: F401
    PackedChunk,
    RLPacking,
    attach,
    pack_chunk,
    packed_per_token_logps,
    rl_packing_of,
    unpackable_reason,
)

__all__ = ["PackedChunk", "RLPacking", "attach", "pack_chunk", "packed_per_token_logps", "rl_packing_of",
           "unpackable_reason"]
