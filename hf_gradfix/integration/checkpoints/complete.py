"""Checkpoints a crash cannot tear: ``resume_from_checkpoint=True`` resumes from the newest COMPLETE checkpoint.

Stock transformers writes ``checkpoint-N`` file by file (weights, optimizer, scheduler, RNG, then
``trainer_state.json``); a SIGKILL or a full disk in between leaves the newest folder incomplete, and
``resume_from_checkpoint=True`` picks it (``get_last_checkpoint``: the highest N) and fails, e.g. with
``FileNotFoundError: trainer_state.json``, or worse loads a half-written optimizer state.

With hf_gradfix a save of ``checkpoint-N`` (the fixed trainer's ``_save_checkpoint``, :mod:`hf_gradfix.integration.trainer.saving`) writes,
in this order:

1. ``hf_gradfix_checkpoint.json`` (step, world size, no file list yet), by every process, before anything else: a
   folder that holds it is the plugin's save, whatever stopped it;
2. the Trainer's own files (weights, optimizer, scheduler, RNG, the plugin's stream / router state);
3. ``hf_gradfix_complete_rank{r}.json`` (step, world size) by every process after ITS last file; every process then
   waits for the others (``wait_for_everyone``);
4. ``hf_gradfix_checkpoint.json`` again, by the main process: now with every file of the folder and its size;
5. ``trainer_state.json`` (rank 0), then rotation of older checkpoints (so rotation never removes the last complete
   checkpoint while the new one can still be torn).

Each of our files is written aside and renamed, so it exists only whole. A checkpoint the plugin wrote is complete
when every process marked its part, every file the list names is there with its size, ``trainer_state.json``
parses, and all of them hold the folder's step. A folder without our files (stock transformers, ``save_only_model``)
counts as complete when its ``trainer_state.json`` parses with its step, as before; an explicit one is left to stock.

:func:`resume_path` replaces ``True`` by the newest complete one, with one warning naming each newer incomplete
folder it skips; :func:`resolve` refuses, in one line naming the newest complete checkpoint, an explicit folder the
plugin wrote that is incomplete. A full disk during a save is reported as such, naming the folder (left torn).

Not covered: a user calling transformers' ``get_last_checkpoint`` directly; with ``save_total_limit=1`` a crash
between rank 0's ``trainer_state.json`` and the end of its rotation (the older folder half deleted) leaves the new,
complete one.

>>> import tempfile, os, json
>>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "checkpoint-2"))
>>> complete(os.path.join(d, "checkpoint-2"))[0]   # nothing written yet
False
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
from typing import Any

from ...errors import HfGradfixError, InvalidArgumentError, UsageError

logger = logging.getLogger("hf_gradfix")

START = "hf_gradfix_checkpoint.json"
MARKER = "hf_gradfix_complete_rank{rank}.json"
TRAINER_STATE = "trainer_state.json"
_MARKER_RE = re.compile(r"^hf_gradfix_complete_rank(\d+)\.json$")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_SEALED_ATTR = "_gradfix_sealed_checkpoint"

# torch.save's zip writer reports a failed write without its errno (``unexpected pos 64 vs 0``,
# ``basic_ios::clear: iostream error``, ``file write failed``): taken for a full disk only while the disk is full.
_WRITE_FAILED = ("unexpected pos", "iostream error", "file write failed", "failed writing")
_FULL_BELOW = 16 * 1024**2  # bytes free on the checkpoint's file system that count as full, after a failed write


class DiskFullError(HfGradfixError, OSError):
    """A checkpoint save ran out of disk space (``errno`` ENOSPC or EDQUOT); the message names the torn folder."""


def _rank(trainer: Any) -> int:
    return int(getattr(trainer.args, "process_index", 0) or 0)


def _world(trainer: Any) -> int:
    return int(getattr(trainer.args, "world_size", 1) or 1)


def _write_json(path: str, data: dict, tmp: str) -> None:
    """``data`` to ``path`` whole or not at all: written to ``tmp``, flushed to disk, renamed (atomic on POSIX)."""
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def checkpoint_folder(trainer: Any, trial: Any) -> str | None:
    """The folder ``Trainer._save_checkpoint`` writes for the current step (None where this transformers has no
    ``_get_output_dir``: the save is then left as stock writes it)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    get_output_dir = getattr(trainer, "_get_output_dir", None)
    if get_output_dir is None:
        return None
    return os.path.join(get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


def begin(trainer: Any, folder: str) -> None:
    """Every process, before the save writes anything: the start file (this save is the plugin's, its file list not
    yet known); this process's marker of an earlier save of the same step is removed first (a folder reused after a
    torn save), and on the main process an earlier ``trainer_state.json``."""
    os.makedirs(folder, exist_ok=True)
    rank = _rank(trainer)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, MARKER.format(rank=rank)))
    if trainer.args.should_save:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, TRAINER_STATE))
    data = {"step": int(trainer.state.global_step), "world_size": _world(trainer), "files": None}
    path = os.path.join(folder, START)
    _write_json(path, data, f"{path}.tmp{rank}")


