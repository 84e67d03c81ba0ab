"""Checkpoints a crash cannot tear (issues 38, 50): a packed hf_gradfix run killed (SIGKILL) at each phase of a save, or
hitting a full disk, resumes with ``resume_from_checkpoint=True`` from the newest COMPLETE checkpoint and ends
bit-identical to the uninterrupted run; stock transformers' own choice (``get_last_checkpoint``) is the torn folder.
The torn folders, named explicitly, are refused in one line naming the newest complete checkpoint; a checkpoint that
lost a file its save wrote (or holds a marker of another step) is skipped / refused by every way in; a full disk is
reported as such.

One launch of tests/support/crash_save_worker.py (forks a child per run: ~40 s on 2 shared cores); the other runs are a few
optimizer steps in this process."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import hang_bound
import harness as H
from crash_save_worker import PHASES

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker forks")


@pytest.fixture(scope="module")
def crashed():
    out = Path(tempfile.mkdtemp(prefix="hgf_crash_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(H.REPO_ROOT), str(H.REPO_ROOT / "tests" / "support")])}
    proc = hang_bound.run([sys.executable, str(H.REPO_ROOT / "tests" / "support" / "crash_save_worker.py"), str(out), ",".join(PHASES)],
                          env=env, capture_output=True, text=True, step="crash-safe checkpoint worker")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "status.json").read_text()), proc.stderr


@pytest.mark.parametrize("phase", PHASES)
def test_a_save_killed_at_any_phase_resumes_from_the_last_complete_checkpoint_exactly(crashed, phase):
    out, status, log = crashed
    killed = json.loads((out / phase / "killed.json").read_text())
    if phase == "disk":  # the full disk: the run stopped with the OSError, not a signal
        assert status[f"{phase}_killed"] == 0 and "No space left" in json.loads((out / phase / "killed_result.json").read_text())["error"]
    else:
        assert os.WIFSIGNALED(status[f"{phase}_killed"]), status
    assert killed["checkpoint-2"] == [True, ""] and killed["checkpoint-4"][0] is False, killed
    result = json.loads((out / phase / "result.json").read_text())
    assert status[f"{phase}_resumed"] == 0 and result["steps"] == 6, result
    assert result["stock_pick"] == "checkpoint-4"  # the control: stock's get_last_checkpoint picks the torn folder
    assert f"skips {out / phase / 'checkpoint-4'}: incomplete" in log
    straight = torch.load(out / "straight" / "final.pt", weights_only=True)
    resumed = torch.load(out / phase / "final.pt", weights_only=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), phase  # bit-identical
    initial = H.build_model("llama", attn_implementation="sdpa").state_dict()
    assert not all(torch.equal(straight[k], initial[k].to(straight[k].dtype)) for k in straight)  # it trained


PACKING = {"packing": {"enabled": True, "token_budget": 64}}


@pytest.fixture
def unpatched():
    import hf_gradfix

    hf_gradfix.unpatch()
    yield hf_gradfix
    hf_gradfix.unpatch()


@pytest.fixture
def warnings_of_hf_gradfix(caplog):
    import logging

    logger = logging.getLogger("hf_gradfix")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    fa = torch.cat([a[k].flatten().double() for k in sorted(a)])
    fb = torch.cat([b[k].flatten().double() for k in sorted(a)])
    return float((fa - fb).norm() / fb.norm())


def _copy(src: Path, dst: Path, *names: str) -> Path:
    import shutil

    for name in names:
        shutil.copytree(src / name, dst / name)
    return dst


def _resolve_for(output_dir):
    return type("T", (), {"args": type("A", (), {"output_dir": str(output_dir)})()})()


@pytest.mark.parametrize("phase", ["model", "optimizer"])
def test_a_folder_torn_during_the_weights_or_the_optimizer_named_explicitly_is_refused(crashed, phase, tmp_path,
                                                                                       unpatched):
    """Item 9: killed after the weights / after the optimizer (no marker yet), the folder is known as the plugin's own
    save by the start file it wrote first, and refused in one line naming the newest complete checkpoint beside it,
    before anything loads. Before: it went to stock, which loaded its weights and failed with FileNotFoundError
    (trainer_state.json) - the control, stock's own Trainer on the same folder. A torn folder stock wrote (none of
    the plugin's files) keeps stock's behaviour."""
    import crash_save_worker as W
    from hf_gradfix.errors import UsageError
    from hf_gradfix.integration.checkpoints.complete import resolve

    out, _, _ = crashed
    torn = out / "torn" / phase / "checkpoint-4"
    assert not any(n.startswith("hf_gradfix_complete") for n in os.listdir(torn))  # torn before its marker
    unpatched.patch(PACKING)
    trainer = W.trainer_for(tmp_path / "run")
    before = _weights(trainer.model)
    with pytest.raises(UsageError) as refused:
        trainer.train(resume_from_checkpoint=str(torn))
    message = str(refused.value)
    assert "\n" not in message and f"resume_from_checkpoint={str(torn)!r} is incomplete: its save stopped" in message
    assert f"resume from {str(out / 'torn' / phase / 'checkpoint-2')!r}, the newest complete checkpoint" in message
    assert _rel(_weights(trainer.model), before) == 0.0  # refused before anything loaded
    unpatched.unpatch()
    stock = W.trainer_for(tmp_path / "stock")  # the control: stock takes the folder and fails on its last file
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        stock.train(resume_from_checkpoint=str(torn))
    by_stock = _copy(out / "torn" / phase, tmp_path / "by_stock", "checkpoint-4") / "checkpoint-4"
    for name in os.listdir(by_stock):
        if name.startswith("hf_gradfix_"):
            os.remove(by_stock / name)
    assert resolve(_resolve_for(tmp_path / "by_stock"), str(by_stock)) == str(by_stock)  # left to stock


def test_an_explicit_incomplete_checkpoint_is_refused_in_one_line(crashed):
    from hf_gradfix.errors import InvalidArgumentError, UsageError
    from hf_gradfix.integration.checkpoints.complete import resolve

    out, _, _ = crashed
    torn = _copy(out / "straight", out / "refused", "checkpoint-2", "checkpoint-4") / "checkpoint-4"
    (torn / "trainer_state.json").unlink()  # every other file whole: the save stopped before trainer_state.json
    fake = _resolve_for(out / "refused")
    with pytest.raises(UsageError, match="is incomplete: no trainer_state.json .*; resume from '.*checkpoint-2', the "
                                         "newest complete checkpoint beside it"):
        resolve(fake, str(torn))
    weights_only = Path(tempfile.mkdtemp(prefix="hgf_weights_"))  # no hf_gradfix file: left to stock, as stock loads it
    (weights_only / "model.safetensors").write_bytes(b"")
    assert resolve(fake, str(weights_only)) == str(weights_only)
    fake.args.output_dir = tempfile.mkdtemp(prefix="hgf_nockpt_")
    with pytest.raises(InvalidArgumentError, match="resume_from_checkpoint=True: no complete checkpoint in output_dir "
                                                   ".*no checkpoint-N folder"):
        resolve(fake, True)


def test_a_checkpoint_missing_a_file_its_save_wrote_is_skipped_and_the_run_resumes_exactly(crashed, tmp_path, unpatched,
                                                                                            warnings_of_hf_gradfix,
                                                                                            monkeypatch):
    """Item 10: checkpoint-4 is marked complete but its optimizer.pt is gone (before: resumed with a fresh optimizer and
    a restarted schedule, without a word). resume_from_checkpoint=True skips it with one warning and resumes from
    checkpoint-2: the run ends where the uninterrupted run ended (ground truth: its final weights). Control: the same
    resume with the completeness check taken out (the bug planted) takes checkpoint-4 and ends elsewhere."""
    import crash_save_worker as W
    from hf_gradfix.integration.checkpoints import complete as complete_checkpoints

    out, _, _ = crashed
    straight = torch.load(out / "straight" / "final.pt", weights_only=True)
    runs = {}
    for name in ("run", "planted"):
        runs[name] = _copy(out / "straight", tmp_path / name, "checkpoint-2", "checkpoint-4")
        (runs[name] / "checkpoint-4" / "optimizer.pt").unlink()
    unpatched.patch(PACKING)
    trainer = W.trainer_for(runs["run"])
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 6 and _rel(_weights(trainer.model), straight) <= 1e-5
    skips = [r.getMessage() for r in warnings_of_hf_gradfix.records if "skips" in r.getMessage()]
    assert len(skips) == 1 and f"skips {runs['run'] / 'checkpoint-4'}: incomplete, optimizer.pt is missing" in skips[0]
    monkeypatch.setattr(complete_checkpoints, "complete", lambda folder: (True, ""))  # planted: every folder whole
    planted = W.trainer_for(runs["planted"])
    planted.train(resume_from_checkpoint=True)
    assert planted.state.global_step == 6 and _rel(_weights(planted.model), straight) > 1e-3


def test_a_checkpoint_missing_a_file_named_explicitly_is_refused_by_every_way_in(crashed, tmp_path, unpatched):
    """The same folder (marked, optimizer.pt gone) named explicitly: refused in one line naming the newest complete
    checkpoint, under patch(), with GradFixCallback given to the constructor, and with GradFixCallback added by
    add_callback after construction (there train() chose the folder before the trainer was fixed: refused at
    on_train_begin, before the first step). Control: stock's own Trainer resumes from it with a fresh optimizer."""
    import crash_save_worker as W
    from hf_gradfix.errors import UsageError
    from hf_gradfix.integration.callback import GradFixCallbackError

    out, _, _ = crashed
    folder = _copy(out / "straight", tmp_path / "run", "checkpoint-2", "checkpoint-4") / "checkpoint-4"
    (folder / "optimizer.pt").unlink()
    newest = f"resume from {str(tmp_path / 'run' / 'checkpoint-2')!r}, the newest complete checkpoint"

    def refused(trainer, error):
        with pytest.raises(error) as err:
            trainer.train(resume_from_checkpoint=str(folder))
        message = str(err.value)
        assert "\n" not in message and "is incomplete: optimizer.pt is missing" in message and newest in message
        assert trainer.state.global_step in (0, 4)  # no step taken (4: the folder's own state, loaded by stock)
        return message

    unpatched.patch(PACKING)
    refused(W.trainer_for(tmp_path / "patch"), UsageError)
    unpatched.unpatch()
    trainer = W.trainer_for(tmp_path / "init")
    import transformers

    callback_trainer = transformers.Trainer(model=trainer.model, args=trainer.args, train_dataset=trainer.train_dataset,
                                            callbacks=[unpatched.GradFixCallback(PACKING)])
    refused(callback_trainer, UsageError)
    late = W.trainer_for(tmp_path / "late")
    late.add_callback(unpatched.GradFixCallback())
    assert "add_callback after the Trainer was built" in refused(late, GradFixCallbackError)
    stock = W.trainer_for(tmp_path / "stock")  # the control: stock trains on from it (fresh optimizer, no word)
    stock.args.max_steps = 5
    stock.train(resume_from_checkpoint=str(folder))
    assert stock.state.global_step == 5


