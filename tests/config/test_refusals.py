"""Every refused combination of docs/refusals.md, generated from that table: the library, ``config check`` and
``launch`` refuse each with the same line; and every ``raise`` of the code that resolves a file is reached by a row,
so a refusal added to the code without a row (and so without its documentation) fails here."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from hf_gradfix.cli import main
from hf_gradfix.config.resolve import resolve_config
from hf_gradfix.errors import HfGradfixError

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "refusals.md"

#: the functions whose refusals a file can reach; each of their ``raise`` statements needs a row of the table
CHECKED = {
    "hf_gradfix/parallel/pipeline.py": {"check_schedule", "check_combination"},
    "hf_gradfix/parallel/ep.py": {"check_combination"},
    "hf_gradfix/parallel/dims.py": {"__post_init__"},
    "hf_gradfix/config/resolve.py": {"_check_deepspeed", "resolve_config"},
}
#: raise statements no file can reach, each with the reason (found by the coverage check below; kept short)
UNREACHABLE_FROM_A_FILE = {
    ("hf_gradfix/parallel/pipeline.py", "parallel.pp_schedule={schedule!r}: unknown schedule"): "the schema refuses the value first",
    ("hf_gradfix/parallel/dims.py", "world_size={self.world_size!r}"): "num_processes is checked by accelerate's keys first",
    ("hf_gradfix/parallel/dims.py", "parallel.{key}={value!r}: must be a positive integer"): "the schema's range",
    ("hf_gradfix/parallel/dims.py", "parallel.pp=-1"): "the schema's range",
    ("hf_gradfix/parallel/dims.py", "parallel.pp_virtual_stages={v!r}"): "the schema's range",
    ("hf_gradfix/parallel/dims.py", "parallel.ep={self.ep!r}: must be"): "the schema's range",
    ("hf_gradfix/parallel/dims.py", "parallel: {rest} are all -1"): "only dp_replicate / dp_shard take -1 in the schema",
    ("hf_gradfix/config/resolve.py", "--num-processes {num_processes}"): "a CLI flag (tests/config/test_bad_inputs.py)",
    ("hf_gradfix/config/resolve.py", "{flag} {value}: invalid value"): "a CLI flag (tests/config/test_bad_inputs.py)",
}


def _rows() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].isdigit():
            continue
        kind, n, section, extra, fragment = (c.strip("`") for c in cells)
        rows.append((kind, n, section, extra, fragment))
    assert len(rows) >= 20, f"{DOC} lost its table"
    return rows


ROWS = _rows()


def _write(tmp_path: Path, kind: str, n: str, section: str, extra: str) -> str:
    text = "compute_environment: LOCAL_MACHINE\nuse_cpu: true\n"
    text += "" if kind == "(missing)" else f"distributed_type: {kind}\n"
    text += f"num_processes: {n}\n" + (f"{extra}\n" if extra else "") + f"hf_gradfix: {section}\n"
    path = tmp_path / "refused.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("kind,n,section,extra,fragment", ROWS, ids=[r[4][:40] for r in ROWS])
def test_every_documented_refusal_is_one_line_from_library_check_and_launch(tmp_path, capsys, kind, n, section, extra,
                                                                            fragment):
    path = _write(tmp_path, kind, n, section, extra)
    with pytest.raises(HfGradfixError) as err:
        resolve_config(path, for_launch=True)
    library = str(err.value)
    assert fragment in library and "\n" not in library, library
    lines = []
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    for argv in (["config", "check", path], ["launch", "--config_file", path, str(tmp_path / "train.py")]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err and "must not run" not in captured.err + captured.out
        lines.append(captured.err.strip().split(": ", 1)[1])
    assert lines[0] == lines[1] == library, lines


def _raise_sites() -> dict[tuple[str, int], str]:
    """(file, line) -> the first text of the message of every raise in the CHECKED functions."""
    sites = {}
    for rel, functions in CHECKED.items():
        source = (ROOT / rel).read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name in functions:
                for r in ast.walk(node):
                    if isinstance(r, ast.Raise):
                        sites[(rel, r.lineno)] = re.sub(r"\s+", " ", ast.get_source_segment(source, r) or "")
    return sites


def test_every_refusal_in_the_code_has_a_row(tmp_path):
    """Run every row under a line tracer: each raise of the CHECKED functions is reached by a row, or is listed in
    UNREACHABLE_FROM_A_FILE with its reason. Control: a raise site no row reaches is reported by name."""
    sites = _raise_sites()
    files = {str(ROOT / rel): rel for rel in CHECKED}
    reached: set[tuple[str, int]] = set()

    def tracer(frame, event, arg):
        rel = files.get(frame.f_code.co_filename)
        if rel is None:
            return None

        def local(frame, event, arg):
            if event == "line":
                reached.add((rel, frame.f_lineno))
            return local
        return local

    for i, (kind, n, section, extra, _) in enumerate(ROWS):
        folder = tmp_path / str(i)
        folder.mkdir()
        path = _write(folder, kind, n, section, extra)
        sys.settrace(tracer)
        try:
            resolve_config(path, for_launch=True)
        except HfGradfixError:
            pass
        finally:
            sys.settrace(None)
    exempt = [(site, text) for site, text in sites.items()
              if any(rel == site[0] and needle in text for (rel, needle) in UNREACHABLE_FROM_A_FILE)]
    missing = [f"{rel}:{line}: {text[:120]}" for (rel, line), text in sites.items()
               if (rel, line) not in reached and ((rel, line), text) not in exempt]
    assert not missing, "refusals without a row in docs/refusals.md:\n" + "\n".join(missing)
    stale = [needle for (rel, needle) in UNREACHABLE_FROM_A_FILE
             if not any(r == rel and needle in text for (r, _), text in sites.items())]
    assert not stale, f"UNREACHABLE_FROM_A_FILE names raises that no longer exist: {stale}"
    assert len(reached & set(sites)) >= 20  # the tracer saw the rows' refusals (not a check of nothing)