def mark(trainer: Any, output_dir: str) -> None:
    """This process's marker: every file it writes into the checkpoint is written (and flushed by its writer)."""
    rank = _rank(trainer)
    data = {"step": int(trainer.state.global_step), "world_size": _world(trainer), "rank": rank}
    path = os.path.join(output_dir, MARKER.format(rank=rank))
    _write_json(path, data, path + ".tmp")


def _ours(rel: str) -> bool:
    name = os.path.basename(rel)
    return (rel == TRAINER_STATE or name == START or name.startswith(START + ".tmp") or bool(_MARKER_RE.match(name))
            or (name.startswith("hf_gradfix_complete_rank") and name.endswith(".tmp")))


def _listing(folder: str) -> dict[str, int]:
    """Every file under ``folder`` but ours and ``trainer_state.json``: relative path -> size in bytes."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if not _ours(rel):
                files[rel] = os.path.getsize(path)
    return files


def seal(trainer: Any, output_dir: str) -> None:
    """The main process, once every process marked its part: the start file rewritten with the folder's files and
    their sizes (what a complete checkpoint must still hold when it is resumed)."""
    path = os.path.join(output_dir, START)
    if not trainer.args.should_save or not os.path.isfile(path):
        return
    data = {"step": int(trainer.state.global_step), "world_size": _world(trainer), "files": _listing(output_dir)}
    _write_json(path, data, f"{path}.tmp{_rank(trainer)}")


def _step_of(folder: str) -> int | None:
    m = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


class _NotWhole(Exception):
    pass


def _read(folder: str, name: str) -> dict | None:
    """A JSON object of ``folder`` (None when the file is absent); _NotWhole when it does not parse as one."""
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise _NotWhole(f"{name} is not whole ({type(err).__name__})") from None
    if not isinstance(data, dict):
        raise _NotWhole(f"{name} is not whole (not a JSON object)")
    return data


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def complete(folder: str) -> tuple[bool, str]:
    """(whether ``folder`` is a complete checkpoint, why not)."""
    try:
        return _complete(folder)
    except _NotWhole as err:
        return False, str(err)
    except OSError as err:  # an unreadable folder is not one to resume from
        return False, f"cannot be read ({type(err).__name__}: {err.strerror or err})"


def _complete(folder: str) -> tuple[bool, str]:
    start = _read(folder, START)
    step = _step_of(folder)
    if start is not None and step is None:  # a renamed copy: its own files say which step it holds
        step = _int(start.get("step"))
    names = os.listdir(folder)
    markers = {int(m.group(1)): _read(folder, n) for n in names if (m := _MARKER_RE.match(n))}
    markers = {r: data for r, data in markers.items() if data is not None}  # None: removed since the listing
    if start is not None:
        if _int(start.get("step")) != step:
            return False, f"{START} was written for step {start.get('step')}, not {step}"
        world = _int(start.get("world_size")) or 1
        missing = [r for r in range(world) if r not in markers]
        if missing:
            who = "its end" if world == 1 else f"process(es) {missing[:8]} of {world} wrote all their files"
            return False, f"its save stopped before {who} (no {MARKER.format(rank=missing[0])})"
        if not isinstance(start.get("files"), dict):
            return False, f"its save stopped before the list of its files was written ({START})"
        markers = {r: data for r, data in markers.items() if r < world}  # a larger world's earlier save: not this one's
    elif not markers:  # written without hf_gradfix (stock, save_only_model): its own last file says it is whole
        return _trainer_state(folder, step)
    else:  # markers without the start file: written by an hf_gradfix that wrote no list of files
        world = max(_int(m.get("world_size")) or 1 for m in markers.values())
        missing = sorted(set(range(world)) - set(markers))
        ok, why = _trainer_state(folder, step)
        if not ok:
            return ok, why
        if missing:
            return False, f"process(es) {missing[:8]} of {world} did not finish their part (no {MARKER.format(rank=missing[0])})"
    for rank, marker in sorted(markers.items()):
        if step is not None and _int(marker.get("step")) != step:
            return False, f"{MARKER.format(rank=rank)} was written at step {marker.get('step')}, not {step}"
    if start is not None:
        for rel, size in start["files"].items():
            path = os.path.join(folder, *rel.split("/"))
            try:
                found = os.path.getsize(path)
            except OSError:
                return False, f"{rel} is missing (its save wrote it: {START})"
            if found != size:
                return False, f"{rel} holds {found} bytes, its save wrote {size}"
            if not os.access(path, os.R_OK):
                return False, f"{rel} cannot be read"
        return _trainer_state(folder, step)
    return True, ""


def _trainer_state(folder: str, step: int | None) -> tuple[bool, str]:
    try:
        state = _read(folder, TRAINER_STATE)
    except _NotWhole as err:
        return False, str(err)
    if state is None:
        return False, f"no {TRAINER_STATE} (the save stopped before its end)"
    if step is not None and state.get("global_step") != step:
        return False, f"{TRAINER_STATE} holds step {state.get('global_step')}, not {step}"
    return True, ""


def written_by_plugin(folder: str) -> bool:
    """Whether an hf_gradfix save wrote into ``folder`` (its start file or a marker), finished or not."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return START in names or any(_MARKER_RE.match(n) for n in names)


