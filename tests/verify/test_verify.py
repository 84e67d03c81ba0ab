"""``hf-gradfix verify``: the verdict follows the numbers; the user's own script is checked; every planted bug is
caught and named, the same scripts fixed pass.

The user scripts live in tests/support/verify_scripts/ (a tokenizer trained offline, ``datasets``, transformers' own
collators returning ``BatchEncoding``).  The ground truth is computed by hf_gradfix.verify in plain PyTorch; the
planted bugs are written in the scripts, independently of it, and each must be named by the one reference that
reproduces the run's gradient to fp32 precision.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import hang_bound
import harness as H
from hf_gradfix.cli import main
from hf_gradfix.verify import (FLOOR_FACTOR, _ListDataset, _PadCollator, synthetic_samples, tiny_model, verdict_of, verify,
                               verify_trainer)
from hf_gradfix.verify.command import trainer_train_hook

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "verify_scripts"
USER = str(SCRIPTS / "train_user.py")
SFT = str(SCRIPTS / "train_sft.py")
GRPO = str(SCRIPTS / "train_grpo.py")


def _verify_script(capsys, tmp_path, *script_args, steps=1, extra=(), script=USER):
    """``hf-gradfix verify --json -- python train_user.py ...`` in this process: (exit code, report dict)."""
    out = tmp_path / "run"
    code = main(["verify", "--steps", str(steps), "--json", *extra, "--", sys.executable, script, *script_args,
                 "--output_dir", str(out)])
    captured = capsys.readouterr()
    assert "TRAINING FINISHED" not in captured.out + captured.err  # the script was stopped after the checked steps
    return code, json.loads(captured.out), captured.err


# ------------------------------------------------------------------------------------------ the verdict


def test_verdict_rules():
    tol = 1e-5
    assert verdict_of({"exact": 3e-8}, None, tol) == "exact"
    assert verdict_of({"exact": 3e-8}, 2e-3, tol) == "reported_loss"  # gradient right, reported loss wrong
    assert verdict_of({"exact": 0.7, "ga_scaled": 2e-7, "mean_of_means": 0.5}, 0.7, tol) == "ga_scaled"
    # nearest is not enough: a reference must reproduce the run within the tolerance
    assert verdict_of({"exact": 0.7, "ga_scaled": 2e-3, "mean_of_means": 0.5}, 0.7, tol) == "unexplained"
    # the fitted scale is named only when no fixed-formula reference fits
    assert verdict_of({"exact": 3.0, "ga_scaled": 3e-7, "scaled": 2e-7}, 3.0, tol) == "ga_scaled"
    assert verdict_of({"exact": 3.0, "ga_scaled": 0.2, "scaled": 2e-7}, 3.0, tol) == "scaled"
    # "exact" is never a fallback: an error above the tolerance is NOT EXACT even if it is the nearest
    assert verdict_of({"exact": 2e-5, "ga_scaled": 3.0}, None, tol) == "unexplained"


def test_tolerance_edge(capsys):
    """EXACT exactly when every error is within --tolerance: just above the run's error passes, just below fails
    (and, with no reference within that tolerance either, is 'unexplained'), with the exit codes to match."""
    assert main(["verify", "--steps", "1", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    step = rep["steps"][0]
    err = max(step["grad_rel_err"], step["loss_rel_err"])
    assert 0 < err < 1e-5
    assert main(["verify", "--steps", "1", "--json", "--tolerance", repr(err * 1.01)]) == 0
    assert json.loads(capsys.readouterr().out)["exact"] is True
    assert main(["verify", "--steps", "1", "--tolerance", repr(err * 0.99)]) == 1
    text = capsys.readouterr().out
    assert "NOT EXACT: unexplained" in text and "\nEXACT" not in text


# ------------------------------------------------------------------------------------------ the built-in run


def test_builtin_exact_runs_pass():
    plain = verify(steps=1)
    packed = verify(steps=1, packing=True)
    for rep in (plain, packed):
        assert rep.exact and not rep.broken
        assert rep.steps[0].grad_rel_err < 1e-5 and rep.steps[0].loss_rel_err < 1e-5
    assert packed.packing and packed.steps[0].sequences > packed.steps[0].micro_batches


@pytest.mark.parametrize("bug, verdicts", [
    ("mean_of_means", {"mean_of_means", "mean_of_means_summed"}),  # summed on transformers 5.x, averaged on 4.57
    ("ga_scaled", {"ga_scaled"}),
    ("count_unshifted", {"count_unshifted"}),
    ("cross_attention", {"cross_attention"}),
])
def test_builtin_planted_bug_is_named(bug, verdicts):
    rep = verify(steps=1, inject=bug)
    assert not rep.exact
    assert rep.steps[0].verdict in verdicts, rep.steps[0].candidates
    assert rep.steps[0].grad_rel_err > 1e-3  # the bug is real, not noise
    assert rep.steps[0].candidates[rep.steps[0].verdict] < 1e-5  # the named reference reproduces it


def test_cli_json_exit_code_and_plot(tmp_path, capsys):
    png = tmp_path / "errors.png"
    assert main(["verify", "--steps", "1", "--inject", "ga_scaled", "--plot", str(png)]) == 1
    assert "NOT EXACT: scaling by GA" in capsys.readouterr().out
    assert png.stat().st_size > 1000


# ------------------------------------------------------------------------------------------ the user's script


@pytest.mark.parametrize("bug, verdict", [
    ("seq_divide", "per_row"),  # a Trainer subclass dividing the summed loss by the number of sequences
    ("collator_shift", "labels_offset"),  # a collator that shifts labels itself
    ("loss_func_mean", "mean_of_means_summed"),  # a compute_loss_func averaging per micro-batch
    ("dataset_offset", "labels_offset"),  # a dataset whose labels are input_ids shifted by one
    ("pad_labels", "padding_targets"),  # a collator padding labels with the pad id: the loss trains on padding
])
def test_planted_bug_in_user_script_is_caught_and_named_and_the_fix_passes(capsys, tmp_path, bug, verdict):
    code, rep, _ = _verify_script(capsys, tmp_path, "--bug", bug)
    assert code == 1 and rep["exact"] is False, rep
    step = rep["steps"][0]
    assert step["verdict"] == verdict, step["candidates"]
    assert step["grad_rel_err"] > 1e-2
    assert step["candidates"][verdict] <= 1e-5
    assert rep["broken"] == [verdict]
    code, rep, _ = _verify_script(capsys, tmp_path, "--bug", bug, "--fixed")
    assert code == 0 and rep["exact"] is True, rep
    assert rep["steps"][0]["grad_rel_err"] <= 1e-5
    run = tmp_path / "run"  # the user's output_dir (transformers creates it): no checkpoint, no log of the checked steps
    assert not run.exists() or not any(run.iterdir())


@pytest.mark.parametrize("head, verdict", [
    ("mlm", "mean_of_means_summed"),  # BERT-style heads ignore num_items_in_batch: micro-batch means summed
    ("tokcls", "mean_of_means_summed"),
    ("seq2seq", "mean_of_means_summed"),
])
def test_heads_stock_is_named_and_one_micro_batch_is_exact(capsys, tmp_path, head, verdict):
    """The ground truth for masked LM, token classification and seq2seq (unshifted count rule): stock transformers
    is exact with one micro-batch per step, and the known GA bug of these heads is named with GA 4."""
    code, rep, _ = _verify_script(capsys, tmp_path, "--head", head, "--ga", "1", "--bs", "4")
    assert code == 0, rep
    assert rep["count_rule"].startswith("unshifted")
    code, rep, _ = _verify_script(capsys, tmp_path, "--head", head)
    assert code == 1 and rep["steps"][0]["verdict"] == verdict, rep["steps"][0]["candidates"]


@pytest.mark.parametrize("head", ["mlm", "tokcls", "seq2seq"])
def test_heads_patched_are_exact_with_transformers_collators(capsys, tmp_path, head):
    """The same heads and collators (transformers' own, BatchEncoding batches) under hf_gradfix.patch(): EXACT."""
    code, rep, _ = _verify_script(capsys, tmp_path, "--head", head, "--patch")
    assert code == 0 and rep["exact"] is True, rep["steps"][0]["candidates"]


def test_example_tutorial_script_stock_is_caught_and_patched_is_exact(capsys, tmp_path):
    """examples/train_causal_lm.py --loss tutorial (the docs' compute_loss override, transformers' collator): verify
    names the bug stock, and the same script with --hf-gradfix is exact."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "train_causal_lm.py")
    for extra, expect in (((), 1), (("--hf-gradfix",), 0)):
        code = main(["verify", "--steps", "1", "--json", "--", sys.executable, example, "--loss", "tutorial",
                     "--out", str(tmp_path / "run"), *extra])
        rep = json.loads(capsys.readouterr().out)
        assert code == expect and rep["exact"] is (expect == 0), rep["steps"][0]["candidates"]


def test_label_smoothing_is_part_of_the_ground_truth(capsys, tmp_path):
    code, rep, _ = _verify_script(capsys, tmp_path, "--label-smoothing", "0.1")
    assert code == 0, rep


def test_sequence_classification_patched_is_exact(capsys, tmp_path):
    code, rep, _ = _verify_script(capsys, tmp_path, "--head", "seqcls", "--patch")
    assert code == 0, rep
    assert rep["count_rule"].startswith("elements")


def test_learned_positions_with_packing(capsys, tmp_path):
    """GPT-2 (64 learned positions) packed into 4096-token rows: exact, the row-as-one-sequence reference is
    skipped with a note instead of overflowing the position table; stock GPT-2 has the count off by one per row."""
    code, rep, _ = _verify_script(capsys, tmp_path, "--arch", "gpt2", "--patch", "--packing")
    assert code == 0, rep
    assert rep["packing"] is True and rep["steps"][0]["sequences"] > rep["steps"][0]["micro_batches"]
    assert any("cross_attention skipped" in n and "position table" in n for n in rep["notes"]), rep["notes"]
    code, rep, _ = _verify_script(capsys, tmp_path, "--arch", "gpt2")
    assert code == 1 and rep["steps"][0]["verdict"] == "count_unshifted"


def test_module_form_text_report_and_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.chdir(tmp_path)
    png = tmp_path / "errors.png"
    before = transformers.Trainer.train
    code = main(["verify", "--steps", "2", "--plot", str(png), "--", "python", "-m", "train_user", "--bug", "seq_divide",
                 "--output_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 1
    assert "SequenceMeanTrainer, 2 step(s)" in out and "step 2:" in out
    assert "NOT EXACT: sequence count" in out
    assert transformers.Trainer.train is before  # the hook is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.png", "run"]  # only what was asked for
    assert not any((tmp_path / "run").iterdir())
    assert png.stat().st_size > 1000


def test_script_without_trainer_and_bad_arguments(capsys, tmp_path):
    script = tmp_path / "no_trainer.py"
    script.write_text("print('hello')\n")
    assert main(["verify", "--", "python", str(script)]) == 2
    assert "without calling train()" in capsys.readouterr().err
    assert main(["verify", "--model", "tiny", "--", "python", str(script)]) == 2
    assert "--model only apply to the built-in run" in capsys.readouterr().err
    assert main(["verify", "--", "python", str(tmp_path / "missing.py")]) == 2
    script.write_text("raise ValueError('boom')\n")
    assert main(["verify", "--", str(script)]) == 2
    assert "boom" in capsys.readouterr().err


@pytest.mark.parametrize("leave, code, needle", [
    ("os_exit_before", 2, "the script called os._exit(0) before its Trainer's train() was called: nothing was checked"),
    ("exit_in_step", 2, "the script left in step 1 of Trainer.train() under verify before verify could compare"),
    ("catch_and_exit", 0, "EXACT"),  # the check ran before the script swallowed verify's stop: the report stands
])
def test_a_script_that_leaves_early_never_passes_unchecked(capsys, tmp_path, leave, code, needle):
    """verify never passes with nothing checked: os._exit(0) (which would end the process with 0, unchecked),
    sys.exit(0) from inside a step, and a script that swallows verify's stop then exits 0 (the report stands)."""
    got = main(["verify", "--steps", "1", "--", sys.executable, USER, "--leave", leave, "--fixed",
                "--output_dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert got == code, (captured.out[-800:], captured.err[-800:])
    assert needle in (captured.out if code == 0 else captured.err.strip().splitlines()[-1])
    assert os._exit.__module__ == "posix" or os._exit.__name__ == "_exit"  # verify put os._exit back


def test_data_without_targets_is_nothing_checked(capsys, tmp_path):
    """--data whose labels are all -100: a zero gradient equals a zero ground truth; that is not EXACT (exit 2)."""
    data = tmp_path / "masked.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5, 6, 7, 8, 9], "labels": [-100] * 5}) + "\n" for _ in range(40)))
    assert main(["verify", "--data", str(data), "--steps", "1"]) == 2
    out = capsys.readouterr().out
    assert "(0 targets," in out and out.strip().splitlines()[-1].startswith("NOTHING CHECKED: 1 step(s) compared but")


@pytest.mark.parametrize("crash", ["before", "1", "2"])
def test_a_crashing_script_names_exception_file_line_and_phase(capsys, tmp_path, crash):
    """Issue 25 finding 7 / issue 26 item 6: the script's own traceback (its frames, not verify's runpy machinery),
    then one last line naming the exception, the file and line where it was raised, and where the run was: before
    its Trainer's train(), or in which checked step.  Before: "the script raised before its Trainer could be
    checked" also for a crash inside step 2, without the exception; a ValueError / RuntimeError became one bare
    line without file or line."""
    code = main(["verify", "--steps", "3", "--", sys.executable, USER, "--crash", crash, "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    last = err.strip().splitlines()[-1]
    source = Path(USER).read_text().splitlines()
    if crash == "before":
        line = next(i for i, t in enumerate(source, 1) if 'raise ValueError("planted crash before' in t)
        expected = (f"hf-gradfix verify: the script raised ValueError: planted crash before the trainer at "
                    f"{os.path.relpath(USER)}:{line}, before its Trainer's train() was called; nothing was checked")
    else:
        line = next(i for i, t in enumerate(source, 1) if 'raise RuntimeError(f"planted crash in step' in t)
        expected = (f"hf-gradfix verify: the script raised RuntimeError: planted crash in step {crash} at "
                    f"{os.path.relpath(USER)}:{line}, in step {crash} of Trainer.train() under verify; "
                    "nothing was checked")
    assert last == expected, last
    assert f'{os.path.relpath(USER)}", line {line}' in err  # the script's own traceback, innermost frame included
    assert "runpy" not in err and "verify/command.py" not in err  # verify's machinery left out


def test_hook_is_reversible_and_fires_once():
    before = transformers.Trainer.train
    seen = []
    with trainer_train_hook(lambda trainer, run: seen.append(trainer)):
        assert transformers.Trainer.train is not before
        transformers.Trainer.train("first")
        assert transformers.Trainer.train is before  # removed as soon as it fired
    assert transformers.Trainer.train is before and seen == ["first"]
    with pytest.raises(RuntimeError):
        with trainer_train_hook(lambda trainer, run: None):
            raise RuntimeError("user error")
    assert transformers.Trainer.train is before


# ------------------------------------------------------------------------------------------ the Python API


def _tiny_trainer(tmp_path, collator=None, model=None, **kw):
    args = transformers.TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                                          report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                          max_steps=4, learning_rate=1e-2, **kw)
    return transformers.Trainer(model=model or tiny_model(), args=args, data_collator=collator or _PadCollator(0),
                                train_dataset=_ListDataset(synthetic_samples(40, 128)))


def test_verify_trainer_api_restores_the_trainer(tmp_path):
    """verify_trainer on a stock Trainer with BatchEncoding batches: exact, and afterwards the trainer trains as if
    it had never been checked (parameters, RNG, state, arguments, callbacks put back)."""
    pad = _PadCollator(0)

    def collate(features):  # what transformers' collators return
        return transformers.BatchEncoding(pad(features))

    reference = _tiny_trainer(tmp_path, collate)
    reference.train()
    expected = {n: p.detach().clone() for n, p in reference.model.named_parameters()}

    trainer = _tiny_trainer(tmp_path, collate)
    callbacks = list(trainer.callback_handler.callbacks)
    report = verify_trainer(trainer, steps=2)
    assert report.exact and len(report.steps) == 2, "\n".join(report.lines())
    assert trainer.state.global_step == 0 and trainer.args.max_grad_norm == 1.0
    assert trainer.callback_handler.callbacks == callbacks
    trainer.train()
    for n, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, expected[n], rtol=0, atol=0)


def test_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    import datasets

    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_user
    finally:
        sys.path.remove(str(SCRIPTS))
    tok = train_user.build_tokenizer()
    model = train_user.build_model("causal", "llama", len(tok), tok.pad_token_id)
    ds = datasets.Dataset.from_dict({"text": train_user.sentences(32)})
    cfg = trl.SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                        max_steps=2, report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                        max_length=40, learning_rate=1e-3)
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
    report = verify_trainer(trainer, steps=1)
    assert report.trainer == "SFTTrainer"
    assert report.exact, "\n".join(report.lines())


# ------------------------------------------------------------------------------------------ mixed precision


def _judged_by_its_floor(step):
    """A bf16 step's numbers: the rounding is real (the fixed 1e-5 rule fails it), the tolerance is FLOOR_FACTOR x the
    measured floor and no wider than bf16 rounding, the fp32 ground truth reported beside it."""
    floor, tol = step["rounding_floor"], step["tolerance"]
    assert floor is not None and 1e-5 < floor < 1e-2, step
    assert tol == pytest.approx(max(1e-5, FLOOR_FACTOR * floor)), step
    assert step["fp32_grad_rel_err"] is not None and step["fp32_grad_rel_err"] > 1e-5, step
    return floor, tol


def test_trl_sft_defaults_bf16_is_exact_stock_and_patched_and_fp32_is_unchanged(capsys, tmp_path):
    """Issue 34 item 6: an unchanged TRL script (SFTConfig's default bf16=True) was NOT EXACT, 'unexplained', for
    rounding alone (the reference was fp32).  Now the reference runs under the run's autocast, fp32 beside it, and
    the step is judged within FLOOR_FACTOR x its rounding floor: EXACT stock (TRL's SFT is exact) and patched; the
    same script with bf16=False is judged at the fixed tolerance as before."""
    pytest.importorskip("trl")
    for extra in ((), ("--patch",)):
        code, rep, _ = _verify_script(capsys, tmp_path, *extra, script=SFT)
        step = rep["steps"][0]
        assert code == 0 and rep["exact"] is True, step
        assert rep["precision"] == "bf16 autocast (cpu)"
        assert rep["reference"] == "bf16 autocast (cpu), as the run; fp32 beside it"
        floor, tol = _judged_by_its_floor(step)
        assert 1e-5 < step["grad_rel_err"] <= tol and step["loss_rel_err"] <= tol
        # the control: judged by the fixed rule, the same numbers are what issue 34 reported ('unexplained')
        assert verdict_of(step["candidates"], step["loss_rel_err"], 1e-5) == "unexplained"
    code, rep, _ = _verify_script(capsys, tmp_path, "--bf16", "0", script=SFT)
    step = rep["steps"][0]
    assert code == 0 and rep["precision"] == rep["reference"] == "fp32", step
    assert step["rounding_floor"] is None and step["fp32_grad_rel_err"] is None and step["tolerance"] == 1e-5
    assert step["grad_rel_err"] < 1e-5


def test_trl_sft_bf16_with_a_real_bug_is_not_exact_and_named(capsys, tmp_path):
    """The wider bf16 tolerance still fails a wrong run: a compute_loss override returning the model's micro-batch
    mean (GA 4) under SFTConfig's bf16 is NOT EXACT, and the one reference that reproduces it is named."""
    pytest.importorskip("trl")
    code, rep, _ = _verify_script(capsys, tmp_path, "--bug", "mean", script=SFT)
    step = rep["steps"][0]
    assert code == 1 and rep["exact"] is False and rep["broken"] == ["mean_of_means_summed"], step["candidates"]
    floor, tol = _judged_by_its_floor(step)
    assert step["grad_rel_err"] > 100 * tol and step["candidates"]["mean_of_means_summed"] <= tol
    assert step["fp32_grad_rel_err"] > 100 * tol  # the fp32 ground truth beside says the same


def test_builtin_bf16_count_bug_is_named_by_the_gradient_or_below_its_resolution_by_the_loss():
    """The smallest planted bug, the target count off by one per row, under bf16.  Short rows (4-48 tokens): 3.7e-2
    of the gradient, above the bf16 tolerance (2e-2), named by the gradient.  Rows of 100-250 tokens: 0.56%, below
    the gradient's rounding (tolerance 1.7e-2), so the gradient alone would say EXACT; the reported loss (its own
    floor: the ground-truth loss in the run's layout, 3.5e-8) names it by its factor.  Control: the correct run on
    the same long rows is EXACT, with a note that the gradient cannot resolve that bug."""
    rep = verify(steps=1, bf16=True, inject="count_unshifted")
    step = rep.steps[0]
    assert rep.precision == "bf16 autocast (cpu)" and not rep.exact and step.verdict == "count_unshifted", step.candidates
    assert step.grad_rel_err > step.tolerance > 1e-5 and step.candidates["count_unshifted"] <= step.tolerance
    assert step.tolerance == pytest.approx(FLOOR_FACTOR * step.rounding_floor)
    long_rows = synthetic_samples(32, 128, lo=100, hi=250)
    rep = verify(steps=1, bf16=True, inject="count_unshifted", samples=long_rows)
    step = rep.steps[0]
    assert not rep.exact and step.verdict == "count_unshifted", step
    assert step.grad_rel_err <= step.tolerance  # the gradient cannot tell it from exact at bf16 ...
    assert step.loss_rel_err > 100 * step.loss_tolerance and step.loss_floor < 1e-6  # ... the loss can
    assert "named by the reported loss" in step.detail
    rep = verify(steps=1, bf16=True, samples=long_rows)
    assert rep.exact, "\n".join(rep.lines())
    assert any("the gradient cannot tell the reference count_unshifted from exact" in n for n in rep.notes), rep.notes


def test_builtin_bf16_text_report(capsys):
    assert main(["verify", "--steps", "1", "--bf16"]) == 0
    out = capsys.readouterr().out
    assert "precision: the run computed in bf16 autocast (cpu); reference: bf16 autocast (cpu), as the run; fp32 beside it" in out
    assert re.search(rf"rounding floor \S+ -> tolerance \S+ \(max of 1e-05 and {FLOOR_FACTOR:g} x floor\), loss floor \S+ -> "
                     r"\S+; fp32 beside it: gradient rel err \S+, loss rel err", out), out
    assert out.rstrip().splitlines()[-1].startswith("EXACT (at bf16 autocast (cpu), as the run")


def test_fp16_on_cpu_and_a_loss_scaler(tmp_path):
    """fp16=True on a CPU: accelerate applies no autocast there, the run is fp32 and verify says so (exact at the fixed
    tolerance).  A GradScaler (what fp16 uses on a GPU) leaves the gradient scaled until the optimizer step: verify
    divides the scale out (control: without that, the run reads as the exact gradient x1024)."""
    import hf_gradfix.verify.trainer as V

    rep = verify_trainer(_tiny_trainer(tmp_path, fp16=True), steps=1)
    assert rep.exact and rep.precision == "fp32" and rep.steps[0].tolerance == 1e-5, "\n".join(rep.lines())
    assert any(n.startswith("fp16=True, but the Trainer runs no autocast here (cpu") for n in rep.notes), rep.notes

    def scaled_trainer():
        trainer = _tiny_trainer(tmp_path)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return trainer

    rep = verify_trainer(scaled_trainer(), steps=1)
    assert rep.exact, "\n".join(rep.lines())
    original = V._loss_scale
    V._loss_scale = lambda *a: 1.0
    try:
        rep = verify_trainer(scaled_trainer(), steps=1)
    finally:
        V._loss_scale = original
    assert rep.steps[0].verdict == "scaled" and rep.steps[0].detail == "x1024", rep.steps[0].candidates


# ------------------------------------------------------------------------------------------ several ranks


def _cpu_yaml(tmp_path):
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1, "machine_rank": 0,
                                   "main_process_ip": "127.0.0.1", "main_process_port": H._free_port(), "use_cpu": True}))
    return cfg


