"""The one frozen configuration shared by the Python API and the command line: the product's
options (:class:`OptimizeConfig`) and, nested in it, the switches kept for A/B measurements and
development (:class:`ExperimentalOptions`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from onnxcampo.errors import ConfigError, did_you_mean

POLICIES = ("campo", "amp", "fp16", "fp32")
PROFILE_MODES = ("predict", "cpu", "cuda")
TUNE_PROVIDERS = ("cuda", "cpu")
EXECUTION_MODES = ("plain", "cuda-graph")
FUSE_MODES = ("auto", "bert", "gpt2", "none")
COST_GRAPHS = ("ort", "onnx")


def _bool_text(text: str) -> bool:
    folded = text.strip().lower()
    if folded in ("true", "yes", "on", "1"):
        return True
    if folded in ("false", "no", "off", "0"):
        return False
    raise ValueError("expected true or false")


@dataclass(frozen=True)
class ExperimentalOptions:
    """Switches that exist for A/B measurements and for developing onnxcampo, apart from the
    product's options: each default is what ``optimize`` runs, the other values are one arm of a
    measured comparison (the benchmark policy that runs it is named) or a development check.

    Given as ``OptimizeConfig(experimental={...})``, ``optimize(model, experimental={...})``
    (a mapping, merged over the config's own) or ``--experimental KEY=VALUE`` (repeatable); an
    unknown key or a value of the wrong type is a :class:`~onnxcampo.errors.ConfigError`.

    Attributes:
        compare_plans: campo also costs the ``fp32`` and ``amp`` plans and keeps the cheapest (fp32
            unless a mixed plan is ``min_gain`` faster). ``False`` keeps campo's own plan whatever
            the prediction (the benchmark's ``campo-nocost``; ``tune`` times that plan so).
        pad_tensor_cores: campo zero-pads MatMul/Gemm/Conv dims to multiples of 8 where it is
            predicted to pay. ``False`` never pads (the benchmark's ``campo-nopad``; ``tune`` times
            that plan too).
        cost_graph: which node set plans are costed on: ``ort`` (the default) asks ONNX Runtime
            which nodes it will run (its graph optimizations at the extended level on the CPU
            provider, as the CUDA EP fuses them): aliased and absorbed nodes cost nothing, fused
            ones one launch; ``onnx`` costs every ONNX node as a kernel (no ORT session: faster on
            huge graphs; also what happens when ORT cannot load the model).
        profile: where the fp32 node times come from: ``predict`` (the default) the cost model;
            ``cpu`` / ``cuda`` one ONNX Runtime profiling run on that provider (the A/B of the
            cost database against measured times).
        int8_avg: replace MatMulInteger (+ its Cast to float) of quantized graphs by the
            ``ai.onnxcampo::AvgMatMulInteger`` custom op: 16-bit tree-averaging accumulation
            (``docs/avg-matmul.md``). The written model needs the custom-op library to run.
        plan_for_fusion: with ``fuse_elementwise`` / ``fuse_reductions`` / ``channels_last``,
            cost the plans as the rewritten model runs (``onnxcampo.estimate``: a Cast inside a
            fused group costs nothing, one at its edge the bytes it changes there, a fused
            elementwise op its share of the group's kernel; Casts read only by fp32 ReduceSums
            nothing; channels-last convolutions without their layout transforms). ``False``: the
            fusion-blind plan, costed as if the rewrites did not run (every Cast and elementwise
            op a kernel of its own); the rewrites still run after it (the benchmark's
            ``campo-fused-blind-graph``). No effect without a rewrite. The prediction deciding a
            rewrite left None costs the rewrite either way.
        yield_to_ort_fusions: with ``fuse_elementwise``, leave to ONNX Runtime the nodes its own
            graph optimizations fuse or fold (a MatMul's scale Mul into FusedMatMul, a
            LayerNormalization's skip Add, a bias Add into a Gemm; read on the planning graph),
            as the fusion-aware costing assumes. Off by default: no GPU measurement shows it
            faster (the benchmark's ``campo-fused-yield-graph``; docs/ops.md).
        fuse_row_gradients: with ``fuse_reductions``, also write a layer norm's and a softmax's
            input gradient as ``LayerNormGrad`` / ``SoftmaxGrad`` nodes (``onnxcampo.rewrites.norm``).
            ``False`` leaves them to the block reductions and the elementwise fusion (the
            benchmark's ``campo-fused-norows-graph``).
        batchnorm_sums: with ``fuse_reductions``, a training BatchNorm's two forward sums as one
            ``BatchNormStats`` and its two backward sums as one ``BatchNormGradSums`` node, one pass
            over their inputs each instead of a squared or product tensor written and read back
            (``onnxcampo.rewrites.batch_norm``). Off by default: the plan does not price it and no GPU
            measurement shows it faster (``tests/gpu/test_batch_norm_cuda.py`` checks and times its
            kernels; the benchmark's ``campo-fused(-cl)-bnsums-graph`` times the steps).
        means_end_deny: in campo's deny propagation (``onnxcampo.passes.deny_propagation``, rule
            3), a ReduceSum's product with a constant no larger than one over the values summed (a
            mean; a training BatchNorm's backward takes two) stays fp32 and ends the walk, so what
            it feeds is left to the cost passes instead of staying fp32. Off by default: no GPU
            measurement shows it faster or as accurate (the benchmark's
            ``campo-fused-cl-means-graph``; the torchvision ResNet-50 b64 training step with the
            H100 database is predicted 31.9 ms as campo, 26.6 ms all fp16).
        fuse_column_sums: with both fusions, a BlockReduceSum of column sums (a bias gradient) of
            a FusedElementwise node's output becomes that node's ``column_sums`` (its CUDA kernel
            adds the values as it stores them; ``onnxcampo.rewrites.elementwise`` rule 4). ``False``
            keeps the BlockReduceSums (the benchmark's ``campo-fused-nosums-graph`` and
            ``campo-fused-cl-nosums-graph``).
        channels_last_stem: with ``channels_last``, also a stem convolution (fewer than 8 input
            channels, zero-padded to this many: 4, the default, the layout of cuDNN's
            ``image_first_layer`` kernels, or 8; ResNet-50 b64's step 9.904 -> 9.626 ms with 4 on
            the H100) and the MaxPools between channels-last tensors, with onnx-ad's adjoints of
            them, as ``ai.onnxcampo::MaxPoolNhwc`` / ``MaxPoolNhwcGrad`` (no layout Transpose,
            scatter-add or zero fill around a ResNet's stem pool). ``0`` keeps both NCHW (the
            benchmark's ``campo-fused-cl-nostem-graph``; ``campo-fused-cl-stem8-graph`` pads to 8).
        check_invariants: check graph invariants after every pass (the tests, and ``--debug``
            on the command line).
        static_shapes: write the model with its inputs' dynamic dims fixed at the pins
            (``input_shapes``, ``dim_values``), as ``onnxruntime.tools.make_dynamic_shape_fixed``
            would: the rewrites act on static shapes only, so a model with a dynamic batch gets
            them (and runs at the pinned shapes only). Off by default: the written model keeps the
            input's interface.
        attention_bias: with ``fuse``, a BERT Attention's 2-D padding mask becomes an additive
            attention bias (the same for any mask; ORT's CUDA kernel then runs memory-efficient
            attention: ``onnxcampo.rewrites.attention_mask``). ``False`` keeps the raw mask, the
            unfused attention path.
        attention_fusion: with ``fuse``, the attention ORT's transformers optimizer leaves
            unfused (SDPA attention, dynamo exports, GPT-2) becomes one ``MultiHeadAttention``
            each (``onnxcampo.rewrites.attention``). ``False`` leaves it as exported.
    """

    compare_plans: bool = True
    pad_tensor_cores: bool = True
    cost_graph: str = "ort"
    profile: str = "predict"
    int8_avg: bool = False
    plan_for_fusion: bool = True
    yield_to_ort_fusions: bool = False
    fuse_row_gradients: bool = True
    batchnorm_sums: bool = False
    means_end_deny: bool = False
    fuse_column_sums: bool = True
    channels_last_stem: int = 4
    check_invariants: bool = False
    static_shapes: bool = False
    attention_bias: bool = True
    attention_fusion: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), type(f.default)
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f"experimental option {f.name} must be True or False, got {value!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"experimental option {f.name} must be an integer, got {value!r}")
            if kind is str and not isinstance(value, str):
                raise ConfigError(f"experimental option {f.name} must be a string, got {value!r}")
        if self.cost_graph not in COST_GRAPHS:
            raise ConfigError(f"unknown cost graph {self.cost_graph!r}; choose one of {', '.join(COST_GRAPHS)}")
        if self.profile not in PROFILE_MODES:
            raise ConfigError(f"unknown profile mode {self.profile!r}; choose one of {', '.join(PROFILE_MODES)}")
        if self.channels_last_stem not in (0, 4, 8):
            raise ConfigError(f"channels_last_stem must be 0 (the stem NCHW), 4 or 8 (the channels a stem's input "
                              f"is padded to), got {self.channels_last_stem!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_name(cls, name: str, given: str = "") -> None:
        """A ConfigError naming the closest option unless ``name`` is one (``given``: how the
        caller wrote it, the message's start)."""
        if name not in cls.names():
            raise ConfigError(f"{given}unknown experimental option {name!r}{did_you_mean(name, cls.names())} "
                              f"(the options: {', '.join(cls.names())})")

    def replace(self, **changes) -> "ExperimentalOptions":
        for name in changes:
            self.check_name(name)
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict[str, object]:
        """The options set away from their defaults (what the report and the benchmark record)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def parse_experimental(text: str) -> tuple[str, object]:
    """Parse ``KEY=VALUE`` (the ``--experimental`` syntax): VALUE is read as the option's type
    (``true``/``false``, an integer or a string); ``-`` in KEY may stand for ``_``."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"--experimental {text!r}: expected KEY=VALUE (e.g. fuse_column_sums=false)")
    ExperimentalOptions.check_name(key, f"--experimental {text!r}: ")
    kind = type(next(f.default for f in dataclasses.fields(ExperimentalOptions) if f.name == key))
    try:
        return key, (_bool_text(value) if kind is bool else kind(value.strip()))
    except ValueError:
        expected = "true or false" if kind is bool else {int: "an integer", float: "a number"}.get(kind, "a string")
        raise ConfigError(f"--experimental {text!r}: {key} takes {expected}") from None


@dataclass(frozen=True)
class OptimizeConfig:
    """Options of :func:`onnxcampo.optimize`, shared with ``onnxcampo optimize`` and ``inspect``.

    Most fields have a command-line flag of the same name (``min_gain``: ``--min-gain``). These
    do not: ``keep_io_types`` (``--no-keep-io-types``), ``input_shapes`` (``--input-shape``,
    repeatable), ``dim_values`` (``--dim``, repeatable), ``exclude_ops`` (``--exclude-op``),
    ``include_ops`` (``--include-op``), ``exclude_nodes`` (``--exclude-node``), ``include_nodes``
    (``--include-node``) (one value a flag, repeatable), ``loss_scaling`` (``--no-loss-scaling``)
    and ``experimental`` (``--experimental KEY=VALUE``, repeatable; ``--debug`` sets its
    ``check_invariants`` and shows tracebacks).

    Attributes:
        policy: ``campo`` (cost-aware four passes, the default), ``amp`` (greedy TensorFlow-AMP
            painting, a Cast at every boundary: the paper's baseline), ``fp16`` (every op that may
            run in fp16) or ``fp32`` (nothing converted).
        keep_io_types: graph inputs and outputs keep their dtypes (Casts are added inside).
        input_shapes: ``{input name: dims}`` pinning dynamic input dims for cost estimation and
            profiling. The written model keeps its original (dynamic) input shapes.
        dim_values: ``{symbolic dim name: value}`` pinning a named dynamic dim wherever it occurs.
        exclude_ops / include_ops: op types forced to fp32 / allowed in fp16 whatever the lists say
            (an included op still needs an fp16 schema).
        exclude_nodes / include_nodes: regular expressions on node names, same meaning.
        device_db: a cost database JSON; ``None``: the one ``onnxcampo costdb calibrate``
            measured on this GPU, else the one shipped for it (``costdb/data/<gpu>.json``), else
            a roofline model from the GPU's specs (``onnxcampo.costdb.select``;
            ``ONNXCAMPO_DEVICE`` overrides the detection).
        min_gain: campo keeps fp32 unless a mixed plan is predicted at least this share faster
            (0.02: 2 %), and a rewrite left None is kept only when predicted this much faster;
            smaller predicted gains are within the cost model's error, and fp32 costs no accuracy.
        loss_scaling: in a training-step graph (from ``train-graph``) whose plan has fp16 nodes,
            insert dynamic loss scaling (see ``onnxcampo.training.scaling``).
        tune: ``None`` (decide from predicted times) or an ONNX Runtime provider (``cuda``,
            ``cpu``): build campo's candidate plans (all-fp16, campo's own, without padding, amp,
            fp32), time each on that provider in the ``execution`` mode and keep the fastest (fp32
            unless a mixed one is ``min_gain`` faster; ``onnxcampo.tune``). Needs the provider on
            this machine; ``execution="cuda-graph"`` needs ``cuda``.
        tune_tolerance: with ``tune``, an inference candidate whose outputs fail this accuracy
            criterion against the fp32 plan's is not kept: ``onnxcampo.accuracy.Criterion``, or
            its text (``0.02``: a relative L2 bound; ``rel_l2=0.01,max_abs=1e-3``); ``None``
            (the default) is the default criterion, relative L2 error <= 0.01 per float output,
            the one ``--validate`` and the accuracy guard use.
        activation_limit: calibrate: run the fp32 model once on ONNX Runtime's CPU provider on the
            ``inputs`` given to :func:`onnxcampo.optimize` (random ones by default) and keep fp32
            every node that reads or writes a tensor reaching |x| > this there (fp16's values are
            0.5 apart above 512, 2 apart above 2048; ModelOpt AutoCast's ``data_max``, 512 by
            default). ``None`` (the default): no calibration. Inference models only.
        execution: how ONNX Runtime will run the model, which the plans are costed (and ``tune``
            and validation run) for: ``plain`` (the CUDA EP launches node by node: every launched
            node costs host time) or ``cuda-graph`` (the run is captured once and replayed:
            ``enable_cuda_graph``; no per-node host dispatch, one replay overhead, a Cast costs
            only its kernel).
        fuse: run ONNX Runtime's transformers optimizer (``onnxruntime.transformers.optimizer``,
            GPU options) before planning: ``bert`` or ``gpt2`` force the model type, ``auto``
            (the default) fuses models recognised as BERT- or GPT-2-like transformers and leaves
            others as they are, ``none`` never fuses.
        num_heads / hidden_size: attention heads and hidden size for ``fuse`` (0: detected from
            the graph).
        fuse_elementwise: after the plan, its Casts and loss scaling, replace chains of
            elementwise ops (their Casts included) by ``ai.onnxcampo::FusedElementwise`` nodes,
            one kernel each (``onnxcampo.rewrites.elementwise``). Needs the custom-op library, to
            write the model (it is test-loaded) and to run it. None (the default, for it,
            ``fuse_reductions`` and ``channels_last``): decided where the written model would run
            the library's CUDA kernels (``onnxcampo.ops.cuda_kernels_here``; FusedElementwise also
            needs NVRTC for its generated kernels, ``ops.generated_kernels_here``): on for a
            training step built with the fused ops (it runs the library's ops already); for an
            inference model, by predicted cost: the kept plan is costed with the rewrite and
            without it in the ``execution`` mode (``onnxcampo.rewrites.elementwise.predict``
            and its two siblings) and the rewrite is kept when it is predicted at least
            ``min_gain`` faster, the three decided together (``onnxcampo.pipeline.decide_rewrites``;
            the report's ``rewrites`` has each decision, who made it and both predicted totals).
            Where those kernels would not run (no CUDA execution provider, the library not built
            or built without them, no NVRTC) the three stay off and one line says why (a warning
            where a GPU is detected). A training step built with standard ops keeps them off.
            ``True`` needs the library, on any machine; ``False`` is off.
        fuse_reductions: after the plan, its Casts and loss scaling (before ``fuse_elementwise``),
            replace ReduceSums over leading and/or trailing blocks of axes (bias, LayerNorm-scale
            and Conv-bias gradients; ``simplify``'s ReduceSum pairs), with the Reshapes and the
            float16 -> float32 Casts around them, by ``ai.onnxcampo::BlockReduceSum`` nodes
            (``onnxcampo.rewrites.reductions``). Needs the custom-op library; None decides it as
            ``fuse_elementwise`` (its prediction: the Casts its BlockReduceSums fold).
        channels_last: after the plan, its Casts and loss scaling (before the fusions), store the
            activations of the 2-D convolutions channels-last and run them, their input and weight
            gradients as ``ai.onnxcampo::ConvNhwc`` / ``ConvNhwcDataGrad`` / ``ConvNhwcWeightGrad``
            (cuDNN's NHWC kernels: no NCHW <-> NHWC transform around each; ``onnxcampo.rewrites.layout``).
            Convolutions whose channels are not multiples of 8 stay NCHW; graph inputs and
            outputs keep their layout. Needs the custom-op library. None decides it as
            ``fuse_elementwise`` (ResNet-50 b64's training step 1.34x on the H200); at inference
            its prediction (``onnxcampo.rewrites.layout.layout_change``) removes cuDNN's layout
            transforms around the float16 convolutions and adds the Transposes the pass writes at
            layout boundaries and the host time of each NHWC convolution call, which a CUDA graph
            replay does not pay: ResNet-50 b64 on the H200 with the fusions, 2.85 ms replayed
            against 3.96 NCHW, but 6.42 ms run plainly against 4.29.
        experimental: :class:`ExperimentalOptions`, the switches kept for A/B measurements and
            development (comparing plans, padding, the cost graph, profiling, ``int8_avg``, the
            fusion-aware costing and the rewrites' variants, invariant checks); a mapping is
            checked and turned into one. ``config.with_experimental(name=value)`` changes one.
    """

    policy: str = "campo"
    keep_io_types: bool = True
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dim_values: dict[str, int] = field(default_factory=dict)
    exclude_ops: frozenset[str] = frozenset()
    include_ops: frozenset[str] = frozenset()
    exclude_nodes: tuple[str, ...] = ()
    include_nodes: tuple[str, ...] = ()
    device_db: Path | None = None
    min_gain: float = 0.02
    loss_scaling: bool = True
    fuse_elementwise: bool | None = None
    fuse_reductions: bool | None = None
    channels_last: bool | None = None
    tune: str | None = None
    tune_tolerance: float | str | None = None
    activation_limit: float | None = None
    execution: str = "plain"
    fuse: str = "auto"
    num_heads: int = 0
    hidden_size: int = 0
    experimental: ExperimentalOptions = field(default_factory=ExperimentalOptions)
    # the nodes the accuracy check's fix keeps fp32 (onnxcampo.accuracy.check.find_culprits): fp32
    # with that reason (classify), not as a user exclusion
    _accuracy_fix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.tune is not None and self.tune not in TUNE_PROVIDERS:
            raise ConfigError(f"unknown tuning provider {self.tune!r}; choose one of {', '.join(TUNE_PROVIDERS)}")
        if self.execution not in EXECUTION_MODES:
            raise ConfigError(f"unknown execution mode {self.execution!r}; choose one of {', '.join(EXECUTION_MODES)}")
        if self.fuse not in FUSE_MODES:
            raise ConfigError(f"unknown fuse mode {self.fuse!r}; choose one of {', '.join(FUSE_MODES)}")
        for name in ("num_heads", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0: detect), got {value!r}")
        if self.activation_limit is not None and not self.activation_limit > 0:
            raise ConfigError(f"activation_limit must be > 0, got {self.activation_limit}")
        from onnxcampo.accuracy import Criterion

        Criterion.parse(self.tune_tolerance)  # a bad bound is a ConfigError now, not at tuning
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"min_gain must be in [0, 1), got {self.min_gain}")
        for name, dims in self.input_shapes.items():
            if not all(isinstance(d, int) and d > 0 for d in dims):
                raise ConfigError(f"input shape for {name!r} must be positive integers, got {dims}")
        for name, value in self.dim_values.items():
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"dim {name!r} must be a positive integer, got {value!r}")
        for pattern in (*self.exclude_nodes, *self.include_nodes):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"bad node regular expression {pattern!r}: {exc}") from None
        object.__setattr__(self, "exclude_ops", frozenset(self.exclude_ops))
        object.__setattr__(self, "include_ops", frozenset(self.include_ops))
        object.__setattr__(self, "exclude_nodes", tuple(self.exclude_nodes))
        object.__setattr__(self, "include_nodes", tuple(self.include_nodes))
        object.__setattr__(self, "_accuracy_fix", tuple(self._accuracy_fix))
        if self.device_db is not None:
            object.__setattr__(self, "device_db", Path(self.device_db))
        if isinstance(self.experimental, Mapping):
            object.__setattr__(self, "experimental", ExperimentalOptions().replace(**self.experimental))
        elif not isinstance(self.experimental, ExperimentalOptions):
            raise ConfigError(f"experimental must be a mapping of option names to values or ExperimentalOptions, "
                              f"got {self.experimental!r}")

    def replace(self, **changes) -> "OptimizeConfig":
        """A copy with ``changes``; an ``experimental`` mapping is merged over this config's
        experimental options (an :class:`ExperimentalOptions` replaces them)."""
        names = {f.name for f in dataclasses.fields(self)}
        for name in changes:
            if name in names:
                continue
            if name in ExperimentalOptions.names():
                raise ConfigError(f"{name} is an experimental option: experimental={{{name!r}: ...}}")
            raise ConfigError(f"unknown option {name!r}{did_you_mean(name, names)}")
        if isinstance(changes.get("experimental"), Mapping):
            changes["experimental"] = self.experimental.replace(**changes["experimental"])
        return dataclasses.replace(self, **changes)

    def with_experimental(self, **changes) -> "OptimizeConfig":
        """A copy with these experimental options changed (``with_experimental(fuse_column_sums=False)``)."""
        return dataclasses.replace(self, experimental=self.experimental.replace(**changes))


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse ``NAME:D0,D1,...`` (the ``--input-shape`` syntax). The name may contain ``:``."""
    name, sep, dims_text = text.rpartition(":")
    if not sep or not name:
        raise ConfigError(f"--input-shape {text!r}: expected NAME:D0,D1,... (e.g. input:1,3,224,224)")
    try:
        dims = tuple(int(d) for d in dims_text.split(",")) if dims_text.strip() else ()
    except ValueError:
        raise ConfigError(f"--input-shape {text!r}: dims must be integers separated by commas") from None
    if any(d <= 0 for d in dims):
        raise ConfigError(f"--input-shape {text!r}: dims must be positive")
    return name, dims


def parse_dim_value(text: str) -> tuple[str, int]:
    """Parse ``NAME=VALUE`` (the ``--dim`` syntax)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"--dim {text!r}: expected NAME=VALUE (e.g. batch=8)")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"--dim {text!r}: VALUE must be an integer") from None
    if number <= 0:
        raise ConfigError(f"--dim {text!r}: VALUE must be positive")
    return name, number
