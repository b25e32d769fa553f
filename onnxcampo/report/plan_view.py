"""The plan as rows, one per node with its own numbers: what ``onnxcampo inspect`` prints
(``--nodes``), emits (``--json``) and draws (``--html``, ``onnxcampo.report.plan_html``).

A row's numbers are the node's own under the chosen plan (``report["plan_nodes"]``,
``estimate.node_costs``): its fp32 and fp16 times and the Casts it causes. The numbers its
deciding rule priced (``report["plan"][name]["numbers"]``; an island's are the island's sums, with
the Casts that disappear as a negative cast cost) are the row's ``priced``. Nodes onnxcampo
inserted (Casts, Pad/Slice) are rows too, with precision ``inserted`` and why they are there.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from onnxcampo.plan import Reason
from onnxcampo.report import OTHER_NODES

INSERTED = "inserted"
UNPLANNED = "unplanned"  # a node of a model written unchanged (nothing to optimize)
_OTHER = {kind.name.lower() for kind in OTHER_NODES}


@dataclass(frozen=True)
class NodeRow:
    name: str
    op: str
    precision: str  # fp16, fp32, inserted (or, on the page of a model written unchanged, unplanned)
    reason: str  # the Reason's code (deny_list, ...); for an inserted node its op in lower case
    reason_text: str  # the Reason's words, or why an inserted node is there
    fp32_us: float | None = None
    fp16_us: float | None = None
    casts: float = 0.0
    cast_us: float = 0.0
    priced: dict[str, float] = field(default_factory=dict)
    ort: str | None = None  # what ORT's own graph makes of it: absorbed, carried, fused (else runs as it is)

    @property
    def kind(self) -> str:
        """What the page colours it as: fp16, fp32, other (shape arithmetic, constants), cast,
        pad (Pad/Slice for Tensor Cores) or added (an inserted constant)."""
        if self.precision == INSERTED:
            return {"Cast": "cast", "Pad": "pad", "Slice": "pad"}.get(self.op, "added")
        if self.precision not in ("fp16", "fp32"):
            return "other"
        return "other" if self.reason in _OTHER else self.precision

    def to_json(self) -> dict:
        return {**asdict(self), "kind": self.kind}


def node_rows(report: dict) -> list[NodeRow]:
    """Every planned node (graph order, then If/Loop/Scan bodies), then every inserted one."""
    plan, costs = report.get("plan", {}), report.get("plan_nodes", {})
    rows = []
    for name in (*costs, *(n for n in plan if n not in costs)):
        entry = plan.get(name)
        if entry is None:
            continue
        row = costs.get(name, {})
        reason = Reason[entry["reason"].upper()]
        rows.append(NodeRow(name, row.get("op", "?"), entry["precision"], entry["reason"], reason.value,
                            row.get("fp32_us"), row.get("fp16_us"), row.get("casts", 0.0), row.get("cast_us", 0.0),
                            dict(entry.get("numbers", {})), row.get("ort")))
    for name, entry in report.get("inserted_nodes", {}).items():
        rows.append(NodeRow(name, entry["op"], INSERTED, entry["op"].lower(), entry["why"]))
    return rows


def filter_rows(rows: list[NodeRow], *, ops=(), precision: str | None = None, name: str | None = None) -> list[NodeRow]:
    """Rows of the given op types (any, when none), precision and names matching the regular
    expression ``name`` (``re.search``)."""
    pattern = re.compile(name) if name else None
    wanted = set(ops)
    return [r for r in rows if (not wanted or r.op in wanted) and (precision is None or r.precision == precision)
            and (pattern is None or pattern.search(r.name))]


def table(rows: list[NodeRow]) -> str:
    """One line per row: precision, op, own fp32/fp16 times, the Casts it causes, name, reason;
    then what each reason code shown means (the words the summary uses) and, where a row has a
    share of a Cast, what that is."""
    op_width = max((len(r.op) for r in rows), default=2)
    lines = [f"{'prec':8}  {'op':{op_width}}  {'fp32_us':>9}  {'fp16_us':>9}  {'casts':>5}  {'cast_us':>8}  name  reason"]
    for r in rows:
        times = (f"{_us(r.fp32_us):>9}  {_us(r.fp16_us):>9}  {r.casts:>5.3g}  {r.cast_us:>8.2f}"
                 if r.precision != INSERTED else f"{'':>9}  {'':>9}  {'':>5}  {'':>8}")
        reason = r.reason if r.precision != INSERTED else r.reason_text
        lines.append(f"{r.precision:8}  {r.op:{op_width}}  {times}  {r.name}  {reason}{_ort_note(r)}")
    used = {r.reason: r.reason_text for r in rows if r.precision != INSERTED}
    lines += [f"{code}: {words}" for code, words in sorted(used.items())]  # the summary's words for each code
    if any(r.precision != INSERTED and r.casts != int(r.casts) for r in rows):
        lines.append("casts: the Casts a node causes; one that several fp16 nodes read counts a share to each "
                     "(0.5: one Cast read by two), so the column adds up to the plan's Casts")
    return "\n".join(lines)


def _ort_note(row: NodeRow) -> str:
    """What ORT's own graph makes of the node, where that sets its time: a 0.00 is a node ORT
    fuses into a neighbour or aliases (no kernel of its own); a product ORT fuses its neighbours
    into carries the fused kernel's work."""
    if row.precision == INSERTED or row.ort is None:
        return ""
    own = row.fp16_us if row.precision == "fp16" else row.fp32_us
    if row.ort == "carried" or (row.ort == "absorbed" and not own):
        return " (ORT fuses it into a neighbour: no kernel of its own)"
    if row.ort == "absorbed":
        return " (ORT fuses its neighbours into it: the fused kernel's work is priced here)"
    return f" (ORT makes its output with a fused op: {row.ort})"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