def _checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (highest N) first."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = sorted(((int(m.group(1)), n) for n in names if (m := _CHECKPOINT_RE.match(n))
                    and os.path.isdir(os.path.join(output_dir, n))), reverse=True)
    return [os.path.join(output_dir, n) for _, n in found]


def _newest_complete(output_dir: str, but: str | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete checkpoint of ``output_dir`` other than ``but``, the newer incomplete ones and why)."""
    skipped = []
    for folder in _checkpoints(output_dir):
        if but is not None and os.path.normpath(folder) == os.path.normpath(but):
            continue
        ok, why = complete(folder)
        if ok:
            return folder, skipped
        skipped.append((folder, why))
    return None, skipped


def resume_path(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` of ``output_dir`` (None when there is none), with one warning naming
    each newer incomplete one it skips."""
    path, skipped = _newest_complete(output_dir)
    if skipped and path is not None:
        logger.warning("hf_gradfix: resume_from_checkpoint=True %s (a crash, a full disk or a file removed since its "
                       "save); resuming from %s, the newest complete checkpoint",
                       "; ".join(f"skips {f}: incomplete, {why}" for f, why in skipped), path)
    return path


def _fix_from(folder: str) -> str:
    """The fix of a refused explicit folder: the newest complete checkpoint beside it."""
    newest, _ = _newest_complete(os.path.dirname(os.path.normpath(folder)), but=folder)
    if newest is not None:
        return f"resume from {newest!r}, the newest complete checkpoint beside it (or resume_from_checkpoint=True)"
    return ("there is no complete checkpoint beside it: train without resume_from_checkpoint (to keep its weights "
            "on purpose, load the model from it with from_pretrained)")


