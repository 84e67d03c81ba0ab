"""Issue 38's probe, table-driven: hostile inputs and faults, each in its own subprocess with a time and memory bound.

Every row runs one thing a user could type (a CLI command or a few lines of Python against the library) in a fresh
process (``RLIMIT_AS`` 8 GiB, 120 s) and is classified by what came back:

- ``ok``: refused with one line (no traceback, non-zero exit, the expected words), or accepted where it should be;
- ``silent``: accepted (exit 0) what should be refused;
- ``traceback``: a Python traceback reached the user (or a library call raised something other than hf_gradfix's
  own error types);
- ``hang``: it ran past the time bound;
- ``misleading``: refused or accepted as it should be, but without the words that tell the user what happened.

Run ``python benchmarks/hardening_probe.py [--src DIR] [--out FILE.json]``: ``--src`` puts another checkout's
``hf_gradfix`` first on the path (the "before" column of benchmarks/results/hardening_probe.md was measured on
6781d40, the commit before issue 38's first change). ``python benchmarks/hardening_probe.py render BEFORE.json
AFTER.json OUT.md LABEL LABEL`` writes the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import ROOT  # noqa: E402

ACC = "compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\nnum_processes: 2\nuse_cpu: true\n"
DS = ACC.format(kind="DEEPSPEED")
CPU = ACC.format(kind="MULTI_CPU")
FSDP = ACC.format(kind="FSDP")

# Python run before each library row: its own errors are one line, anything else is a traceback
PRELUDE = textwrap.dedent("""
    import sys, warnings
    def _run(body):
        from hf_gradfix.errors import HfGradfixError
        try:
            body()
        except HfGradfixError as err:
            print("REFUSED:", str(err).splitlines()[0], file=sys.stderr); sys.exit(2)
        print("ACCEPTED")
""")

TRAINER = textwrap.dedent("""
    import torch, transformers, hf_gradfix
    from transformers import LlamaConfig, LlamaForCausalLM
    def tiny():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    class DS(torch.utils.data.Dataset):
        def __len__(self): return 8
        def __getitem__(self, i):
            ids = [(3 * i + j) % 64 for j in range(10)]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
    def args(out, **kw):
        base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                    report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
        base.update(kw)
        return transformers.TrainingArguments(**base)