@pytest.mark.distributed
@pytest.mark.parametrize("inject, code, expect", [(None, 0, "EXACT"), ("world_scaled", 1, "NOT EXACT: scaling by world size")])
def test_two_ranks_through_hf_gradfix_launch(tmp_path, inject, code, expect):
    cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(_cpu_yaml(tmp_path)), "-m", "hf_gradfix",
           "verify", "--steps", "1"]
    cmd += ["--inject", inject] if inject else ["--packing"]  # packing: the run whose notes every rank used to repeat
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HF_GRADFIX_ALL_RANKS", None)
    proc = hang_bound.run(cmd, capture_output=True, text=True, step="verify launch under hf-gradfix launch", env=env)
    assert (proc.returncode != 0) == bool(code), proc.stderr[-2000:]
    assert "2 rank(s)" in proc.stdout and expect in proc.stdout, proc.stdout + proc.stderr[-2000:]
    # One voice: rank 0 prints the report, the plugin's log lines and Python warnings once; a line per phase.
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[hf_gradfix]")]
    assert ours and len(ours) == len(set(ours)), "\n".join(ours)
    assert not any("[rank 1]" in line for line in ours), "\n".join(ours)
    assert sum("UserWarning" in line for line in proc.stderr.splitlines()) <= 1, proc.stderr[-3000:]
    for phase in ("building the Trainer", "1/2 the run under test", "2/2 the reference", "done"):  # stamped lines
        assert sum(bool(re.search(r"verify: \[\d+\.\d s\] " + re.escape(phase), line)) for line in ours) == 1, (phase, ours)
    assert proc.stdout.count(expect) == 1
    if inject is None:
        note = next(line for line in ours if "per_device_train_batch_size" in line)
        assert "INFO" in note and "does not apply (expected with packing" in note, note


