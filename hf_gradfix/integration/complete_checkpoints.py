"""Checkpoints a crash cannot tear: ``resume_from_checkpoint=True`` resumes from the newest COMPLETE checkpoint.

Stock transformers writes ``checkpoint-N`` file by file (weights, optimizer, scheduler, RNG, then
``trainer_state.json``); a SIGKILL or a full disk in between leaves the newest folder incomplete, and
``resume_from_checkpoint=True`` picks it (``get_last_checkpoint``: the highest N) and fails, e.g. with
``FileNotFoundError: trainer_state.json``, or worse loads a half-written optimizer state.

With hf_gradfix every process writes ``hf_gradfix_complete_rank{r}.json`` (step, world size) after ITS last file of the
checkpoint (the RNG state, after which the plugin's stream / router state, :mod:`.trainer_fix`), written aside and
renamed, so the marker exists only whole; then every process waits for the others (``wait_for_everyone``), so
rank 0 writes ``trainer_state.json`` and rotates older checkpoints away only once every rank's marker is there. A checkpoint is complete when ``trainer_state.json`` parses with its step and every rank's marker is there (a
folder without any marker, written by stock transformers or with ``save_only_model``, counts as complete when its
``trainer_state.json`` parses). :func:`resume_path` replaces ``True`` by the newest complete one, with a warning naming
each newer incomplete folder it skips.

Not covered: a user calling transformers' ``get_last_checkpoint`` directly; with ``save_total_limit=1`` a crash
between rank 0's ``trainer_state.json`` and the end of its rotation (the older folder half deleted) leaves the new,
complete one.

>>> import tempfile, os, json
>>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "checkpoint-2"))
>>> complete(os.path.join(d, "checkpoint-2"))[0]   # nothing written yet
False
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

logger = logging.getLogger("hf_gradfix")

MARKER = "hf_gradfix_complete_rank{rank}.json"
_MARKER_RE = re.compile(r"^hf_gradfix_complete_rank(\d+)\.json$")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def mark(trainer: Any, output_dir: str) -> None:
    """This process's marker: written to a temporary name, flushed to disk, then renamed (atomic on POSIX)."""
    args = trainer.args
    rank = int(getattr(args, "process_index", 0) or 0)
    data = {"step": int(trainer.state.global_step), "world_size": int(getattr(args, "world_size", 1) or 1),
            "rank": rank}
    path = os.path.join(output_dir, MARKER.format(rank=rank))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _step_of(folder: str) -> int | None:
    m = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


def complete(folder: str) -> tuple[bool, str]:
    """(whether ``folder`` is a complete checkpoint, why not)."""
    step = _step_of(folder)
    try:
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return False, "no trainer_state.json (the save stopped before its end)"
    except (OSError, ValueError) as err:
        return False, f"trainer_state.json is not whole ({type(err).__name__})"
    if step is not None and state.get("global_step") != step:
        return False, f"trainer_state.json holds step {state.get('global_step')}, not {step}"
    markers = {}
    for name in os.listdir(folder):
        m = _MARKER_RE.match(name)
        if m:
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as fh:
                    markers[int(m.group(1))] = json.load(fh)
            except (OSError, ValueError):
                return False, f"{name} is not whole"
    if not markers:
        return True, ""  # written without hf_gradfix's markers (stock, save_only_model): its own last file is whole
    world = max(int(m.get("world_size", 1)) for m in markers.values())
    missing = sorted(set(range(world)) - set(markers))
    if missing:
        return False, f"process(es) {missing} of {world} did not finish their part (no {MARKER.format(rank=missing[0])})"
    return True, ""


def resume_path(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` of ``output_dir`` (None when there is none), warning for each newer
    incomplete one it skips."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    found = sorted(((int(m.group(1)), n) for n in names if (m := _CHECKPOINT_RE.match(n))
                    and os.path.isdir(os.path.join(output_dir, n))), reverse=True)
    for _, name in found:
        folder = os.path.join(output_dir, name)
        ok, why = complete(folder)
        if ok:
            return folder
        logger.warning("hf_gradfix: resume_from_checkpoint=True skips %s: incomplete, %s (a crash or a full disk "
                       "during that save); resuming from the newest complete checkpoint before it", folder, why)
    return None


def resolve(trainer: Any, resume_from_checkpoint: Any) -> Any:
    """What ``Trainer.train`` should get for ``resume_from_checkpoint``: ``True`` becomes the newest complete
    checkpoint (one line when there is none, as stock's own error); an explicit folder hf_gradfix wrote that is
    incomplete is refused (a folder without its markers is left to stock)."""
    from ..errors import UsageError

    if resume_from_checkpoint is True:
        path = resume_path(trainer.args.output_dir)
        if path is None:
            raise ValueError(f"No valid checkpoint found in output directory ({trainer.args.output_dir}): no complete "
                             "checkpoint-N (hf_gradfix skips the incomplete ones, see the warnings above)")
        return path
    folder = os.fspath(resume_from_checkpoint) if isinstance(resume_from_checkpoint, (str, os.PathLike)) else None
    # only a folder hf_gradfix wrote (it holds a marker): any other is stock's to load as it does (a weights-only
    # folder warm-starts there without trainer_state.json; never stricter than stock)
    if folder is not None and os.path.isdir(folder) and any(_MARKER_RE.match(n) for n in os.listdir(folder)):
        ok, why = complete(folder)
        if not ok:
            raise UsageError(f"resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r} is incomplete: {why}; "
                             "resume from an older checkpoint (or resume_from_checkpoint=True: the newest complete one)")
    return resume_from_checkpoint