def resolve(trainer: Any, resume_from_checkpoint: Any) -> Any:
    """What ``Trainer.train`` should get for ``resume_from_checkpoint``: ``True`` becomes the newest complete
    checkpoint (one line when there is none); an explicit folder hf_gradfix wrote that is incomplete is refused in one
    line naming the newest complete one beside it (a folder without the plugin's files is left to stock)."""
    if resume_from_checkpoint is True:
        output_dir = trainer.args.output_dir
        path = resume_path(output_dir)
        if path is None:
            _, skipped = _newest_complete(output_dir)
            found = ("; ".join(f"{os.path.basename(f)}: {why}" for f, why in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
                     if skipped else "no checkpoint-N folder")
            raise InvalidArgumentError(
                f"resume_from_checkpoint=True: no complete checkpoint in output_dir {output_dir!r} ({found}); resume "
                "from a folder that holds one, or train without resume_from_checkpoint")
        return path
    folder = os.fspath(resume_from_checkpoint) if isinstance(resume_from_checkpoint, (str, os.PathLike)) else None
    # only a folder hf_gradfix wrote (its start file or a marker): any other is stock's to load as it does (a
    # weights-only folder warm-starts there without trainer_state.json; never stricter than stock)
    if folder is not None and os.path.isdir(folder) and written_by_plugin(folder):
        ok, why = complete(folder)
        if not ok:
            raise UsageError(f"resume_from_checkpoint={folder!r} is incomplete: {why}; {_fix_from(folder)}")
    return resume_from_checkpoint


# ---------------------------------------------------------------------------------------------- a save, whole

def _free_bytes(folder: str) -> int | None:
    path = folder
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    blocks = st.f_bfree if hasattr(os, "geteuid") and os.geteuid() == 0 else st.f_bavail  # root may use the reserve
    return blocks * st.f_frsize


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def no_space(err: BaseException, folder: str) -> str | None:
    """Why ``err`` (raised while saving into ``folder``) is a full disk, else None: its errno (anywhere in its chain,
    or in the text of a writer that keeps only the message, safetensors' ``os error 28``), or torch's zip writer's
    errno-less write failure while the file system of ``folder`` has (almost) no space left."""
    for e in _chain(err):
        code = getattr(e, "errno", None)
        text = str(e)
        if code == errno.ENOSPC or "No space left on device" in text or "os error 28" in text or "StorageFull" in text:
            return "no space left on device"
        if code == getattr(errno, "EDQUOT", None) or "Disk quota exceeded" in text:
            return "no space left on device (disk quota exceeded)"
    if isinstance(err, RuntimeError) and any(s in str(err) for s in _WRITE_FAILED):
        free = _free_bytes(folder)
        if free is not None and free < _FULL_BELOW:
            return f"no space left on device ({free} bytes free)"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def saving(trainer: Any, trial: Any):
    """Around ``Trainer._save_checkpoint`` (every process): the start file first; a full disk during the save
    reported as such (the folder is left torn, unmarked, and named); a chain of ``_save_rng_state`` overrides that
    never reached the plugin's marks and seals its part at the end."""
    folder = checkpoint_folder(trainer, trial)
    if folder is None or getattr(trainer.args, "save_only_model", False):
        yield
        return
    trainer.__dict__.pop(_SEALED_ATTR, None)
    try:
        begin(trainer, folder)
        yield
    except Exception as err:
        why = no_space(err, folder)
        if why is None:
            raise
        ok, state = complete(folder)
        newest, _ = _newest_complete(os.path.dirname(os.path.normpath(folder)), but=folder)
        left = ("it is complete nonetheless" if ok else
                f"it is left torn ({state}): resume_from_checkpoint=True skips it"
                + (f", the newest complete checkpoint is {newest!r}" if newest else ", and no complete checkpoint is left"))
        raise DiskFullError(
            errno.ENOSPC, f"hf_gradfix: {why} while saving checkpoint {folder!r} ({_first_line(err)}); {left}. Free "
            "space on that disk (or lower save_total_limit) and resume") from None
    if _only_ours(folder):  # the save wrote elsewhere (an override of _save_checkpoint): leave no folder of ours
        for name in os.listdir(folder):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    elif trainer.__dict__.pop(_SEALED_ATTR, None) != folder:
        finish(trainer, folder)  # late: an override of _save_rng_state did not call the plugin's


def _only_ours(folder: str) -> bool:
    try:
        return all(_ours(n) and n != TRAINER_STATE for n in os.listdir(folder))
    except OSError:
        return False


def finish(trainer: Any, output_dir: str) -> None:
    """This process's part of the checkpoint is written: its marker; every process then waits for the others (so
    rank 0 writes ``trainer_state.json`` and rotates older checkpoints away only once every rank's part is on disk),
    and the main process seals the folder's file list."""
    mark(trainer, output_dir)
    trainer.accelerator.wait_for_everyone()
    seal(trainer, output_dir)
    trainer.__dict__[_SEALED_ATTR] = output_dir
