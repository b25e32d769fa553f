"""The precision plan: what the analysis passes decide, and why.

Analysis passes only write here; the mutating passes (Cast insertion, Tensor Core padding) read
it. Every decision keeps its reason and, for cost decisions, the numbers behind it, so the report
can say why a node stayed fp32.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class Precision(enum.Enum):
    FP16 = "fp16"
    FP32 = "fp32"


class Reason(enum.Enum):
    # Fixed before the four passes (the "classify" pass).
    NO_FLOAT = "no float32 tensors"
    CONSTANT = "constant (converted offline for fp16 consumers)"
    ALREADY_FP16 = "already runs in fp16"
    PINNED_CAST = "Cast whose output keeps its dtype"
    TRAINING_STATE = "updates training state in place (gradient accumulator, optimizer): fp32 under every policy"
    DECLARED_OUTPUT_SHAPE = "ORT kernel reads its output's declared shape, lost if run fp16 through Casts: fp32 under every policy"
    ORT_CPU_CRASH = ("Transpose moving a batch axis into a MatMul with a 1-D/2-D operand: ONNX Runtime's CPU EP "
                     "crashes (SIGSEGV) creating a session of it in fp16 (its FusedMatMul fusion): fp32 under every policy")
    UNKNOWN_OP = "op in no list (no known fp16 behaviour)"
    CUSTOM_DOMAIN = "op of a custom domain"
    NO_FP16_SCHEMA = "no fp16 type in the op's schema at this opset"
    NO_FP16_KERNEL = "no fp16 kernel in ONNX Runtime's CUDA EP: fp32 under every policy"
    QUANTIZED = "part of a quantized (QDQ / integer) pattern"
    CONTROL_FLOW = "control-flow op (If/Loop/Scan): body kept fp32"
    IN_SUBGRAPH = "inside an If/Loop/Scan body"
    USER_EXCLUDED = "excluded by the user"
    ACCURACY_FIX = "kept fp32 by the accuracy check's fix: the model failed the criterion with it fp16"
    TRAINING_FP32 = "training step: loss, loss gradient, loss scaling or optimizer update"
    CONSTANT_OUT_OF_RANGE = "reads a constant beyond the fp16 range"
    ACCUMULATING_SCATTER = "scatter with a reduction (sums in its output dtype; onnx-ad's backward uses it)"
    ACTIVATION_RANGE = "reads or writes values beyond --activation-limit on the calibration inputs"
    UNKNOWN_SHAPE = "shapes unknown: cost cannot be predicted"
    POLICY_FP32 = "policy fp32"
    # The four passes.
    ALLOW_PAYS = "allow by cost: fp16 time + casts < fp32 time"
    ALLOW_DOES_NOT_PAY = "allow by cost: fp16 time + casts >= fp32 time"
    ALLOW_GREEDY = "allow list (greedy)"
    USER_INCLUDED = "included by the user"
    ALLOW_ISLAND_PAYS = "allow island: fp16 pays together with the allow-list ops it is chained to"
    DENY_LIST = "deny list"
    DENY_DOWNSTREAM = "deny propagation: downstream of a deny-list op"
    DENY_TOWARD_INFER = "deny propagation (TensorFlow AMP): downstream of a deny-list op, on a path to an infer/deny op"
    BETWEEN_FP16 = "infer/clear op between fp16 ops"
    CLEAR_PAYS = "clear by cost: clear op whose casts saved outweigh its cost"
    CLEAR_GREEDY = "clear op next to fp16 ops (greedy)"
    CAST_FOLLOWS_CONSUMERS = "existing Cast whose readers all run fp16 (TensorFlow AMP)"
    CLEAR_DOES_NOT_PAY = "clear by cost: clear op, fp16 does not pay"
    POLICY_FP16 = "policy fp16"
    DEFAULT_FP32 = "left fp32 after the four passes"
    # Our extension of "clear by cost": infer-list ops that are not between fp16 ops but next to them
    # (a bias and activation chain after a GEMM, up to a deny-list op).
    EDGE_PAYS = "edge by cost: infer op next to fp16 ops whose fp16 run (and the Casts it moves) pays"
    EDGE_DOES_NOT_PAY = "edge by cost: infer op next to fp16 ops, fp16 does not pay"
    # Our extension after the default: fp32 regions the passes left, priced as a whole.
    REGION_PAYS = "refine by cost: fp32 region the four passes left whose fp16 run as a whole pays"


@dataclass(frozen=True)
class Decision:
    precision: Precision
    reason: Reason
    numbers: dict[str, float] = field(default_factory=dict)


_NO_NUMBERS: dict[str, float] = {}


class PrecisionPlan:
    """Node name -> :class:`Decision`. A node is decided at most once; later passes skip it."""

    def __init__(self) -> None:
        self._decisions: dict[str, Decision] = {}

    def decide(self, node: str, precision: Precision, reason: Reason, **numbers: float) -> None:
        if node in self._decisions:
            raise KeyError(f"node {node!r} already decided ({self._decisions[node].reason.name})")
        self._decisions[node] = Decision(precision, reason, {k: float(v) for k, v in numbers.items()} if numbers else _NO_NUMBERS)

    def override(self, node: str, precision: Precision, reason: Reason, **numbers: float) -> None:
        self._decisions[node] = Decision(precision, reason, {k: float(v) for k, v in numbers.items()})

    def is_decided(self, node: str) -> bool:
        return node in self._decisions

    def get(self, node: str) -> Decision | None:
        return self._decisions.get(node)

    def precision(self, node: str) -> Precision:
        """Undecided nodes run fp32."""
        decision = self._decisions.get(node)
        return decision.precision if decision else Precision.FP32

    def is_fp16(self, node: str) -> bool:
        return self.precision(node) is Precision.FP16

    def items(self):
        return self._decisions.items()

    def __len__(self) -> int:
        return len(self._decisions)

    def copy(self) -> "PrecisionPlan":
        other = PrecisionPlan()
        other._decisions = dict(self._decisions)
        return other

    def counts(self) -> dict[str, int]:
        return dict(Counter(d.precision.value for d in self._decisions.values()))

    def reasons(self) -> dict[str, int]:
        return dict(Counter(f"{d.precision.value}: {d.reason.value}" for d in self._decisions.values()))

    def to_json(self) -> dict[str, dict]:
        return {
            name: {"precision": d.precision.value, "reason": d.reason.name.lower(), **({"numbers": d.numbers} if d.numbers else {})}
            for name, d in self._decisions.items()
        }
