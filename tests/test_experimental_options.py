"""The product's options apart from the lab's: ``OptimizeConfig`` keeps the fields a user sets,
the A/B and development switches live in ``OptimizeConfig.experimental``
(:class:`~onnxcampo.config.ExperimentalOptions`).

1. Given as a mapping (``optimize(model, experimental={...})``, ``OptimizeConfig(experimental=...)``,
   ``config.replace(experimental=...)``), it is checked: an unknown key is a ConfigError naming
   the closest option, a value of the wrong type a ConfigError; a mapping is merged over the
   config's own options.
2. ``--experimental KEY=VALUE`` (repeatable) reads VALUE as the option's type; the options' old
   flags are gone from ``--help``, and using one names the ``--experimental`` setting.
3. The switches still reach the passes: the written model changes with them.
"""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
from helpers import BIAS_GRADIENT, one_error_line, parse, run_cli


import onnxcampo
from onnxcampo.cli import build_parser, config_from_args
from onnxcampo.config import ExperimentalOptions, OptimizeConfig, parse_experimental
from onnxcampo.errors import ConfigError

EXAMPLE = str(resources.files("onnxcampo.examples") / "mlp_block.onnx")
PIN = ("--input-shape", "x:64,256")


def test_the_product_config_has_at_most_22_public_fields():
    public = [f.name for f in dataclasses.fields(OptimizeConfig) if not f.name.startswith("_")]
    assert len(public) <= 22, public
    assert not set(public) & set(ExperimentalOptions.names())


def test_the_experimental_options_keep_the_product_defaults():
    assert dataclasses.asdict(OptimizeConfig().experimental) == {
        "compare_plans": True, "pad_tensor_cores": True, "cost_graph": "ort", "profile": "predict", "int8_avg": False,
        "plan_for_fusion": True, "yield_to_ort_fusions": False, "fuse_row_gradients": True, "batchnorm_sums": False, "means_end_deny": False,
        "fuse_column_sums": True, "channels_last_stem": 4, "check_invariants": False, "static_shapes": False,
            "attention_bias": True, "attention_fusion": True}
    assert OptimizeConfig().experimental.changed() == {}


def test_every_experimental_option_is_documented():
    doc = ExperimentalOptions.__doc__
    assert all(f"        {name}: " in doc for name in ExperimentalOptions.names())


def test_a_mapping_is_checked_and_becomes_experimental_options():
    config = OptimizeConfig(experimental={"fuse_column_sums": False})
    assert isinstance(config.experimental, ExperimentalOptions)
    assert config.experimental.fuse_column_sums is False and config.experimental.changed() == {"fuse_column_sums": False}


def test_an_unknown_key_names_the_closest_option():
    with pytest.raises(ConfigError, match=r"unknown experimental option 'fuse_colum_sums': did you mean "
                                          r"'fuse_column_sums'\?.*channels_last_stem"):
        OptimizeConfig(experimental={"fuse_colum_sums": False})
    with pytest.raises(ConfigError, match="did you mean 'plan_for_fusion'"):
        OptimizeConfig().with_experimental(plan_for_fusions=False)


@pytest.mark.parametrize("options,message", [
    ({"fuse_column_sums": "no"}, "fuse_column_sums must be True or False"),
    ({"check_invariants": 1}, "check_invariants must be True or False"),
    ({"channels_last_stem": 4.0}, "channels_last_stem must be an integer"),
    ({"channels_last_stem": False}, "channels_last_stem must be an integer"),
    ({"channels_last_stem": 2}, "channels_last_stem must be 0"),
    ({"cost_graph": 1}, "cost_graph must be a string"),
    ({"cost_graph": "tensorrt"}, "unknown cost graph 'tensorrt'"),
    ({"profile": "gpu"}, "unknown profile mode 'gpu'"),
])
def test_a_value_of_the_wrong_type_is_a_config_error(options, message):
    with pytest.raises(ConfigError, match=message):
        OptimizeConfig(experimental=options)


def test_experimental_is_a_mapping_or_experimental_options():
    with pytest.raises(ConfigError, match="experimental must be a mapping"):
        OptimizeConfig(experimental=["fuse_column_sums"])


def test_a_moved_option_given_flat_says_where_it_lives():
    with pytest.raises(ConfigError, match=r"fuse_column_sums is an experimental option: "
                                          r"experimental=\{'fuse_column_sums': \.\.\.\}"):
        onnxcampo.optimize(EXAMPLE, fuse_column_sums=False)
    with pytest.raises(ConfigError, match="unknown option 'polcy': did you mean 'policy'"):
        OptimizeConfig().replace(polcy="amp")


def test_replace_merges_an_experimental_mapping_and_with_experimental_changes_one():
    config = OptimizeConfig(policy="amp").with_experimental(fuse_column_sums=False)
    merged = config.replace(experimental={"channels_last_stem": 8})
    assert merged.experimental.changed() == {"fuse_column_sums": False, "channels_last_stem": 8}
    assert merged.policy == "amp"
    replaced = config.replace(experimental=ExperimentalOptions(int8_avg=True))
    assert replaced.experimental.changed() == {"int8_avg": True}
    assert config.experimental.changed() == {"fuse_column_sums": False}  # frozen: the original is unchanged


