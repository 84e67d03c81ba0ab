"""Kill a packed hf_gradfix training run at each phase of a checkpoint save, then resume (tests/trainer/test_crash_safe_checkpoints.py).

One process imports everything once, then forks a child per run (fork: no second import of transformers):

* ``straight``: 6 optimizer steps (AdamW, lr 1e-2, GA 2, packing on), a checkpoint every 2 steps; final weights saved;
* per kill phase: the same run in a fresh output folder, killed with SIGKILL (or, ``disk``, an ``OSError(ENOSPC)``)
  during the save of ``checkpoint-4``; then a new trainer resumes with ``resume_from_checkpoint=True`` to the end and
  saves its final weights, and what the resume chose; the checkpoints as the crash left them are copied to
  ``OUT/torn/<phase>/`` first.

Run: ``python tests/support/crash_save_worker.py OUT phase1,phase2,...``; writes ``OUT/<run>/result.json`` and ``final.pt``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (str(_TESTS), str(_TESTS.parents[1])):  # tests/support, the repository root
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import transformers  # noqa: E402

import harness as H  # noqa: E402
import hf_gradfix  # noqa: E402
from hf_gradfix.integration.checkpoints import complete as complete_checkpoints  # noqa: E402
from hf_gradfix.integration.packing import trainer as packing_trainer

KILL_STEP = 4
PHASES = ("model", "optimizer", "stream", "marker", "trainer_state", "disk")


def trainer_for(out: Path):
    samples = H.make_samples("causal", n=48, seed=0, lo=3, hi=30)
    torch.manual_seed(0)
    model = H.build_model("llama", attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=1, save_strategy="steps", save_steps=2,
        logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=3, data_seed=3,
        remove_unused_columns=False, dataloader_num_workers=0)
    return transformers.Trainer(model=model, args=args, train_dataset=H.TokenDataset(samples))


def _die(phase: str):
    if phase == "disk":
        raise OSError(errno.ENOSPC, f"No space left on device (planted at {phase})")
    os.kill(os.getpid(), signal.SIGKILL)


def plant(trainer, phase: str) -> None:
    """Die during the save of checkpoint-KILL_STEP, at ``phase``."""
    def due():
        return trainer.state.global_step == KILL_STEP

    cls = type(trainer)
    if phase == "model":
        original = cls.save_model

        def save_model(self, *a, **k):
            original(self, *a, **k)
            if due():
                _die(phase)
        trainer.save_model = save_model.__get__(trainer)
    elif phase in ("optimizer", "disk"):
        original = cls._save_optimizer_and_scheduler

        def save_opt(self, output_dir):
            if due() and phase == "disk":
                _die(phase)
            original(self, output_dir)
            if due():
                _die(phase)
        trainer._save_optimizer_and_scheduler = save_opt.__get__(trainer)
    elif phase == "stream":  # half of the packed stream's state written, then killed
        original_stream = packing_trainer.save_stream_state

        def save_stream_state(t, output_dir):
            if due():
                path = os.path.join(output_dir, packing_trainer.STREAM_STATE_FILE.format(rank=0))
                with open(path, "wb") as fh:
                    fh.write(b"PK\x03\x04 half a file")
                _die(phase)
            original_stream(t, output_dir)
        packing_trainer.save_stream_state = save_stream_state
    elif phase == "marker":  # every file but the marker and trainer_state.json
        original_mark = complete_checkpoints.mark

        def mark(t, output_dir):
            if due():
                _die(phase)
            original_mark(t, output_dir)
        complete_checkpoints.mark = mark
    elif phase == "trainer_state":  # trainer_state.json half written
        original_save = transformers.TrainerState.save_to_json

        def save_to_json(self, json_path):
            if self.global_step == KILL_STEP:
                with open(json_path, "w") as fh:
                    fh.write('{"global_step": 4, "log_hist')
                _die(phase)
            original_save(self, json_path)
        transformers.TrainerState.save_to_json = save_to_json


def run(out: Path, phase: str | None, resume: bool) -> None:
    hf_gradfix.patch({"packing": {"enabled": True, "token_budget": 64}})
    trainer = trainer_for(out)
    result = {}
    if phase is not None and not resume:
        plant(trainer, phase)
    try:
        if resume:
            stock_pick = transformers.trainer_utils.get_last_checkpoint(str(out))
            trainer.train(resume_from_checkpoint=True)
            result["stock_pick"] = os.path.basename(stock_pick) if stock_pick else None
        else:
            trainer.train()
    except OSError as err:
        result["error"] = str(err)
    if "error" not in result:
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "final.pt")
    result["steps"] = trainer.state.global_step
    (out / "result.json").write_text(json.dumps(result))


def child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def main() -> None:
    out, phases = Path(sys.argv[1]), [p for p in sys.argv[2].split(",") if p]
    out.mkdir(parents=True, exist_ok=True)
    status = {"straight": child(lambda: run(out / "straight", None, False))}
    for phase in phases:
        folder = out / phase
        status[f"{phase}_killed"] = child(lambda: run(folder, phase, False))
        (folder / "killed.json").write_text(json.dumps({
            n: complete_checkpoints.complete(str(folder / n)) for n in sorted(os.listdir(folder)) if n.startswith("checkpoint-")}))
        os.rename(folder / "result.json", folder / "killed_result.json") if (folder / "result.json").exists() else None
        for name in ("checkpoint-2", "checkpoint-4"):  # as the crash left them (the resumed run saves checkpoint-4 anew)
            shutil.copytree(folder / name, out / "torn" / phase / name)
        status[f"{phase}_resumed"] = child(lambda: run(folder, phase, True))
    (out / "status.json").write_text(json.dumps(status))


if __name__ == "__main__":
    main()
