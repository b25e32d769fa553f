"""docs/guide/cli-reference.md is rendered from the parser, so every option is documented once.

If a test here fails after a change to ``onnxcampo/cli/``, run ``python -m onnxcampo.cli.reference``
and commit the file it rewrites.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from onnxcampo.cli import reference as cli_reference
from onnxcampo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "guide" / "cli-reference.md"


def _walk(parser: argparse.ArgumentParser, line: str = "onnxcampo"):
    """Every (sub)command's command line and parser, read from argparse directly."""
    yield line, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{line} {name}")


def _sections(text: str) -> dict[str, str]:
    """The reference's text under each ``## `command` `` heading."""
    parts = re.split(r"^## `([^`]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_committed_reference_is_what_the_parser_renders():
    assert REFERENCE.read_text(encoding="utf-8") == cli_reference.render(), (
        "docs/guide/cli-reference.md is out of date: run python -m onnxcampo.cli.reference")


def test_every_option_and_argument_of_every_command_has_a_row_in_its_section():
    sections = _sections(REFERENCE.read_text(encoding="utf-8"))
    for line, parser in _walk(build_parser()):
        assert line in sections, f"no section for {line}"
        rows = [row for row in sections[line].splitlines() if row.startswith("| `")]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            names = action.option_strings or [action.metavar or action.dest]
            row = next((r for r in rows if f"`{names[0]}`" in r.split(" | ")[0]), None)
            assert row is not None, f"{line} {names[0]} is missing from the reference"
            assert all(f"`{name}`" in row for name in names), (line, names)


def test_every_option_has_a_help_text_and_repeatable_ones_say_so():
    for line, parser in _walk(build_parser()):
        for action in cli_reference.arguments(parser):
            name = (action.option_strings or [action.dest])[-1]
            assert action.help, f"{line} {name} has no help text"
            if isinstance(action, argparse._AppendAction):
                assert "repeatable" in action.help, f"{line} {name} is repeatable; its help does not say so"


def test_no_other_doc_repeats_an_option_table():
    """An option is described in its help text and rendered into the reference, nowhere else at
    length: no other markdown table has a row per option."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    offenders = [f"{path.relative_to(ROOT)}: {row[:60]}"
                 for path in docs if path != REFERENCE
                 for row in path.read_text(encoding="utf-8").splitlines()
                 if re.match(r"^\|\s*`--?[a-z]", row)]
    assert not offenders, offenders


def test_check_mode_says_whether_the_file_is_current(tmp_path, capsys):
    stale = tmp_path / "cli-reference.md"
    stale.write_text("old\n", encoding="utf-8")
    assert cli_reference.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert stale.read_text(encoding="utf-8") == "old\n"
    assert cli_reference.main([str(stale)]) == 0
    assert cli_reference.main(["--check", str(stale)]) == 0