def test_completeness_is_every_file_its_save_wrote_whole_and_every_step_the_folders(crashed, tmp_path,
                                                                                    warnings_of_hf_gradfix):
    """Item 10: checkpoint-4 marked, but without model.safetensors (before: picked by resume=True over checkpoint-2,
    then ValueError: Can't find a valid checkpoint), with a truncated optimizer.pt, or with a marker of step 2 (before:
    accepted): each is skipped with one warning and checkpoint-2 taken."""
    import shutil

    from hf_gradfix.integration.checkpoints.complete import complete, resume_path

    out, _, _ = crashed
    cases = {
        "model.safetensors is missing": lambda c: (c / "model.safetensors").unlink(),
        "optimizer.pt holds 1000 bytes, its save wrote": lambda c: os.truncate(c / "optimizer.pt", 1000),
        "hf_gradfix_complete_rank0.json was written at step 2, not 4": lambda c: shutil.copy(
            c.parent / "checkpoint-2" / "hf_gradfix_complete_rank0.json", c / "hf_gradfix_complete_rank0.json"),
        "hf_gradfix_checkpoint.json was written for step 2, not 4": lambda c: shutil.copy(
            c.parent / "checkpoint-2" / "hf_gradfix_checkpoint.json", c / "hf_gradfix_checkpoint.json"),
    }
    assert complete(str(out / "straight" / "checkpoint-4")) == (True, "")
    for i, (why, tear) in enumerate(cases.items()):
        run = _copy(out / "straight", tmp_path / str(i), "checkpoint-2", "checkpoint-4")
        tear(run / "checkpoint-4")
        ok, found = complete(str(run / "checkpoint-4"))
        assert not ok and found.startswith(why), (why, found)
        warnings_of_hf_gradfix.clear()
        assert resume_path(str(run)) == str(run / "checkpoint-2")
        skips = [r.getMessage() for r in warnings_of_hf_gradfix.records]
        assert len(skips) == 1 and f"skips {run / 'checkpoint-4'}: incomplete, {why}" in skips[0], skips


