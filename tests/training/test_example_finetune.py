"""The finetune subcommand (benchmarks/finetune.py), the documented fine-tuning example: magika (a corpus model) with a
new 7-way head, trained on the files the installed matplotlib ships. A short run (16 steps on ORT
CPU, a few seconds) must write its JSON and loss-curve PNG and bring the training loss down; the
committed curve is docs/benchmarks/training/finetune-magika-cpu.png (120 steps)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxcampo.benchmarks import corpus
from onnxcampo.benchmarks import finetune

pytest.importorskip("matplotlib")  # the data are matplotlib's own files


@pytest.mark.slow
@pytest.mark.corpus
def test_the_finetuning_example_brings_the_loss_down(tmp_path, capsys):
    try:
        corpus.fetch(corpus.get("magika"))
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")
    assert finetune.main(["--steps", "16", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "finetune-magika-cpu.json").read_text())
    assert (tmp_path / "finetune-magika-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    losses = result["losses"]
    assert len(losses) == 16 and np.isfinite(losses).all()
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
    assert result["held_out_after"]["loss"] < result["held_out_before"]["loss"]
    assert result["data"]["train_rows"] > 100 and len(result["data"]["kinds"]) == 7
    assert "held out: loss" in capsys.readouterr().out


def test_files_are_read_as_magika_reads_them(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"  \n" + b"a" * 3000 + b"b" * 10 + b"\n\n")
    tokens = finetune.features(path)
    assert tokens.shape == (2048,) and tokens.dtype == np.int32
    assert (tokens[:1024] == ord("a")).all()  # leading whitespace stripped
    assert (tokens[-10:] == ord("b")).all() and tokens[-11] == ord("a")  # trailing whitespace stripped
    path.write_bytes(b"xyz")
    tokens = finetune.features(path)
    assert list(tokens[:4]) == [120, 121, 122, 256] and list(tokens[-4:]) == [256, 120, 121, 122]
