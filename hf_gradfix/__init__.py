"""hf_gradfix: exact loss normalization for the Hugging Face training stack.

Three ways in:

- ``hf_gradfix.patch()`` once, before building a ``transformers.Trainer`` (or TRL trainer);
- ``trainer.add_callback(hf_gradfix.GradFixCallback())`` for one trainer;
- a configuration (``hf_gradfix.GradFixConfig``, a dict, or the ``hf_gradfix:`` section of a YAML file).

>>> import hf_gradfix
>>> cfg = hf_gradfix.patch()
>>> hf_gradfix.is_patched()
True
>>> hf_gradfix.unpatch()
"""

from __future__ import annotations

import logging as _logging

from .config import ConfigError, GradFixConfig, LossConfig, load_config
from .errors import HfGradfixError

__version__ = "0.1.0"

#: Set to 1 to see the plugin's log lines from every rank (each prefixed with its rank); by default only rank 0
#: (``$RANK``, set by torchrun / accelerate / hf-gradfix launch) prints, plus errors from any rank.
ALL_RANKS_ENV = "HF_GRADFIX_ALL_RANKS"


class _RankZeroFilter(_logging.Filter):
    """One copy of each line under a multi-process launch: rank 0's (every rank's with ``HF_GRADFIX_ALL_RANKS=1``;
    errors always).

    >>> import logging; r = logging.LogRecord("hf_gradfix", logging.INFO, "", 0, "x", None, None)
    >>> _RankZeroFilter().filter(r), r.hf_gradfix_rank   # one process: no rank prefix
    (True, '')
    """

    def filter(self, record: _logging.LogRecord) -> bool:
        import os

        raw = os.environ.get("RANK", "0") or "0"
        rank = int(raw) if raw.isdigit() else 0
        every = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
        record.hf_gradfix_rank = f" [rank {rank}]" if rank or (every and "WORLD_SIZE" in os.environ) else ""
        return rank == 0 or every or record.levelno >= _logging.ERROR


_logger = _logging.getLogger("hf_gradfix")
if not _logger.handlers:
    # One visible line per fixed trainer by default; silence with config `log_fixes: false`.
    _handler = _logging.StreamHandler()
    _handler.addFilter(_RankZeroFilter())
    _handler.setFormatter(_logging.Formatter("[%(name)s]%(hf_gradfix_rank)s %(levelname)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False


def __getattr__(name: str):
    # The integration layer imports transformers; load it only when asked for.
    if name in ("patch", "unpatch", "is_patched"):
        from .integration import patching

        return getattr(patching, name)
    if name == "GradFixCallback":
        from .integration.callback import GradFixCallback

        return GradFixCallback
    if name == "GradFixError":
        from .errors import GradFixError

        return GradFixError
    if name == "state_of":
        from .integration.state import state_of

        return state_of
    if name in ("install", "uninstall"):
        from .integration.trainer import class_swap

        return getattr(class_swap, name)
    if name == "verify_trainer":
        from .verify.trainer import verify_trainer

        return verify_trainer
    if name == "VerifyReport":
        from .verify.report import VerifyReport

        return VerifyReport
    if name == "TokenWindow":
        from .loss.window import TokenWindow

        return TokenWindow
    if name == "GradientNoiseScaleCallback":
        from .integration.diagnostics.gns import GradientNoiseScaleCallback

        return GradientNoiseScaleCallback
    if name == "MemoryTimelineCallback":
        from .integration.diagnostics.memory_timeline import MemoryTimelineCallback

        return MemoryTimelineCallback
    if name == "MemoryTimelineRecorder":
        from .diagnostics.memory_timeline import MemoryTimelineRecorder

        return MemoryTimelineRecorder
    if name in ("NoiseScaleMonitor", "NoiseScaleEstimator"):
        from .diagnostics import noise_scale

        return getattr(noise_scale, name)
    raise AttributeError(f"module 'hf_gradfix' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "GradFixCallback",
    "GradFixConfig",
    "GradFixError",
    "GradientNoiseScaleCallback",
    "HfGradfixError",
    "LossConfig",
    "MemoryTimelineCallback",
    "MemoryTimelineRecorder",
    "is_patched",
    "load_config",
    "NoiseScaleEstimator",
    "NoiseScaleMonitor",
    "state_of",
    "TokenWindow",
    "patch",
    "unpatch",
    "verify_trainer",
    "VerifyReport",
]