""")

# (id, category in the issue, kind "cli" | "py", argv or code, expect "refuse" | "accept", words the output must hold)
ROWS: list[tuple[str, str, str, object, str, str]] = []


def row(rid, cat, kind, what, expect, words=""):
    ROWS.append((rid, cat, kind, what, expect, words))


def yaml_cli(rid, cat, text, expect="refuse", words="", cmd="check"):
    row(rid, cat, "cli", {"file": text, "argv": ["config", "check", "{file}"]}, expect, words)


# --- silent acceptances: DeepSpeed's nested settings
for v in ("4", "-1", '"2"', "2.5", "true"):
    yaml_cli(f"ds zero_stage {v}", "silent", DS + f"deepspeed_config: {{zero_stage: {v}}}\nhf_gradfix: {{}}\n", words="zero_stage")
for v in ("-1", ".nan", ".inf", '"1.0"'):
    yaml_cli(f"ds gradient_clipping {v}", "silent", DS + f"deepspeed_config: {{zero_stage: 2, gradient_clipping: {v}}}\nhf_gradfix: {{}}\n",
             words="gradient_clipping")
yaml_cli("ds nvme without a path", "silent", DS + "deepspeed_config: {zero_stage: 3, offload_optimizer_device: nvme}\nhf_gradfix: {}\n", words="nvme")
yaml_cli("ds offload to gpu", "silent", DS + "deepspeed_config: {zero_stage: 2, offload_optimizer_device: gpu}\nhf_gradfix: {}\n", words="offload_optimizer_device")
yaml_cli("ds offload_param under ZeRO-2", "silent", DS + "deepspeed_config: {zero_stage: 2, offload_param_device: cpu}\nhf_gradfix: {}\n", words="offload_param")
row("ds JSON duplicate keys", "silent", "cli", {"file": DS + "deepspeed_config: {deepspeed_config_file: ds.json}\nhf_gradfix: {}\n",
    "files": {"ds.json": '{"zero_optimization": {"stage": 2, "stage": 3}}'}, "argv": ["config", "check", "{file}"]}, "refuse", "stage")
row("ds JSON NaN", "silent", "cli", {"file": DS + "deepspeed_config: {deepspeed_config_file: ds.json}\nhf_gradfix: {}\n",
    "files": {"ds.json": '{"zero_optimization": {"stage": 2}, "gradient_clipping": NaN}'}, "argv": ["config", "check", "{file}"]}, "refuse", "NaN")
row("ds JSON file with zero_stage", "silent", "cli", {"file": DS + "deepspeed_config: {deepspeed_config_file: ds.json, zero_stage: 3}\nhf_gradfix: {}\n",
    "files": {"ds.json": '{"zero_optimization": {"stage": 2}}'}, "argv": ["config", "check", "{file}"]}, "refuse", "zero_stage")
yaml_cli("FSDP with a deepspeed_config too", "silent", FSDP + "fsdp_config: {fsdp_version: 2}\ndeepspeed_config: {zero_stage: 2}\nhf_gradfix: {}\n",
         words="deepspeed_config: ignored")  # issue 50: a note was a silent launch as FSDP; refused in one line
yaml_cli("fsdp_version 3", "silent", FSDP + "fsdp_config: {fsdp_version: 3}\nhf_gradfix: {}\n", words="fsdp_version")
yaml_cli("fsdp HALF_SHARD", "silent", FSDP + "fsdp_config: {fsdp_sharding_strategy: HALF_SHARD}\nhf_gradfix: {}\n", words="HALF_SHARD")
yaml_cli("YAML 0b101", "silent", CPU + "hf_gradfix:\n  optimizer: {name: galore_adamw, seed: 0b101}\n", words="0b101")
yaml_cli("YAML 4_096", "silent", CPU + "hf_gradfix:\n  packing: {enabled: true, token_budget: 4_096}\n", words="4_096")
yaml_cli("zero_bubble pp_virtual_stages 1", "silent", CPU + "hf_gradfix: {parallel: {pp: 2, pp_schedule: zero_bubble, pp_virtual_stages: 1}}\n",
         expect="accept", words="zero_bubble")  # torch runs it exactly (measured); the docs now say so
yaml_cli("interleaved pp_virtual_stages 1", "silent", CPU + "hf_gradfix: {parallel: {pp: 2, pp_schedule: interleaved_1f1b, pp_virtual_stages: 1}}\n",
         expect="accept", words="interleaved_1f1b")
yaml_cli("pp 2 with loss off", "silent", CPU + "hf_gradfix: {parallel: {pp: 2}, loss: {enabled: false}}\n", words="loss.enabled")
row("plan adamw --rank 8", "silent", "cli", {"argv": ["plan", "--model", "tiny-llama", "--optimizer", "adamw", "--rank", "8"]}, "refuse", "--rank")
row("plan --offload-optimizer alone", "silent", "cli", {"argv": ["plan", "--model", "tiny-llama", "--offload-optimizer"]}, "refuse", "DeepSpeed")
row("verify: script calls os._exit(0)", "silent", "cli", {"files": {"x.py": "import os\nos._exit(0)\n"},
    "argv": ["verify", "--", "python", "x.py"]}, "refuse", "")
row("verify --data all labels -100", "silent", "cli", {"files": {"d.jsonl": '{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}\n'},
    "argv": ["verify", "--data", "d.jsonl"]}, "refuse", "")
row("PackedCollator negative id", "silent", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator()([{'input_ids': [5, -3, 6], 'labels': [5, -3, 6]}]))", "refuse", "-3")
row("PackedCollator label -5", "silent", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator()([{'input_ids': [5, 4, 6], 'labels': [5, -5, 6]}]))", "refuse", "-5")
row("PackedCollator max_tokens=True", "silent", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator(max_tokens=True))", "refuse", "max_tokens")
row("TokenWindow grad_accum_steps=True", "silent", "py", "from hf_gradfix import TokenWindow\n"
    "_run(lambda: TokenWindow(None, [], True))", "refuse", "grad_accum_steps")
row("apollo_mini(rank=4)", "silent", "py", "import torch\nfrom hf_gradfix.optim.apollo import apollo_mini\n"
    "_run(lambda: apollo_mini(torch.nn.Linear(32, 32), rank=4))", "refuse", "rank")
row("GaLore rank-4 state into rank 8", "silent", "py", textwrap.dedent("""
    import torch
    from hf_gradfix.optim import GaLoreAdamW
    torch.manual_seed(0); m = torch.nn.Linear(32, 32, bias=False)
    a = GaLoreAdamW([m.weight], rank=4); m(torch.randn(2, 32)).sum().backward(); a.step()
    b = GaLoreAdamW([m.weight], rank=8)
    _run(lambda: b.load_state_dict(a.state_dict()))"""), "refuse", "rank")
row("count_rule unshifted on a causal LM", "silent", "py", TRAINER + textwrap.dedent("""
    import tempfile
    hf_gradfix.patch({"loss": {"count_rule": "unshifted"}})
    t = transformers.Trainer(model=tiny(), args=args(tempfile.mkdtemp()), train_dataset=DS())
    _run(t.train)"""), "refuse", "count_rule")
row("lowrank_grads under a stock Trainer's clip", "silent", "py", TRAINER + textwrap.dedent("""
    import tempfile
    from hf_gradfix.optim import GaLoreAdamW
    m = tiny(); opt = GaLoreAdamW(m, lr=1e-2, rank=4, lowrank_grads=True)
    t = transformers.Trainer(model=m, args=args(tempfile.mkdtemp(), max_grad_norm=0.05), train_dataset=DS(), optimizers=(opt, None))
    _run(t.train)"""), "refuse", "max_grad_norm")

# --- tracebacks
yaml_cli("accelerate dynamo_backend TURBO", "traceback", CPU + "dynamo_config: {dynamo_backend: TURBO}\nhf_gradfix: {}\n", words="TURBO")
yaml_cli("DeepSpeed JSON /dev/zero", "traceback", DS + "deepspeed_config: {deepspeed_config_file: /dev/zero}\nhf_gradfix: {}\n", words="/dev/zero")
SIZES = {"model_type": "llama", "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 100}
row("plan heads not dividing hidden", "traceback", "cli", {"files": {"h.json": json.dumps({**SIZES, "hidden_size": 100, "num_attention_heads": 3})},
    "argv": ["plan", "--model", "h.json"]}, "refuse", "num_attention_heads")
row("plan KV heads > heads", "traceback", "cli", {"files": {"k.json": json.dumps({**SIZES, "num_key_value_heads": 8})},
    "argv": ["plan", "--model", "k.json"]}, "refuse", "num_key_value_heads")
for rid, data, words in (("verify --data out of vocabulary", '{"input_ids": [5, 100000, 7]}', "100000"),
                         ("verify --data negative id", '{"input_ids": [5, -4, 6]}', "-4"),
                         ("verify --data labels shorter", '{"input_ids": [5, 6, 7], "labels": [5, 6]}', "labels")):
    row(rid, "traceback", "cli", {"files": {"d.jsonl": data + "\n"}, "argv": ["verify", "--data", "d.jsonl"]}, "refuse", words)
row("verify --model malicious pickle", "traceback", "cli", {"pickle": True, "argv": ["verify", "--model", "evil"]}, "refuse", "")
row("StreamingPacker state missing fields", "traceback", "py", "from hf_gradfix.packing import StreamingPacker\n"
    "p = StreamingPacker([{'input_ids': [1, 2, 3]}] * 4, token_budget=8)\n_run(lambda: p.load_state_dict({}))", "refuse", "")
row("StreamingPacker state garbage", "traceback", "py", "from hf_gradfix.packing import StreamingPacker\n"
    "p = StreamingPacker([{'input_ids': [1, 2, 3]}] * 4, token_budget=8)\n"
    "s = p.state_dict(); s = {k: 'garbage' for k in s}\n_run(lambda: p.load_state_dict(s))", "refuse", "")
row("TokenWindow bad count_rule", "traceback", "py", "from hf_gradfix import TokenWindow\n"
    "_run(lambda: [list(w) for w in TokenWindow(None, [{'labels': [[1, 2]]}], 1, count_rule='shift')])", "refuse", "count_rule")
row("TokenWindow no batches", "traceback", "py", "from hf_gradfix import TokenWindow\n"
    "_run(lambda: list(TokenWindow(None, [], 2)))", "refuse", "")
row("GaLore loading an AdamW state", "traceback", "py", textwrap.dedent("""
    import torch
    from hf_gradfix.optim import GaLoreAdamW
    m = torch.nn.Linear(32, 32, bias=False); a = torch.optim.AdamW([m.weight]); m(torch.randn(2, 32)).sum().backward(); a.step()
    _run(lambda: GaLoreAdamW([m.weight], rank=4).load_state_dict(a.state_dict()))"""), "refuse", "")

# --- hangs
row("config check on a named pipe", "hang", "cli", {"fifo": "p.yaml", "argv": ["config", "check", "p.yaml"]}, "refuse", "named pipe")
row("plan --simulate ~1e13 parameters", "hang", "cli", {"files": {"big.json": json.dumps({**SIZES, "hidden_size": 65536,
    "num_hidden_layers": 4096, "num_attention_heads": 512, "intermediate_size": 262144, "vocab_size": 256000})},
    "argv": ["plan", "--model", "big.json", "--simulate"]}, "refuse", "--simulate")

# --- misleading
USER_SCRIPT = str(ROOT / "tests" / "support" / "verify_scripts" / "train_user.py")
# the script catches verify's stop and exits 0 (the comparison ran first: its report must stand), or sys.exit(0)s
# inside step 1 before the comparison (nothing was checked: exit 2, saying where it left, not "never called train()")
row("verify: script catch_and_exit", "misleading", "cli", {"argv": ["verify", "--", "python", USER_SCRIPT, "--output_dir",
    "out", "--leave", "catch_and_exit"]}, "accept", "EXACT")
row("verify: script exit_in_step", "misleading", "cli", {"argv": ["verify", "--", "python", USER_SCRIPT, "--output_dir",
    "out", "--leave", "exit_in_step"]}, "refuse", "before verify could compare")
row("40,000 unknown keys", "misleading", "cli", {"file": CPU + "hf_gradfix:\n" + "".join(f"  k{i}: 1\n" for i in range(40000)),
    "argv": ["config", "check", "{file}"], "max_lines": 30}, "refuse", "unknown key")

# --- held-out style: other hostile inputs and fault points (not in the list)
for v in ("0", "-2", "2.5", "'4'"):
    row(f"TokenWindow grad_accum_steps={v}", "extra", "py", "from hf_gradfix import TokenWindow\n"
        f"_run(lambda: TokenWindow(None, [], {v}))", "refuse", "grad_accum_steps")
for kw in ("rank=0", "rank=-4", "rank=True", "update_proj_gap=0", "lr=float('nan')", "scale=float('inf')"):
    row(f"GaLoreAdamW({kw})", "extra", "py", "import torch\nfrom hf_gradfix.optim import GaLoreAdamW\n"
        f"_run(lambda: GaLoreAdamW(torch.nn.Linear(32, 32), {kw}))", "refuse", kw.split("=")[0])
row("PackedCollator labels of another length", "extra", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator()([{'input_ids': [5, 4, 6], 'labels': [5, 4]}]))", "refuse", "labels")
row("PackedCollator empty sample", "extra", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator()([{'input_ids': []}]))", "refuse", "")
row("PackedCollator float ids", "extra", "py", "from hf_gradfix.packing import PackedCollator\n"
    "_run(lambda: PackedCollator()([{'input_ids': [5.5, 4.0]}]))", "refuse", "")
row("StreamingPacker token_budget=0", "extra", "py", "from hf_gradfix.packing import StreamingPacker\n"
    "_run(lambda: StreamingPacker([{'input_ids': [1, 2]}], token_budget=0))", "refuse", "token_budget")
row("patch(config=missing file)", "extra", "py", "import hf_gradfix\n_run(lambda: hf_gradfix.patch(config='no_such.yaml'))",
    "refuse", "no_such.yaml")
row("patch({'loss': 5})", "extra", "py", "import hf_gradfix\n_run(lambda: hf_gradfix.patch({'loss': 5}))", "refuse", "loss")
row("GradFixCallback(config=123)", "extra", "py", "import hf_gradfix\n_run(lambda: hf_gradfix.GradFixCallback(123))", "refuse", "")
row("HF_GRADFIX_CONFIG missing file", "extra", "py", "import os, hf_gradfix\nos.environ['HF_GRADFIX_CONFIG'] = 'gone.yaml'\n"
    "_run(lambda: hf_gradfix.patch())", "refuse", "gone.yaml")
yaml_cli("config check: binary file", "extra", "\x89PNG\r\n\x1a\n", words="")
row("config check: not UTF-8", "extra", "cli", {"files": {"c.yaml": b"hf_gradfix: {}\n# caf\xe9\n"}, "argv": ["config", "check", "c.yaml"]},
    "refuse", "")
row("config check: a folder", "extra", "cli", {"files": {}, "argv": ["config", "check", "."]}, "refuse", "directory")
row("config check: empty plugin key twice", "extra", "cli", {"file": CPU + "hf_gradfix: {}\nhf_gradfix: {loss: {enabled: false}}\n",
    "argv": ["config", "check", "{file}"]}, "refuse", "hf_gradfix")
row("launch: script missing", "extra", "cli", {"file": CPU + "hf_gradfix: {}\n", "argv": ["launch", "--config_file", "{file}", "nope.py"]},
    "refuse", "nope.py")
for flag, value in (("--num_processes", "0"), ("--num_processes", "-3"), ("--main_process_port", "70000")):
    row(f"launch {flag} {value}", "extra", "cli", {"files": {"x.py": "print('ran')\n"}, "argv": ["launch", flag, value, "x.py"]},
        "refuse", flag)
row("verify: script missing", "extra", "cli", {"argv": ["verify", "--", "python", "nope.py"]}, "refuse", "nope.py")
row("plan --model missing path", "extra", "cli", {"argv": ["plan", "--model", "no/such/model"]}, "refuse", "no/such/model")
row("plan --seq-len -5", "extra", "cli", {"argv": ["plan", "--model", "tiny-llama", "--seq-len", "-5"]}, "refuse", "--seq-len")
row("resume_from_checkpoint = a file", "extra", "py", TRAINER + textwrap.dedent("""
    import tempfile, os
    d = tempfile.mkdtemp(); f = os.path.join(d, "x.txt"); open(f, "w").write("x")
    hf_gradfix.patch()
    t = transformers.Trainer(model=tiny(), args=args(d), train_dataset=DS())
    try:
        _run(lambda: t.train(resume_from_checkpoint=f))
    except (ValueError, OSError) as err:  # stock's own one-line refusal is fine
        print("REFUSED:", err, file=sys.stderr); sys.exit(2)"""), "refuse", "")
row("TokenWindow float labels", "extra", "py", "import torch\nfrom hf_gradfix import TokenWindow\n"
    "_run(lambda: [list(w) for w in TokenWindow(None, [{'labels': torch.tensor([[1.5, 2.0]])}], 1)])", "refuse", "labels")


def _limits():
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def run_row(r, src: str | None, timeout: float) -> tuple[str, float, str]:
    rid, cat, kind, what, expect, words = r
    with tempfile.TemporaryDirectory(prefix="hgf_probe_") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join([p for p in (src, str(ROOT)) if p])}
        env.pop("HF_GRADFIX_CONFIG", None)
        max_lines = None
        if kind == "cli":
            for name, text in (what.get("files") or {}).items():
                (Path(tmp, name).write_bytes if isinstance(text, bytes) else Path(tmp, name).write_text)(text)
            if "file" in what:
                Path(tmp, "c.yaml").write_text(what["file"])
            if "fifo" in what:
                os.mkfifo(Path(tmp, what["fifo"]))
            if what.get("pickle"):
                import torch
                from transformers import LlamaConfig

                class Evil:
                    def __reduce__(self):
                        return (os.system, (f"touch {tmp}/PWNED",))
                Path(tmp, "evil").mkdir()
                LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4).save_pretrained(Path(tmp, "evil"))
                torch.save({"x": Evil()}, Path(tmp, "evil", "pytorch_model.bin"))
            argv = [a.replace("{file}", "c.yaml") for a in what["argv"]]
            cmd = [sys.executable, "-m", "hf_gradfix", *argv]
            max_lines = what.get("max_lines")
        else:
            cmd = [sys.executable, "-c", PRELUDE + what]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=_limits)
        except subprocess.TimeoutExpired:
            return "hang", time.perf_counter() - started, f"no answer in {timeout:.0f} s"
        seconds = time.perf_counter() - started
        out = proc.stdout + proc.stderr
        if Path(tmp, "PWNED").exists():
            return "security", seconds, "the pickle ran"
    last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1][:160]
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback", seconds, last
    if expect == "refuse":
        if proc.returncode == 0:
            return "silent", seconds, last
        if words and words not in out:
            return "misleading", seconds, last
        if max_lines is not None and len(proc.stderr.strip().splitlines()) > max_lines:
            return "misleading", seconds, f"{len(proc.stderr.splitlines())} lines"
        return "ok", seconds, last
    if proc.returncode != 0 or (words and words not in out):
        return "misleading", seconds, last
    return "ok", seconds, last


VERDICTS = ("ok", "silent", "traceback", "hang", "misleading", "security")


def render(before: dict, after: dict, before_label: str, after_label: str) -> str:
    """benchmarks/results/hardening_probe.md: counts per category before and after, then every row."""
    rows_b = {r["id"]: r for r in before["rows"]}
    cats = []
    for r in after["rows"]:
        if r["category"] not in cats:
            cats.append(r["category"])
    out = ["# Hardening probe (issue 38)", "",
           f"`python benchmarks/hardening_probe.py` ({len(after['rows'])} rows, each in its own subprocess, 8 GiB / "
           "120 s bounds), on the code before issue 38's first change and now. A row's category is the issue's "
           "finding it reproduces (`extra`: other hostile inputs, not in the issue).", "",
           f"- before: {before_label}", f"- after: {after_label}", "",
           "| category | rows | " + " | ".join(f"{v} before / after" for v in VERDICTS[:5]) + " |",
           "|---|---|" + "---|" * 5]
    for cat in cats + ["all"]:
        ids = [r["id"] for r in after["rows"] if cat == "all" or r["category"] == cat]
        cells = []
        for v in VERDICTS[:5]:
            nb = sum(1 for i in ids if rows_b.get(i, {}).get("verdict") == v)
            na = sum(1 for r in after["rows"] if r["id"] in ids and r["verdict"] == v)
            cells.append(f"{nb} / {na}")
        out.append(f"| {'**all**' if cat == 'all' else cat} | {len(ids)} | " + " | ".join(cells) + " |")
    out += ["", "| row | category | before | after | seconds (after) | what the user saw (after, last line) |",
            "|---|---|---|---|---|---|"]
    for r in after["rows"]:
        b = rows_b.get(r["id"], {}).get("verdict", "-")
        last = r["last"][:140].rstrip("\\").replace("|", "\\|")  # cut, then escape: a cut escape broke the table
        out.append(f"| {r['id']} | {r['category']} | {b} | {r['verdict']} | {r['seconds']} | {last} |")
    return "\n".join(out) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "render":  # render BEFORE.json AFTER.json OUT.md "before label" "after label"
        _, _, b, a, md, lb, la = sys.argv
        Path(md).write_text(render(json.loads(Path(b).read_text()), json.loads(Path(a).read_text()), lb, la))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="a checkout whose hf_gradfix goes first on the path (the 'before' run)")
    ap.add_argument("--out", help="write the per-row results as JSON here")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("-k", help="only rows whose id contains this")
    ap.add_argument("--category", help="only rows of this category (silent, traceback, hang, misleading, extra)")
    ns = ap.parse_args()
    rows = [r for r in ROWS if (not ns.k or ns.k in r[0]) and (not ns.category or ns.category == r[1])]
    results = []
    for r in rows:
        verdict, seconds, last = run_row(r, ns.src, ns.timeout)
        results.append({"id": r[0], "category": r[1], "verdict": verdict, "seconds": round(seconds, 1), "last": last})
        print(f"{verdict:10s} {seconds:6.1f}s  [{r[1]}] {r[0]}: {last}", flush=True)
    counts = {}
    for res in results:
        counts[res["verdict"]] = counts.get(res["verdict"], 0) + 1
    print(json.dumps(counts))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"counts": counts, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
