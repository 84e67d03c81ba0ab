"""Checkpoints a crash cannot tear (issue 38): a packed hf_gradfix run killed (SIGKILL) at each phase of a save, or
hitting a full disk, resumes with ``resume_from_checkpoint=True`` from the newest COMPLETE checkpoint and ends
bit-identical to the uninterrupted run; stock transformers' own choice (``get_last_checkpoint``) is the torn folder.

One launch of tests/crash_save_worker.py (forks a child per run: ~40 s on 2 shared cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import harness as H
from crash_save_worker import PHASES

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker forks")


@pytest.fixture(scope="module")
def crashed():
    out = Path(tempfile.mkdtemp(prefix="hgf_crash_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(H.REPO_ROOT), str(H.REPO_ROOT / "tests")])}
    proc = subprocess.run([sys.executable, str(H.REPO_ROOT / "tests" / "crash_save_worker.py"), str(out), ",".join(PHASES)],
                          env=env, capture_output=True, text=True, timeout=600)
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


def test_an_explicit_incomplete_checkpoint_is_refused_in_one_line(crashed):
    from hf_gradfix.errors import UsageError
    from hf_gradfix.integration.complete_checkpoints import resolve

    import shutil

    out, _, _ = crashed
    torn = out / "torn" / "checkpoint-6"  # a complete checkpoint whose save stopped before trainer_state.json
    shutil.copytree(out / "optimizer" / "checkpoint-2", torn)
    (torn / "trainer_state.json").unlink()
    torn = str(torn)
    fake = type("T", (), {"args": type("A", (), {"output_dir": str(out / "torn")})()})()
    with pytest.raises(UsageError, match="is incomplete: no trainer_state.json"):
        resolve(fake, torn)
    weights_only = Path(tempfile.mkdtemp(prefix="hgf_weights_"))  # no hf_gradfix marker: left to stock, as stock loads it
    (weights_only / "model.safetensors").write_bytes(b"")
    assert resolve(fake, str(weights_only)) == str(weights_only)
    empty = tempfile.mkdtemp(prefix="hgf_nockpt_")
    fake.args.output_dir = empty
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        resolve(fake, True)


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