@pytest.mark.parametrize("text,expected", [
    ("fuse_column_sums=false", ("fuse_column_sums", False)),
    ("fuse_column_sums=True", ("fuse_column_sums", True)),
    ("int8_avg=on", ("int8_avg", True)),
    ("channels_last_stem=8", ("channels_last_stem", 8)),
    ("cost_graph=onnx", ("cost_graph", "onnx")),
    ("cost-graph=onnx", ("cost_graph", "onnx")),
])
def test_experimental_text_is_read_as_the_options_type(text, expected):
    assert parse_experimental(text) == expected


@pytest.mark.parametrize("text,message", [
    ("fuse_column_sums", "expected KEY=VALUE"),
    ("fuse_column_sums=maybe", "fuse_column_sums takes true or false"),
    ("channels_last_stem=four", "channels_last_stem takes an integer"),
    ("fuse_colum_sums=false", "did you mean 'fuse_column_sums'"),
])
def test_bad_experimental_text_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=f"--experimental '{text}': .*{message}"):
        parse_experimental(text)


def test_repeated_experimental_flags_and_debug_reach_the_config():
    args = build_parser().parse_args(["optimize", "m.onnx", "o.onnx", "--experimental", "fuse_column_sums=false",
                                      "--experimental", "channels_last_stem=0", "--debug"])
    assert config_from_args(args).experimental.changed() == {"fuse_column_sums": False, "channels_last_stem": 0,
                                                     "check_invariants": True}


def test_the_old_flags_are_gone_from_help_and_name_their_experimental_setting(capsys, tmp_path):
    for command in ("optimize", "inspect", "bench"):
        text = next(p for line, _, p in _commands() if line == f"onnxcampo {command}").format_help()
        assert "--experimental KEY=VALUE" in text, command
        for flag in ("--no-fuse-column-sums", "--no-plan-for-fusion", "--yield-to-ort-fusions",
                     "--no-fuse-row-gradients", "--channels-last-stem", "--no-compare-plans", "--no-pad",
                     "--cost-graph", "--profile", "--int8-avg"):
            assert flag not in text, (command, flag)
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--no-fuse-column-sums")
    assert code == 2
    one_error_line(err, "--no-fuse-column-sums", "--experimental fuse_column_sums=false")


def test_a_bad_experimental_flag_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--experimental", "fuse_colum_sums=0")
    assert code == 2
    one_error_line(err, "--experimental 'fuse_colum_sums=0'", "did you mean 'fuse_column_sums'?")
    assert not (tmp_path / "o.onnx").exists()


def _commands():
    from onnxcampo.cli.reference import commands

    return commands(build_parser())


# --- the switches reach the passes ------------------------------------------------------------


def test_fuse_column_sums_off_keeps_the_block_reduce_sum_in_the_written_model(library):
    """Both fusions on: the bias gradient's column sums are the FusedElementwise node's
    ``column_sums``; with ``experimental={"fuse_column_sums": False}`` a BlockReduceSum stays."""
    options = dict(policy="fp16", fuse="none", fuse_elementwise=True, fuse_reductions=True)
    fused = onnxcampo.optimize(parse(BIAS_GRADIENT), **options)
    apart = onnxcampo.optimize(parse(BIAS_GRADIENT), **options, experimental={"fuse_column_sums": False})
    assert fused.report["fuse_elementwise"]["column_sums"] == 1
    assert "BlockReduceSum" not in [n.op_type for n in fused.model.graph.node]
    assert apart.report["fuse_elementwise"]["column_sums"] == 0
    assert "BlockReduceSum" in [n.op_type for n in apart.model.graph.node]
    assert apart.report["experimental"] == {"fuse_column_sums": False} and fused.report["experimental"] == {}


def test_compare_plans_off_keeps_campos_plan_whatever_the_prediction():
    """The MLP block at 16384 rows: campo's plan is predicted about 3 % faster than fp32, less
    than a min_gain of 50 %: fp32 is kept, unless ``compare_plans`` is off."""
    options = dict(input_shapes={"x": (16384, 256)}, min_gain=0.5)
    compared = onnxcampo.optimize(EXAMPLE, **options)
    own = onnxcampo.optimize(EXAMPLE, **options, experimental={"compare_plans": False})
    assert (compared.report["chosen_plan"], compared.report["nodes_fp16"]) == ("fp32", 0)
    assert own.report["chosen_plan"] == "campo" and own.report["nodes_fp16"] > 0


def test_messages_name_an_experimental_option_as_the_caller_gives_it():
    from onnxcampo.errors import command_line, option

    assert option("fuse_column_sums", False) == "experimental={'fuse_column_sums': False}"
    with command_line():
        assert option("fuse_column_sums", False) == "--experimental fuse_column_sums=false"
        assert option("channels_last_stem", 8) == "--experimental channels_last_stem=8"
