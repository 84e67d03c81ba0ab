"""The error of the ND-parallel glue, apart so that the sharded checkpoints (:mod:`hf_gradfix.integration.checkpoints`),
which the pipeline glue imports, can raise it without importing the ND setup (:mod:`.nd`) that raises it too.
"""

from __future__ import annotations

from ...errors import HfGradfixError

__all__ = ["NDParallelError"]


class NDParallelError(HfGradfixError, RuntimeError):
    """An ND-parallel setup hf_gradfix cannot run exactly; the message says why and what to do."""
