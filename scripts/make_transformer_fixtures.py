"""Write ``tests/fixtures/transformers/*.onnx``: tiny randomly initialised transformers models
exported as users export them, for ``--fuse auto``'s detection tests (``tests/rewrites/test_transformer.py``).

Each model (BERT, RoBERTa, a MiniLM-like BERT, GPT-2, GPT-2 with its LM head) is built from a
transformers config (no download) with SDPA attention (transformers' default) and, for BERT and
GPT-2, eager attention too; each is exported by torch.onnx's default exporter (``dynamo``,
opset 18) and its TorchScript one (``torchscript``, opset 17), batch and sequence dynamic, and
written with IR version 10 at most. Needs torch and transformers:

    pip install torch 'transformers>=5' onnx onnxscript onnxruntime
    python scripts/make_transformer_fixtures.py [--out tests/fixtures/transformers]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import onnx
import torch
import transformers

from onnxcampo.runtime import make_session

SEQ, VOCAB = 16, 100
BERT = {"vocab_size": VOCAB, "max_position_embeddings": 32, "type_vocab_size": 2, "hidden_act": "gelu"}
GPT2 = {"vocab_size": VOCAB, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64,
        "use_cache": False}
# name: (model class, config class, config, attention implementations)
MODELS = {
    "bert": (transformers.BertModel, transformers.BertConfig,
             dict(BERT, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
             ("sdpa", "eager")),
    "roberta": (transformers.RobertaModel, transformers.RobertaConfig,
                dict(BERT, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=40, type_vocab_size=1, pad_token_id=1),
                ("sdpa",)),
    "minilm": (transformers.BertModel, transformers.BertConfig,
               dict(BERT, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, intermediate_size=48),
               ("sdpa",)),
    "gpt2": (transformers.GPT2Model, transformers.GPT2Config, GPT2, ("sdpa", "eager")),
    "gpt2_lm": (transformers.GPT2LMHeadModel, transformers.GPT2Config, GPT2, ("sdpa",)),
}
EXPORTERS = {"dynamo": 18, "torchscript": 17}


def inputs(name: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=generator)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    mask[1, SEQ // 2:] = 0  # right padding, as tokenizers pad
    feeds = {"input_ids": ids, "attention_mask": mask}
    if name in ("bert", "minilm"):
        feeds["token_type_ids"] = torch.zeros(2, SEQ, dtype=torch.int64)
    return feeds


class FirstOutput(torch.nn.Module):
    """The model called with its inputs by name, returning its first output (the hidden states,
    or the LM head's logits)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)[0]


def export(model: torch.nn.Module, feeds: dict[str, torch.Tensor], exporter: str) -> onnx.ModelProto:
    names = list(feeds)
    outputs = ["logits"] if isinstance(model, transformers.GPT2LMHeadModel) else ["last_hidden_state"]
    wrapped, args, buffer = FirstOutput(model), tuple(feeds.values()), io.BytesIO()
    if exporter == "dynamo":
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=32)
        program = torch.onnx.export(wrapped, args, dynamo=True, opset_version=EXPORTERS[exporter],
                                    input_names=names, output_names=outputs,
                                    dynamic_shapes={name: {0: batch, 1: seq} for name in names})
        program.save(buffer)
    else:
        axes = {name: {0: "batch", 1: "sequence"} for name in names + outputs}
        torch.onnx.export(wrapped, args, buffer, dynamo=False, opset_version=EXPORTERS[exporter],
                          input_names=names, output_names=outputs, dynamic_axes=axes)
    proto = onnx.load_from_string(buffer.getvalue())
    proto.ir_version = min(proto.ir_version, 10)
    for node in proto.graph.node:  # the exporter's stack traces and module paths: size, and local paths
        del node.metadata_props[:]
        node.doc_string = ""
    return proto


def write_fixtures(out: Path) -> list[Path]:
    """Export every model of :data:`MODELS` with every attention and exporter into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (model_class, config_class, config, attentions) in MODELS.items():
        for attention in attentions:
            torch.manual_seed(0)
            model = model_class(config_class(**config, attn_implementation=attention)).eval()
            with torch.no_grad():  # biases and norm scales away from 0 and 1: no two weights alike
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.02)
            feeds = inputs(name)
            for exporter in EXPORTERS:
                with torch.no_grad():
                    proto = export(model, feeds, exporter)
                onnx.checker.check_model(proto, full_check=True)
                path = out / f"{name}_{attention}_{exporter}.onnx"
                onnx.save(proto, path)
                make_session(path).run(None, {name: value.numpy() for name, value in feeds.items()})
                paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tests/fixtures/transformers")
    for path in write_fixtures(parser.parse_args().out):
        print(f"{path.name}: {path.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
