"""The command-line reference, ``docs/guide/cli-reference.md``, rendered from the parser.

Every option is documented once, in its help text in its command's module of
:mod:`onnxcampo.cli` (the shared groups in :mod:`onnxcampo.cli.options`); this module renders
every command and subcommand of :func:`onnxcampo.cli.build_parser` (usage, then one table row per
argument: flag, value or choices, default, help) into markdown. ``python -m onnxcampo.cli.reference`` rewrites
the file, ``--check`` only says whether it is current (exit 1 if not); the test suite checks it.

The usage lines are built here rather than by argparse, whose wrapping depends on the terminal
width and the Python version: the file must come out the same everywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from onnxcampo.cli.parser import build_parser

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "cli-reference.md"
REGENERATE = "python -m onnxcampo.cli.reference"


def commands(parser: argparse.ArgumentParser | None = None, prefix: str = "onnxcampo",
             summary: str | None = None) -> Iterator[tuple[str, str | None, argparse.ArgumentParser]]:
    """``(command line, one-line help, parser)`` for the program and every (sub)command, in the
    parser's order, depth first."""
    parser = parser or build_parser()
    yield prefix, summary, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, f"{prefix} {name}", helps.get(name))


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a reader gives: every action but ``--help`` and the subcommand choice."""
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


def _value(action: argparse.Action) -> str:
    """What follows the flag: the choices, else the metavar (argparse's default: the dest)."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        text = "|".join(str(c) for c in action.choices)
    elif action.metavar is not None:
        text = str(action.metavar)
    else:
        text = action.dest if not action.option_strings else action.dest.upper()
    return f"`{text}`"


def _default(action: argparse.Action) -> str:
    if action.required or not action.option_strings:
        return "required"
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action, prog: str) -> str:
    """The help text with argparse's ``%(name)s`` expanded, as ``--help`` prints it."""
    if not action.help:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return action.help % dict(params, prog=prog)


def _cell(text: str) -> str:
    """A markdown table cell: ``|`` would end it (also inside backticks)."""
    return text.replace("|", "\\|")


def _usage(line: str, parser: argparse.ArgumentParser) -> str:
    parts = [line]
    for action in arguments(parser):
        if action.required and action.option_strings:
            parts.append(f"{action.option_strings[-1]} {action.metavar or action.dest.upper()}")
    if any(a.option_strings and not a.required for a in arguments(parser)):
        parts.append("[options]")
    parts.extend(action.metavar or action.dest for action in arguments(parser) if not action.option_strings)
    subs = _subcommands(parser)
    if subs:
        parts.append("{" + ",".join(subs) + "} ...")
    return " ".join(parts)


def _anchor(line: str) -> str:
    """The id GitHub gives the heading ``## `line` ``."""
    return line.replace(" ", "-")


def render() -> str:
    """The whole reference as markdown."""
    out = [
        "# Command-line reference",
        "",
        f"Generated from the parser (`build_parser()` in `onnxcampo/cli/parser.py`) by `{REGENERATE}`: do",
        "not edit this file, edit the help texts in the command's module of `onnxcampo/cli/` (the shared",
        "groups in `onnxcampo/cli/options.py`) and regenerate (`tests/test_cli_reference.py` fails when it",
        "is out of date). What the commands do, exit codes, training, custom ops and fusion:",
        "[cli.md](cli.md). Every command also takes `-h`/`--help`, which prints the same texts.",
        "",
    ]
    entries = list(commands())
    for line, summary, _ in entries[1:]:
        out.append(f"- [`{line}`](#{_anchor(line)}): {summary or ''}".rstrip())
    for line, summary, parser in entries:
        out += ["", f"## `{line}`", ""]
        description = summary or parser.description
        if description:
            out += [description[0].upper() + description[1:] + ".", ""]
        out += ["```", _usage(line, parser), "```"]
        if parser.epilog:  # the examples --help ends with
            out += ["", "Examples:", "", "```", *(example.strip() for example in parser.epilog.splitlines()[1:]), "```"]
        rows = arguments(parser)
        if rows:
            out += ["", "| argument | value | default | description |", "|---|---|---|---|"]
            for action in rows:
                names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
                cells = (names, _value(action) if action.option_strings else "", _default(action),
                         _help(action, parser.prog).replace("<", "\\<"))  # <name> would be read as HTML
                out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=REFERENCE, help="where the reference lives")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is not current")
    args = parser.parse_args(argv)
    if not args.path.parent.is_dir():
        parser.error(f"{args.path.parent} does not exist: run it in a source checkout, or give the path")
    text = render()
    current = args.path.read_text(encoding="utf-8") if args.path.exists() else None
    if args.check:
        if current != text:
            print(f"{args.path} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    if current != text:
        args.path.write_text(text, encoding="utf-8")
        print(f"wrote {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
