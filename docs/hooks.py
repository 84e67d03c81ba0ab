"""mkdocs hooks: the pages that must not drift from the code are generated at build time.

A page holds a marker comment on a line of its own; ``on_page_markdown`` replaces it:

- ``<!-- generated: config-reference -->``: every key of :class:`hf_gradfix.GradFixConfig` (section, key, type,
  default, allowed values or range, help), read from the schema's dataclasses and their field metadata;
- ``<!-- generated: cli-reference -->``: ``hf-gradfix --help`` and every subcommand's ``--help``, produced by the
  real parsers through the console script's entry point (``hf_gradfix.cli.main``);
- ``<!-- generated: api-top-level -->``: one mkdocstrings block per name in ``hf_gradfix.__all__``, at the module
  where the object is defined today (the top-level names are loaded lazily, so they are resolved here, not
  written down by module path).

The functions are importable so that tests can check the generated text (``tests/project/test_docs.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLI_COMMANDS: list[list[str]] = [[], ["launch"], ["config", "check"], ["configs"], ["env"], ["verify"], ["plan"]]


def _type_name(tp: typing.Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _yaml_value(value: typing.Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return str(value)


def _range(meta: typing.Mapping[str, typing.Any]) -> str:
    parts = []
    if "above" in meta:
        parts.append(f"> {meta['above']}")
    if "min" in meta:
        parts.append(f">= {meta['min']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    text = ", ".join(parts)
    if "special" in meta:
        text += f" (or {meta['special']})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_rows(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, help) for every setting of the schema, sections flattened with dots."""
    if cls is None:
        from hf_gradfix.config import GradFixConfig

        cls = GradFixConfig
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(config_rows(tp, prefix + f.name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((prefix + f.name, _type_name(tp), _yaml_value(default), _range(f.metadata),
                     f.metadata.get("help", "")))
    return rows


def config_reference() -> str:
    from hf_gradfix.config import GradFixConfig

    hints = typing.get_type_hints(GradFixConfig)
    out = []
    top = [r for r in config_rows() if "." not in r[0]]
    for f in dataclasses.fields(GradFixConfig):
        tp = hints[f.name]
        if not dataclasses.is_dataclass(tp):
            continue
        out.append(f"### `{f.name}`\n")
        out.append((tp.__doc__ or f.metadata.get("help", "")).strip().splitlines()[0].replace("``", "`") + "\n")
        out.append("| key | type | default | range | meaning |\n|---|---|---|---|---|")
        for key, tname, default, rng, help_ in config_rows(tp, f.name + "."):
            out.append(f"| `{key}` | {_cell(tname)} | `{default}` | {_cell(rng)} | {_cell(help_)} |")
        out.append("")
    if top:
        out.append("### Top-level keys\n")
        out.append("| key | type | default | range | meaning |\n|---|---|---|---|---|")
        for key, tname, default, rng, help_ in top:
            out.append(f"| `{key}` | {_cell(tname)} | `{default}` | {_cell(rng)} | {_cell(help_)} |")
        out.append("")
    return "\n".join(out)


def cli_help(argv: list[str]) -> str:
    """What ``hf-gradfix ARGV --help`` prints, from the real parser (in-process, nothing runs)."""
    from hf_gradfix.cli import main

    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "120"
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


def cli_reference() -> str:
    out = []
    for argv in CLI_COMMANDS:
        name = " ".join(["hf-gradfix", *argv])
        out.append(f"## `{name}`\n")
        out.append(f"```text\n$ {name} --help\n{cli_help(argv)}\n```\n")
    return "\n".join(out)


def api_top_level() -> str:
    import hf_gradfix

    out = []
    for name in sorted(hf_gradfix.__all__, key=str.lower):
        obj = getattr(hf_gradfix, name)
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", name)
        out.append(f"::: {module}.{qualname}\n    options:\n      heading_level: 3\n")
    return "\n".join(out)


_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


class _DoctestBlocks:
    """A Markdown extension: ``>>>`` doctest runs in docstrings become ``pycon`` code blocks.

    The docstrings carry doctests (run by ``pytest --doctest-modules``) as plain paragraphs; as Markdown their
    ``x[0]["key"]`` would read as reference links.  A run starts at a ``>>>`` line and ends at a blank line.
    """

    @staticmethod
    def extension():
        from markdown import Extension
        from markdown.preprocessors import Preprocessor

        class _Pre(Preprocessor):
            def run(self, lines):
                out, inside, fence = [], False, False
                for line in lines:
                    stripped = line.lstrip()
                    if stripped.startswith("```"):
                        fence = not fence
                    if not fence and not inside:  # Sphinx roles (:class:`~x.Y`) read as code
                        line = _ROLE.sub(lambda m: f"`{m[1]}`", line)
                    if not fence and not inside and stripped.startswith(">>> ") and len(line) - len(stripped) < 4:
                        indent = line[: len(line) - len(stripped)]
                        out += ["", indent + "```pycon"]
                        inside = True
                    elif inside and not stripped:
                        out += [indent + "```", ""]
                        inside = False
                    out.append(line)
                if inside:
                    out.append(indent + "```")
                return out

        class _Ext(Extension):
            def extendMarkdown(self, md):
                md.preprocessors.register(_Pre(md), "hf_gradfix_doctest_blocks", 29)

        return _Ext()


def on_config(config: typing.Any, **kwargs: typing.Any) -> typing.Any:
    config.markdown_extensions.append(_DoctestBlocks.extension())
    return config


_GENERATORS = {
    "<!-- generated: config-reference -->": config_reference,
    "<!-- generated: cli-reference -->": cli_reference,
    "<!-- generated: api-top-level -->": api_top_level,
}


def on_page_markdown(markdown: str, **kwargs: typing.Any) -> str:
    for marker, generate in _GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