@pytest.mark.distributed
def test_user_script_on_two_ranks_through_hf_gradfix_launch(tmp_path):
    """A compute_loss_func averaging per micro-batch on 2 ranks: transformers also multiplies it by the ranks."""
    cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(_cpu_yaml(tmp_path)), "-m", "hf_gradfix",
           "verify", "--steps", "1", "--json", "--", USER, "--bug", "loss_func_mean", "--output_dir", str(tmp_path / "run")]
    proc = hang_bound.run(cmd, capture_output=True, text=True, step="verify launch under hf-gradfix launch", cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode != 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["world_size"] == 2 and rep["steps"][0]["verdict"] == "mean_of_means_summed+world_scaled", rep["steps"][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.yaml", "run"] and not any((tmp_path / "run").iterdir())


def test_peft_prompt_tuning_and_lora(tmp_path):
    """PEFT: virtual tokens make labels[..., 0] a target of the causal loss (stock 5.x counts labels[..., 1:], the
    count off by one per row, named count_shifted); with hf_gradfix exact; LoRA exact."""
    peft = pytest.importorskip("peft")
    import hf_gradfix

    def prompt_model():
        return peft.get_peft_model(tiny_model(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))

    stock = verify_trainer(_tiny_trainer(tmp_path, model=prompt_model()), steps=1)
    assert stock.steps[0].verdict == "count_shifted", stock.steps[0].candidates
    hf_gradfix.patch()
    try:
        fixed = verify_trainer(_tiny_trainer(tmp_path, model=prompt_model()), steps=1)
    finally:
        hf_gradfix.unpatch()
    assert fixed.exact, "\n".join(fixed.lines())
    lora = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    rep = verify_trainer(_tiny_trainer(tmp_path, model=lora), steps=1)
    assert rep.exact and "adapters" in rep.steps[0].groups, "\n".join(rep.lines())


# ------------------------------------------------------------------------------------------ policy-gradient runs (RL)


def _verify_grpo(capsys, tmp_path, *script_args, json_report=True, steps=2, bf16=False):
    """``hf-gradfix verify --steps 2 -- python train_grpo.py --bf16 0 ...`` in this process: (exit code, report dict
    or text)."""
    code = main(["verify", "--steps", str(steps), *(["--json"] if json_report else []), "--", sys.executable, GRPO,
                 *([] if bf16 else ["--bf16", "0"]), *script_args, "--output_dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert "TRAINING FINISHED" not in captured.out + captured.err
    return code, (json.loads(captured.out) if json_report else captured.out)


def test_grpo_script_patched_dapo_is_exact_and_stock_names_the_expected_window_count(capsys, tmp_path):
    """Issue 35 item 3: a TRL GRPO script (dapo, steps_per_generation = 2 x GA, completions of 1 to 8 tokens), checked
    against the float64 window objective recomputed from the completions, advantages and log-probs it trained on:
    EXACT under hf_gradfix.patch(); stock TRL divides by the generation batch's expected window count, named."""
    pytest.importorskip("trl")
    code, rep = _verify_grpo(capsys, tmp_path, "--patch")
    assert code == 0 and rep["exact"] is True, rep["steps"]
    assert rep["trainer"] == "GRPOTrainer" and "loss_type=dapo" in rep["head"] and rep["reference"].startswith("float64")
    assert len(rep["steps"]) == 2 and all(s["grad_rel_err"] < 1e-5 and s["loss_rel_err"] < 1e-5 for s in rep["steps"])
    # the two windows of one generation batch hold different token counts (what the expected count gets wrong)
    assert rep["steps"][0]["targets"] != rep["steps"][1]["targets"]
    code, text = _verify_grpo(capsys, tmp_path, json_report=False)
    assert code == 1, text
    assert "NOT EXACT: token count: expected window count" in text and "reproduces the run to" in text, text
    for line in (ln for ln in text.splitlines() if ln.strip().startswith("step ")):
        err = float(re.search(r"gradient rel err (\S+),", line)[1])
        assert err > 1e-2 and "expected window count" in line, line


def test_grpo_script_bnpo_stock_is_the_mean_of_micro_batch_means(capsys, tmp_path):
    pytest.importorskip("trl")
    code, rep = _verify_grpo(capsys, tmp_path, "--loss_type", "bnpo")
    assert code == 1 and rep["broken"] == ["mean_of_micro_means"], rep["steps"]
    for step in rep["steps"]:
        assert step["grad_rel_err"] > 1e-1 and step["candidates"]["mean_of_micro_means"] < 1e-5, step


def test_grpo_entropy_bonus_and_kl_term_are_part_of_the_objective(capsys, tmp_path):
    """Stock dapo with an entropy bonus and a KL term (beta 0.5; lr 0.05, so the second window's policy has moved from
    the reference): both of TRL's divisions are named together, which only reproduces the run when the KL term from
    the recorded reference log-probs is part of the ground truth."""
    pytest.importorskip("trl")
    code, rep = _verify_grpo(capsys, tmp_path, "--entropy_coef", "0.05", "--beta", "0.5", "--lr", "0.05")
    assert code == 1 and rep["broken"] == ["expected_window_count+entropy_mean_of_micro_means"], rep["steps"]
    assert "KL term beta 0.5" in rep["head"] and "entropy bonus" in rep["head"]
    for step in rep["steps"]:
        assert step["candidates"]["expected_window_count+entropy_mean_of_micro_means"] < 1e-5, step


def test_grpo_defaults_bf16_patched_is_exact_within_its_floor_and_a_bug_below_it_is_named_by_the_loss(
        capsys, tmp_path, monkeypatch):
    """GRPOConfig's default bf16=True (autocast on the CPU): the float64 ground truth is ~4e-3 from any bf16 run, so a
    patched step is judged against FLOOR_FACTOR x the rounding floor measured on it (the objective recomputed at the
    run's precision). With the floor factor widened until the gradient cannot tell stock's expected-count bug (3e-2)
    from exact, the bug is still named, by the reported loss."""
    pytest.importorskip("trl")
    import hf_gradfix.verify.report as V

    code, rep = _verify_grpo(capsys, tmp_path, "--patch", bf16=True, steps=1)
    assert code == 0 and rep["precision"].startswith("bf16 autocast"), rep["steps"]
    step = rep["steps"][0]
    assert 1e-5 < step["rounding_floor"] < 1e-2 and step["tolerance"] == pytest.approx(FLOOR_FACTOR * step["rounding_floor"])
    assert 1e-5 < step["grad_rel_err"] <= step["tolerance"], step  # rounding is real, and within the floor's tolerance
    monkeypatch.setattr(V, "FLOOR_FACTOR", 20.0)
    code, rep = _verify_grpo(capsys, tmp_path, bf16=True, steps=1)
    step = rep["steps"][0]
    assert code == 1 and step["verdict"] == "expected_window_count", step
    assert step["grad_rel_err"] < step["tolerance"] and "named by the reported loss" in step["detail"], step


# ------------------------------------------------------------------------------------------ progress and one voice


def test_progress_heartbeat_speaks_after_a_silent_interval_and_only_then():
    """Issue 50 item 6: verify was silent for 35-53 s before its first line. A phase is said at once, stamped; while it
    runs silently the heartbeat repeats it after HEARTBEAT_S (15 s) of silence, checked every second: the longest
    silence is 16 s (< 20). A fake clock drives the check; a real thread (tiny interval) is wired to it."""
    import threading
    import time

    from hf_gradfix.progress import HEARTBEAT_S, Progress

    now, lines = [100.0], []
    p = Progress("demo", emit=lines.append, clock=lambda: now[0], heartbeat=False)
    p.phase("slow phase ...")
    assert lines == ["demo: [0.0 s] slow phase ..."]
    for t, speaks in ((14.9, False), (15.0, True), (29.9, False), (30.0, True)):
        now[0] = 100.0 + t
        assert p.beat() is speaks, t
    now[0] = 131.0
    p.line("reference step 1/2 computed")  # any line resets the silence, the phase is unchanged
    for t, speaks in ((45.9, False), (46.0, True)):
        now[0] = 100.0 + t
        assert p.beat() is speaks, t
    assert lines[-1] == "demo: [46.0 s] still slow phase ..." and sum("still" in x for x in lines) == 3
    assert HEARTBEAT_S + p.tick <= 16.0
    # the thread: a fake slow phase with a 0.05 s interval speaks again and again until the session ends
    lines.clear()
    with Progress("demo", interval=0.05, tick=0.01, emit=lines.append) as real:
        real.phase("fake slow phase ...")
        until = hang_bound.deadline("heartbeat thread speaks twice")
        while sum("still fake slow phase" in x for x in lines) < 2:
            until.check(lines)
            time.sleep(0.01)
    after = len(lines)
    time.sleep(0.1)
    assert len(lines) == after and not any(t.name.startswith("hf_gradfix-demo") for t in threading.enumerate())
    lines.clear()
    with Progress("demo", interval=0.05, tick=0.01, emit=lines.append, heartbeat=False) as quiet:  # control
        quiet.phase("no heartbeat ...")
        time.sleep(0.2)
    assert lines == ["demo: [0.0 s] no heartbeat ..."]


def test_verify_says_every_phase_stamped_from_its_first_second(tmp_path):
    """The phases of `hf-gradfix verify -- python train.py` in order, each stamped with the seconds since verify
    started; the first (the script runs) at 0.0 s, before the script's own imports and setup."""
    from hf_gradfix.progress import Progress

    lines: list[str] = []
    with Progress("verify", emit=lines.append, heartbeat=False):  # the CLI's own session nests into this one
        assert main(["verify", "--steps", "1", "--json", "--", sys.executable, USER, "--patch",
                     "--output_dir", str(tmp_path / "run")]) == 0
    stamps = [float(re.match(r"verify: \[(\d+\.\d) s\] ", x)[1]) for x in lines]
    assert stamps == sorted(stamps) and stamps[0] == 0.0, lines
    order = ["running ", "1/2 the run under test", "2/2 the reference", "reference step 1/1 computed", "] done"]
    at = [next(i for i, x in enumerate(lines) if phase in x) for phase in order]
    assert at == sorted(at) and at[0] == 0, lines


def test_errors_of_verify_and_of_hf_gradfix_are_theirs_not_the_scripts(capsys, tmp_path, monkeypatch):
    """Issue 50: verify's own refusal was reported as "the script raised InvalidArgumentError: verify_trainer: ..."
    (once per rank). Now verify's own error is its one line, and a refusal of hf_gradfix inside the script's run says
    hf_gradfix stopped it; the script's own exceptions keep "the script raised" (test above)."""
    import hf_gradfix.verify.trainer as V
    from hf_gradfix.errors import InvalidArgumentError

    def refuse(*a, **kw):
        raise InvalidArgumentError("verify_trainer: planted refusal of verify itself")

    monkeypatch.setattr(V, "verify_trainer", refuse)
    code = main(["verify", "--steps", "1", "--", sys.executable, USER, "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1] == "hf-gradfix verify: verify_trainer: planted refusal of verify itself"
    assert "the script raised" not in err
    monkeypatch.undo()
    cfg = tmp_path / "pp.yaml"
    cfg.write_text(yaml.safe_dump({"hf_gradfix": {"parallel": {"pp": 2}}}))
    monkeypatch.setenv("HF_GRADFIX_CONFIG", str(cfg))
    code = main(["verify", "--steps", "1", "--", sys.executable, USER, "--patch", "--output_dir", str(tmp_path / "run")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("hf-gradfix verify: hf_gradfix stopped the script's run before its Trainer's "
                                         "train() was called: ") and last.endswith("; nothing was checked"), last


def test_a_failure_is_said_once_per_run(capsys, monkeypatch):
    """Under a launch every rank fails alike: rank 0 says it at once; another rank only after a grace period (the
    launcher ends it first when rank 0 failed too), then with its rank, so a failure of one rank alone is still said."""
    import hf_gradfix.verify.command as C

    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    monkeypatch.setenv("RANK", "0")
    C._say_failure(["hf-gradfix verify: boom"])
    assert capsys.readouterr().err == "hf-gradfix verify: boom\n" and slept == []
    monkeypatch.setenv("RANK", "1")
    C._say_failure(["Traceback:\n  line", "hf-gradfix verify: boom"])
    assert capsys.readouterr().err == "[rank 1] Traceback:\n[rank 1]   line\n[rank 1] hf-gradfix verify: boom\n"
    assert slept == [C._OTHER_RANKS_GRACE_S] and C._OTHER_RANKS_GRACE_S >= 5


# ------------------------------------------------------------------------------------------ sharded launches


SHARDED = str(SCRIPTS / "train_sharded.py")
CONFIGS = Path(__file__).resolve().parents[2] / "hf_gradfix" / "configs"


def _launch_verify(tmp_path, config, *script_args, steps=2):
    """``hf-gradfix launch --config_file CONFIG -m hf_gradfix verify --json -- train_sharded.py ...``, as documented,
    this checkout importable by every rank: (process, report dict or None)."""
    import multiproc

    cmd = [sys.executable, "-m", "hf_gradfix", "launch", "--config_file", str(config), "--main_process_port",
           str(multiproc.free_port()), "-m", "hf_gradfix", "verify", "--steps", str(steps), "--json", "--", SHARDED,
           *script_args, "--output_dir", str(tmp_path / "run")]
    proc = multiproc.run_launch(cmd, env=multiproc.worker_env(), cwd=tmp_path, step="verify launch under hf-gradfix launch")
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = None
    return proc, report


def _one_verify_voice(stderr: str) -> list[str]:
    """verify's progress lines: rank 0's only, each stamped with the seconds since verify started."""
    ours = [line for line in stderr.splitlines() if "verify: [" in line]
    assert ours and all(line.startswith("[hf_gradfix] INFO: verify: [") for line in ours), ours
    assert not any("[rank" in line for line in ours), ours
    assert re.search(r"verify: \[0\.0 s\] running \S*train_sharded\.py under verify", ours[0]), ours[0]  # its first line
    for phase in ("building an unsharded copy for the ground truth", "1/2 the run under test", "2/2 the reference",
                  "] done"):
        assert sum(phase in line for line in ours) == 1, (phase, ours)
    return ours


@pytest.mark.distributed
def test_expert_parallel_launch_gets_a_verdict_and_a_planted_bug_is_caught(tmp_path):
    """Issue 50 item 4: `hf-gradfix launch --config_file configs/cpu_ep.yaml -m hf_gradfix verify -- train.py` stopped
    on every rank with "the script raised InvalidArgumentError: ... pass reference_model=". verify now gathers the
    expert-parallel DTensor shards into an unsharded copy at the initial weights and checks the run against it: the
    first step EXACT (the patched run), the second NOT EXACT, where the script's compute_loss multiplies the loss by
    GA (the control: a normalization bug planted under ep is caught, the factor named). One report, one voice; torch's
    note on the expert-mesh gradient norm said once, explained, and the norm it computes checked on every rank."""
    proc, rep = _launch_verify(tmp_path, CONFIGS / "cpu_ep.yaml", "--model", "moe", "--bug", "ga_from_step",
                               "--bug-step", "2")
    assert proc.returncode == 1 and rep is not None, proc.stderr[-3000:]
    assert "hf-gradfix launch: hf-gradfix verify exited with 1 (NOT EXACT" in proc.stderr
    assert rep["world_size"] == 2 and len(rep["steps"]) == 2 and rep["exact"] is False, rep["steps"]
    exact, planted = rep["steps"]
    assert exact["verdict"] == "exact" and exact["grad_rel_err"] <= 1e-5 and exact["loss_rel_err"] <= 1e-5, exact
    assert set(exact["groups"]) >= {"attention", "mlp", "head"}  # the experts and router are in 'mlp'
    assert planted["verdict"] == "scaled" and planted["detail"] == "x2", planted  # GA 2 x (token loss + router term)
    assert planted["grad_rel_err"] > 0.5 and planted["candidates"]["scaled"] <= 1e-5, planted
    for step in rep["steps"]:  # the norm the Trainer reduced over the efsdp x ep mesh, on both ranks
        assert step["grad_norm_rel_err"] is not None and step["grad_norm_rel_err"] <= 1e-6, step
    assert "the script raised" not in proc.stderr
    _one_verify_voice(proc.stderr)
    torch_note = [line for line in proc.stderr.splitlines() if 'flatten mesh dimensions ["efsdp", "ep"]' in line]
    assert len(torch_note) == 1 and "[hf_gradfix: expected under expert parallelism, and harmless" in torch_note[0], \
        torch_note


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["cpu_pp", "cpu_zero3"])
def test_pipeline_and_zero3_launches_are_exact(tmp_path, config):
    """The same script under the other ways a launch holds no whole model on a rank: pipeline stages (configs/cpu_pp.yaml:
    each rank holds its layers; the stages' weights and gradients are merged over the ranks, the pipeline's ranks
    counted as one data rank) and DeepSpeed ZeRO-3 (configs/accelerate/cpu_deepspeed.yaml at zero_stage 3: partitions
    gathered; the engine steps inside backward, so its gradient is read in its step; its clipping is off for the
    checked steps as the Trainer's is). Before: pp crashed in the comparison, DeepSpeed was refused for the clipping
    verify itself turned off."""
    if config == "cpu_zero3":
        pytest.importorskip("deepspeed")
        cfg = yaml.safe_load((CONFIGS / "accelerate" / "cpu_deepspeed.yaml").read_text())
        cfg["deepspeed_config"]["zero_stage"] = 3
        path = tmp_path / "cpu_zero3.yaml"
        path.write_text(yaml.safe_dump(cfg))
    else:
        path = CONFIGS / f"{config}.yaml"
    proc, rep = _launch_verify(tmp_path, path, "--model", "llama")
    assert proc.returncode == 0 and rep is not None, proc.stderr[-3000:]
    assert rep["exact"] is True and len(rep["steps"]) == 2, rep["steps"]
    assert rep["world_size"] == 2 and rep["data_ranks"] == (1 if config == "cpu_pp" else 2), rep
    for step in rep["steps"]:
        assert step["grad_rel_err"] <= 1e-5 and step["loss_rel_err"] <= 1e-5 and step["grad_norm_rel_err"] <= 1e-6, step
    _one_verify_voice(proc.stderr)
