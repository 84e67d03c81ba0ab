"""The low-rank optimizer machinery shared by GaLoreAdamW and ApolloAdamW (moved to :mod:`.optimizer`)."""

from .optimizer import LowRankAdamW, _full, _is_dtensor, _local, _Plan

__all__ = ["LowRankAdamW"]
