"""``onnxcampo.training.export``: a PyTorch module exported for training, with both torch.onnx
exporters, trains what PyTorch trains (the same losses step by step on the CPU), its parameters
by their names, BatchNorm in training mode; what cannot be, one clear error and nothing written."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnxcampo.errors import ConfigError  # noqa: E402
from onnxcampo.training import Trainer, build_train_step, step_spec  # noqa: E402
from onnxcampo.training.export import export  # noqa: E402

V, S, H, B = 64, 16, 32, 4
EXPORTERS = ["dynamo", "torchscript"]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(H), torch.nn.LayerNorm(H)
        self.qkv, self.proj = torch.nn.Linear(H, 3 * H), torch.nn.Linear(H, H)
        self.fc, self.out = torch.nn.Linear(H, 4 * H), torch.nn.Linear(4 * H, H)
        self.register_buffer("causal", torch.tril(torch.ones(S, S, dtype=torch.bool)))

    def forward(self, x):
        q, k, v = (t.view(B, S, 2, H // 2).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(H, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(H // 2)
        attention = scores.masked_fill(~self.causal, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(B, S, H))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TinyGPT(torch.nn.Module):
    """GPT-2's shape in small: token and position embeddings, two pre-norm blocks with causal
    attention, the LM head tied to the token embedding (fresh LayerNorms: equal values)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(V, H), torch.nn.Embedding(S, H)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.ln = torch.nn.LayerNorm(H)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(S))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).reshape(B * S, V)


class SmallResNet(torch.nn.Module):
    """A ResNet's stem and one block, BatchNorm after each convolution."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        return self.fc(torch.relu(self.bn2(self.conv2(h)) + h).mean((2, 3)))


def side_by_side(module_class, batch, labels, path, exporter, *, steps, optimizer="sgd", lr=0.1, **torch_options):
    """Losses of the exported step and of PyTorch (eager fp32), from the same initialization."""
    torch.manual_seed(0)
    module = module_class()
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    export(module, (batch,), path, exporter=exporter)
    trainer = Trainer(build_train_step(path, loss="cross_entropy", optimizer=optimizer, lr=lr), provider="cpu")
    twin = module_class()
    twin.load_state_dict(start)
    twin.train()
    sgd = torch.optim.SGD(twin.parameters(), lr=lr, **torch_options)
    name = next(n for n in step_spec(trainer.model).batch if n != "labels")
    ours, theirs = [], []
    for _ in range(steps):
        ours.append(trainer.step({name: batch.numpy(), "labels": labels}))
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(batch), torch.from_numpy(labels))
        loss.backward()
        sgd.step()
        theirs.append(loss.item())
    return np.array(ours), np.array(theirs), trainer, twin


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_tiny_gpt2_trains_as_in_pytorch_for_30_steps(exporter, tmp_path):
    rng = np.random.default_rng(0)
    ids, labels = torch.from_numpy(rng.integers(0, V, (B, S))), rng.integers(0, V, B * S)
    ours, theirs, trainer, twin = side_by_side(TinyGPT, ids, labels, tmp_path / "gpt.onnx", exporter, steps=30)
    assert theirs[-1] < theirs[0] / 4  # it learns
    np.testing.assert_allclose(ours, theirs, rtol=1e-2)  # the target: within 1 %
    weights = step_spec(trainer.model).weights
    assert set(weights) == {name for name, _ in TinyGPT().named_parameters()}  # the head is wte, tied
    np.testing.assert_allclose(trainer.state_dict()["wte.weight"], twin.wte.weight.detach().numpy(), rtol=1e-3,
                               atol=1e-5)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_batchnorm_trains_with_batch_statistics_and_moves_its_running_ones(exporter, tmp_path):
    rng = np.random.default_rng(1)
    x, labels = torch.from_numpy(rng.standard_normal((8, 3, 16, 16)).astype(np.float32)), rng.integers(0, 10, 8)
    ours, theirs, trainer, twin = side_by_side(SmallResNet, x, labels, tmp_path / "cnn.onnx", exporter, steps=10,
                                               optimizer="momentum", lr=0.05, momentum=0.9)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    state = trainer.state_dict()
    for bn in ("bn1", "bn2"):
        for stat in ("running_mean", "running_var"):
            np.testing.assert_allclose(state[f"{bn}.{stat}"], getattr(twin, bn).state_dict()[stat].numpy(),
                                       rtol=1e-4, atol=1e-6)
    assert set(step_spec(trainer.model).weights) == {name for name, _ in SmallResNet().named_parameters()}


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_module_is_left_as_it_was(exporter, tmp_path):
    module = SmallResNet().eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    export(module, torch.randn(4, 3, 8, 8), tmp_path / "cnn.onnx", exporter=exporter)
    assert not module.training
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # tracing moved no statistic


def test_buffers_and_frozen_parameters_do_not_train(tmp_path):
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.frozen = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
            self.frozen.requires_grad_(False)
            self.register_buffer("offset", torch.randn(8))

        def forward(self, x):
            return self.frozen(self.fc(x) + self.offset)

    path = export(WithBuffer(), torch.randn(2, 8), tmp_path / "m.onnx", exporter="torchscript")
    step = build_train_step(path, loss="cross_entropy", optimizer="sgd")
    assert set(step_spec(step).weights) == {"fc.weight", "fc.bias"}


def test_a_parameter_that_does_not_reach_the_output_is_one_error_and_nothing_is_written(tmp_path):
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    path = tmp_path / "m.onnx"
    with pytest.raises(ConfigError, match="parameter unused.weight is not in the exported graph|unused.weight"):
        export(Unused(), torch.randn(2, 4), path, exporter="torchscript")
    assert not path.exists()


def test_what_is_not_a_module_or_an_exporter_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        export(lambda x: x, torch.randn(2), tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="exporter must be one of"):
        export(SmallResNet(), torch.randn(2, 3, 8, 8), tmp_path / "m.onnx", exporter="jit")
    assert not (tmp_path / "m.onnx").exists()
    assert onnx  # the written models are plain ONNX files (read above through build_train_step)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_transformers_gpt2_exports_with_its_parameters_and_tied_head(exporter, attention, tmp_path):
    """transformers' GPT-2 (two small layers, its tied LM head), both attention implementations:
    the step trains exactly the module's parameters, by their names."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=500, n_positions=64, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, attn_implementation=attention)
    torch.manual_seed(0)
    inner = transformers.GPT2LMHeadModel(config)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = inner

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits.reshape(-1, 500)

    module = LM()
    ids = torch.randint(0, 500, (2, 32))
    step = build_train_step(export(module, (ids,), tmp_path / "gpt2.onnx", exporter=exporter), loss="cross_entropy",
                            optimizer="sgd", lr=0.05)
    assert set(step_spec(step).weights) == {name for name, _ in module.named_parameters()}
    labels = np.random.default_rng(0).integers(0, 500, 64)
    losses = [Trainer(step, provider="cpu").step({"input_ids": ids.numpy(), "labels": labels}) for _ in range(1)]
    expected = torch.nn.functional.cross_entropy(module(ids), torch.from_numpy(labels)).item()
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)