def test_no_complete_checkpoint_is_one_line_of_the_plugins_error_type(crashed, tmp_path, unpatched):
    """resume_from_checkpoint=True (keyword or positional) where no checkpoint is complete: one line naming the folder
    and why each is not, an hf_gradfix error that is still a ValueError (stock's type for "no checkpoint")."""
    import crash_save_worker as W
    from hf_gradfix.errors import HfGradfixError

    out, _, _ = crashed
    run = _copy(out / "torn" / "model", tmp_path / "run", "checkpoint-4")
    unpatched.patch(PACKING)
    trainer = W.trainer_for(run)
    for call in (lambda: trainer.train(resume_from_checkpoint=True), lambda: trainer.train(True)):
        with pytest.raises(HfGradfixError) as err:
            call()
        message = str(err.value)
        assert isinstance(err.value, ValueError) and "\n" not in message, message
        assert message.startswith(f"resume_from_checkpoint=True: no complete checkpoint in output_dir {str(run)!r} "
                                  "(checkpoint-4: its save stopped before its end"), message


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails with ENOSPC)")
@pytest.mark.parametrize("disk", ["full", "free"])
def test_a_full_disk_during_a_save_is_reported_as_such_naming_the_torn_folder(disk, tmp_path, unpatched, monkeypatch):
    """Item 9: optimizer.pt of checkpoint-4 is a link to /dev/full, so torch.save's own writer fails as on a full disk
    (``unexpected pos ... vs ...`` / ``basic_ios::clear: iostream error``, no errno). With the file system reported
    full (os.statvfs), the save stops with one line: no space left on device, the folder named and left torn
    (resume_from_checkpoint=True takes checkpoint-2). Control: the same failure with space left on the disk is not
    called a full disk (torch's error as it is)."""
    import errno

    import crash_save_worker as W
    from hf_gradfix.errors import HfGradfixError
    from hf_gradfix.integration.checkpoints import complete as C

    unpatched.patch(PACKING)
    trainer = W.trainer_for(tmp_path)
    trainer.args.max_steps = 4
    original = type(trainer)._save_optimizer_and_scheduler

    def save_optimizer(self, output_dir):
        if self.state.global_step == 4:
            os.symlink("/dev/full", os.path.join(output_dir, "optimizer.pt"))
        return original(self, output_dir)

    trainer._save_optimizer_and_scheduler = save_optimizer.__get__(trainer)
    if disk == "full":
        statvfs = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
            (4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255)) if str(path).startswith(str(tmp_path)) else statvfs(path))
    with pytest.raises((RuntimeError, OSError)) as err:
        trainer.train()
    folder = str(tmp_path / "checkpoint-4")
    message = str(err.value)
    if disk == "free":
        assert type(err.value) is RuntimeError and "no space" not in message.lower(), message
    else:
        assert isinstance(err.value, HfGradfixError) and err.value.errno == errno.ENOSPC and "\n" not in message
        assert f"no space left on device (0 bytes free) while saving checkpoint {folder!r} (RuntimeError: " in message
        assert ("unexpected pos" in message or "iostream error" in message) and "it is left torn" in message
        assert f"the newest complete checkpoint is {str(tmp_path / 'checkpoint-2')!r}" in message
    assert not C.complete(folder)[0] and C.resume_path(str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_rank0_rotates_only_after_every_rank_marked_its_part(tmp_path, monkeypatch):
    """Rank 0 writes trainer_state.json and rotates older checkpoints away (save_total_limit=1) only after every
    process's marker is on disk: the save waits for everyone right after this process's marker. The order is recorded
    on a real save (one process; the wait is accelerate's barrier); without the wait, rotation could delete the last
    complete checkpoint while another rank still writes the new one."""
    import transformers

    import hf_gradfix
    import crash_save_worker as W

    events = []
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}})
    try:
        trainer = W.trainer_for(tmp_path)
        trainer.args.save_total_limit = 1
        trainer.args.max_steps = 4
        monkeypatch.setattr(trainer.accelerator, "wait_for_everyone", lambda: events.append(
            ("wait", sorted(n for p in tmp_path.glob("checkpoint-*") for n in os.listdir(p) if n.startswith("hf_gradfix_complete")))))
        save_json = transformers.TrainerState.save_to_json
        monkeypatch.setattr(transformers.TrainerState, "save_to_json", lambda self, path: (
            events.append(("trainer_state", os.path.basename(os.path.dirname(path)))), save_json(self, path))[1])
        import transformers.trainer as trainer_module

        rotate = trainer_module.rotate_checkpoints
        monkeypatch.setattr(trainer_module, "rotate_checkpoints", lambda **kw: (events.append(("rotate",)), rotate(**kw))[1])
        trainer.train()
    finally:
        hf_gradfix.unpatch()
    saves = [e for e in events if e[0] != "wait" or e[1]]  # waits inside a save (a marker is on disk)
    kinds = [e[0] for e in saves]
    assert kinds == ["wait", "trainer_state", "rotate"] * 2, events
    assert saves[0][1] == ["hf_gradfix_complete_rank0.json"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]  # rotation did run: the limit of 1 kept the newest
