"""The command line's parser: no abbreviations, checked names, help for every option, grouped
help with examples, -q and --log-file; the API names its own arguments in errors.

A user error prints one line on stderr (``onnxcampo: error: ...``) and exits 2, no traceback."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from importlib import resources

import pytest

from onnxcampo import optimize
from onnxcampo.cli import EPILOGS, build_parser
from onnxcampo.cli.reference import arguments, commands
from onnxcampo.errors import ConfigError, ShapeError
from helpers import one_error_line, run_cli

EXAMPLE = str(resources.files("onnxcampo.examples") / "mlp_block.onnx")
PIN = ("--input-shape", "x:64,256")




def _parsers():
    return [(line, parser) for line, _, parser in commands(build_parser())]


@pytest.mark.parametrize("line,parser", _parsers(), ids=[line for line, _ in _parsers()])
def test_no_parser_accepts_abbreviations(line, parser):
    assert parser.allow_abbrev is False, line


@pytest.mark.parametrize("line,parser", _parsers(), ids=[line for line, _ in _parsers()])
def test_every_option_has_help(line, parser):
    missing = [a.option_strings or a.dest for a in arguments(parser) if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, f"{line}: {missing}"


@pytest.mark.parametrize("line,parser", _parsers()[1:], ids=[line for line, _ in _parsers()[1:]])
def test_every_subcommand_help_has_groups_and_examples(line, parser):
    """--help: options in titled groups (the common ones last), then examples of the command."""
    text = parser.format_help()
    assert "common options:" in text or line == "onnxcampo costdb", line
    assert "\nexamples:\n  onnxcampo " in text, line
    assert parser.epilog == EPILOGS[line.split()[-1]]


def test_optimize_help_groups_the_plan_options():
    text = next(p for line, p in _parsers() if line == "onnxcampo optimize").format_help()
    titles = ["precision plan:", "input shapes:", "timing and tuning:", "cost model and graph fusion:",
              "report and validation:", "common options:"]
    assert all(title in text for title in titles)
    plan, shapes = text.index("\nprecision plan:"), text.index("\ninput shapes:")
    assert plan < text.index("\n  --exclude-op") < shapes < text.index("\n  --dim NAME=VALUE")


def test_an_abbreviated_option_is_an_error_naming_the_option(tmp_path, capsys):
    """--input-shap was taken as --input-shape: now one line, the closest option named."""
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", "--input-shap", "x:64,256")
    assert code == 2
    one_error_line(err, "onnxcampo optimize", "unrecognized arguments: --input-shap", "did you mean '--input-shape'?")
    assert not (tmp_path / "o.onnx").exists()
    code, _, err = run_cli(capsys, "costdb", "fit", "a.jsonl", "b.json", "--hold", "0.1")
    assert code == 2
    one_error_line(err, "onnxcampo costdb fit", "--hold", "'--holdout'")


def test_usage_errors_are_one_line(capsys):
    code, _, err = run_cli(capsys, "optimiz")
    assert code == 2
    one_error_line(err, "invalid choice: 'optimiz'")
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, "o.onnx", "--policy", "fastest")
    assert code == 2
    one_error_line(err, "--policy", "fastest")


def test_help_exits_0(capsys):
    code, out, _ = run_cli(capsys, "optimize", "--help")
    assert code == 0 and "examples:" in out


@pytest.mark.parametrize("flag,name,fragments", [
    ("--exclude-op", "Matmul", ("--exclude-op", "'Matmul'", "did you mean 'MatMul'?")),
    ("--include-op", "Softmaxx", ("--include-op", "'Softmaxx'", "did you mean 'Softmax'?")),
    ("--exclude-op", "NoSuchOp", ("--exclude-op", "'NoSuchOp'")),
])
def test_unknown_op_types_are_errors_with_the_closest_name(tmp_path, capsys, flag, name, fragments):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, flag, name)
    assert code == 2
    one_error_line(err, *fragments)
    assert not (tmp_path / "o.onnx").exists()


def test_op_types_of_onnx_and_of_the_op_lists_are_accepted(capsys):
    """Not in the model, but valid: ONNX's Softmax, ORT's fused Attention (--fuse makes them)."""
    code, _, err = run_cli(capsys, "inspect", EXAMPLE, *PIN, "--exclude-op", "Softmax", "--include-op", "Attention")
    assert code == 0, err


def test_unknown_dim_names_are_errors_with_the_closest_name(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", "--dim", "batc=64")
    assert code == 2
    one_error_line(err, "--dim", "'batc'", "'batch'", "did you mean 'batch'?")
    code, _, err = run_cli(capsys, "inspect", EXAMPLE, "--dim", "batch=64")
    assert code == 0, err


def test_api_errors_name_api_arguments_not_flags():
    with pytest.raises(ConfigError, match=r"^exclude_ops: unknown op type 'Matmul'.*did you mean 'MatMul'\?") as info:
        optimize(EXAMPLE, exclude_ops={"Matmul"})
    assert "--" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^dim_values: the model has no dim 'batc'") as info:
        optimize(EXAMPLE, dim_values={"batc": 4})
    assert "--" not in str(info.value)
    with pytest.raises(ShapeError, match=r"input_shapes=\{'x': \(N,256\)\} or dim_values=\{'batch': N\}") as info:
        optimize(EXAMPLE)
    assert "--" not in str(info.value)


def test_cli_errors_from_shared_code_name_flags(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx")
    assert code == 2
    one_error_line(err, "--input-shape x:N,256", "--dim batch=N")


@pytest.mark.slow
def test_quiet_prints_nothing_but_warnings_and_errors(tmp_path, capsys):
    code, out, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "-q")
    assert code == 0 and (tmp_path / "o.onnx").exists()
    assert err == "" and out == ""
    code, _, err = run_cli(capsys, "-q", "optimize", EXAMPLE, tmp_path / "p.onnx", *PIN, "--validate")
    assert code == 0 and err == ""  # before the command too
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN)
    assert "wrote" in err  # without -q: the summary


def test_quiet_still_prints_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", "-q")
    assert code == 2
    one_error_line(err, "dynamic dim")


def test_quiet_and_verbose_exclude_each_other(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "-q", "-v")
    assert code == 2
    one_error_line(err, "-q", "-v")


@pytest.mark.slow
def test_log_file_gets_the_full_log(tmp_path, capsys):
    """--log-file: debug and info records, timestamped, while stderr keeps the default level."""
    log = tmp_path / "run.log"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--log-file", log)
    assert code == 0
    text = log.read_text()
    assert " INFO onnxcampo" in text and " DEBUG onnxcampo" in text
    assert "INFO onnxcampo" not in err and "DEBUG" not in err
    logging.getLogger().handlers.clear()  # the file handler, closed with the test's folder


def test_each_distinct_warning_is_shown_once():
    """Distinct: another logger or another formatted message; info lines all pass."""
    from onnxcampo.cli import OncePerRun

    once = OncePerRun()

    def record(name, level, message, *args):
        return logging.LogRecord(name, level, __file__, 1, message, args, None)

    shown = [once.filter(r) for r in (
        record("onnxcampo.api", logging.WARNING, "calibrating on %s inputs", "random"),
        record("onnxcampo.api", logging.WARNING, "calibrating on random inputs"),  # the same text, formatted
        record("onnxcampo.api", logging.WARNING, "calibrating on %s inputs", "given"),
        record("onnxcampo.rewrites.transformer", logging.WARNING, "calibrating on random inputs"),
        record("onnxcampo.api", logging.ERROR, "calibrating on random inputs"),
        record("onnxcampo.api", logging.INFO, "pass done"),
        record("onnxcampo.api", logging.INFO, "pass done"))]
    assert shown == [True, False, True, True, False, True, True]


def test_log_file_in_a_missing_folder_is_refused(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--log-file", tmp_path / "no" / "x.log")
    assert code == 2
    one_error_line(err, "--log-file", "does not exist")


@pytest.mark.slow
def test_missing_onnxruntime_is_one_line_naming_the_extras(tmp_path):
    """The core does not pin ONNX Runtime: without one, a command says which extra installs it."""
    blocked = ("import sys; sys.modules['onnxruntime'] = None; import onnxcampo.install as i; "
               "i.installed_wheels = set; from onnxcampo.cli import main; "
               f"sys.exit(main(['optimize', {EXAMPLE!r}, {str(tmp_path / 'o.onnx')!r}, '--input-shape', 'x:4,256']))")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    one_error_line(done.stderr, "onnxcampo needs ONNX Runtime", "'onnxcampo[cpu]'", "'onnxcampo[gpu]'")
    api = ("import sys; sys.modules['onnxruntime'] = None; import onnxcampo.install as i; i.installed_wheels = set\n"
           "from onnxcampo import optimize")
    done = subprocess.run([sys.executable, "-c", api], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "OnnxRuntimeMissingError: onnxcampo needs ONNX Runtime" in done.stderr


@pytest.mark.parametrize("wheels,fragments", [
    (set(), ("'onnxcampo[cpu]'", "'onnxcampo[gpu]'")),
    ({"onnxruntime", "onnxruntime-gpu"}, ("pip uninstall -y onnxruntime onnxruntime-gpu && pip install",
                                          "uninstalling onnxruntime alone deletes files")),
    ({"onnxruntime-gpu"}, ("pip install --force-reinstall --no-deps onnxruntime-gpu",)),
])
def test_a_broken_onnxruntime_gets_the_command_that_repairs_it(monkeypatch, wheels, fragments):
    from onnxcampo import install

    monkeypatch.setattr(install, "installed_wheels", lambda: set(wheels))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(install.OnnxRuntimeMissingError) as info:
        install.require_onnxruntime()
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("wheels,fragment", [
    ({"onnxruntime", "onnxruntime-gpu"}, "pip uninstall -y onnxruntime onnxruntime-gpu && pip install "
                                         "'onnxruntime-gpu[cuda,cudnn]'"),
    ({"onnxruntime"}, "pip uninstall -y onnxruntime && pip install 'onnxruntime-gpu[cuda,cudnn]'"),
])
def test_the_missing_cuda_provider_hint_says_what_works(monkeypatch, wheels, fragment):
    """Not 'uninstall onnxruntime' alone: with both wheels that deletes files onnxruntime-gpu needs."""
    from onnxcampo import install

    monkeypatch.setattr(install, "installed_wheels", lambda: set(wheels))
    assert fragment in install.cuda_provider_hint()
