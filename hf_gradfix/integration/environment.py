"""Launch-environment checks that turn silent misconfigurations into errors."""

from __future__ import annotations

import os
from typing import Any

from ..errors import GradFixError

__all__ = ["check_launched_world"]


def check_launched_world(trainer: Any) -> None:
    """Refuse a Trainer that was launched as N processes but trains alone.

    On a machine without CUDA, ``accelerate launch`` / torchrun start N processes, but a Trainer whose
    ``TrainingArguments(use_cpu=False)`` builds a non-distributed state in each: N independent copies of the run,
    each on the whole dataset, with no error (measured with accelerate 1.15).

    >>> import types; check_launched_world(types.SimpleNamespace(accelerator=types.SimpleNamespace(num_processes=1)))
    """

    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    accelerator = getattr(trainer, "accelerator", None)
    running = int(getattr(accelerator, "num_processes", 1) or 1)
    if launched > 1 and running == 1:
        raise GradFixError(
            f"WORLD_SIZE={launched} processes were launched, but this Trainer runs as a single process, so each "
            f"process would train its own copy on the whole dataset. On a machine without GPUs set "
            f"TrainingArguments(use_cpu=True) (accelerate's use_cpu YAML key does not reach the ranks on the torchrun path); "
            f"otherwise check that torch.distributed can initialize."
        )
