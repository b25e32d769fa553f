"""``onnxcampo inspect MODEL --html PLAN.html``: the plan as one self-contained page.

The written model's graph is drawn in SVG, one layer per topological depth (top to bottom; a node
with no producer sits just above its first reader), coloured by precision, with the Casts and
Pad/Slice onnxcampo inserted marked. It opens on the float compute, the Casts and what onnxcampo
added, the shape arithmetic and constants left out (an edge runs through them); a checkbox draws
the whole graph, buttons zoom (and fit the graph in view), and a click on a column's name sorts
the table under the graph by it (by time, or by fp16's gain on the node, its Casts paid).
Clicking a node (or a row of the searchable table under the graph) shows its reason, its own predicted times and the Casts it causes. The page opens with the
summary counts and every compared plan's predicted time. No external script, style sheet or font:
the page works offline and can be mailed. ``#node=NAME`` in the address selects a node on load.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
from collections import defaultdict

import onnx

from onnxcampo import ir
from onnxcampo.plan import Reason
from onnxcampo.report import counts_headline
from onnxcampo.report.plan_view import INSERTED, UNPLANNED, NodeRow, node_rows

# Fill colours by kind (plan_view.NodeRow.kind); the browser test looks for the first two.
COLOURS = {"fp16": "#1f77b4", "fp32": "#ff7f0e", "cast": "#d62728", "pad": "#9467bd", "other": "#c7c7c7",
           "added": "#17becf"}
LABELS = {"fp16": "fp16", "fp32": "fp32 (float compute)", "cast": "Cast inserted", "pad": "Pad/Slice inserted",
          "other": "shape arithmetic / constant", "added": "added by onnxcampo"}
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 132, 26, 14, 34, 16


def write_html(path: str | os.PathLike, model: onnx.ModelProto, report: dict, *, title: str = "") -> None:
    """The page, written atomically."""
    ir.write_text_atomically(path, render(model, report, title=title))


def render(model: onnx.ModelProto, report: dict, *, title: str = "") -> str:
    nodes = list(model.graph.node)
    rows = _rows_by_node(nodes, report)
    # drawn first: the float compute, the Casts and what onnxcampo added (shape arithmetic and
    # constants left out, their edges drawn through them); the whole graph a click away
    kept = {i for i, row in enumerate(rows) if row.kind != "other"} or set(range(len(nodes)))
    svg = (_svg(nodes, rows, _positions(columns(nodes, kept)), _producers_of(nodes, kept), graph_id="graph")
           + _svg(nodes, rows, _positions(columns(nodes)), _producers_of(nodes), graph_id="graph-all", hidden=True))
    data = [{"name": n.name, "op": n.op_type, "doc": n.doc_string, "inputs": list(n.input), "outputs": list(n.output),
             **rows[i].to_json()} for i, n in enumerate(nodes)]
    title = title or str(report.get("input") or "model")
    return _PAGE.format(
        title=html.escape(f"onnxcampo plan: {title}"),
        summary=_summary(report, rows),
        legend="".join(f'<span class="key"><svg width="14" height="14"><rect width="14" height="14" '
                       f'fill="{COLOURS[k]}"/></svg>{html.escape(LABELS[k])}</span>' for k in COLOURS),
        svg=svg,
        table="".join(_table_row(i, r) for i, r in enumerate(rows)),
        data=_script_json(data),
        style=_STYLE,
        script=_SCRIPT,
    )


def layout(nodes: list[onnx.NodeProto]) -> tuple[list[int], dict[int, list[int]]]:
    """Each node's layer and column. A layer is the node's longest path from the graph's inputs
    (a node no other node feeds, such as a Constant, sits one layer above its first reader); in a
    layer, nodes are ordered by the mean column of their producers (a source by that of its
    reader's other producers) and each takes that column, or the next free one: chains run
    straight down, in one sweep, in linear time. Returns the layers and ``{layer: [node, ...]}``
    in column order; :func:`columns` gives the columns."""
    depth, layers, _ = _layout(nodes, _producers_of(nodes))
    return depth, layers


def columns(nodes: list[onnx.NodeProto], kept: set[int] | None = None) -> dict[int, tuple[int, int]]:
    """(column, layer) of each node (with ``kept``: of those nodes only, laid out as if the others
    were not there, a kept node below the kept nodes it reads through them)."""
    preds = _producers_of(nodes, kept)
    depth, _, column = _layout(nodes, preds)
    return {i: (column[i], depth[i]) for i in range(len(nodes)) if kept is None or i in kept}


def _producers_of(nodes: list[onnx.NodeProto], kept: set[int] | None = None) -> list[list[int]]:
    """Each node's producers (the nodes that make its inputs); with ``kept``, each kept node's
    nearest kept producers, through the nodes left out, and none for the nodes left out."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    direct = [sorted({producer[t] for t in n.input if t in producer and producer[t] != i}) for i, n in enumerate(nodes)]
    if kept is None:
        return direct
    through: dict[int, set[int]] = {}  # a left-out node -> the kept nodes it reads, transitively

    def reached(i: int) -> set[int]:
        if i not in through:
            through[i] = set()
            stack, found, seen = list(direct[i]), set(), {i}
            while stack:
                p = stack.pop()
                if p in seen:
                    continue
                seen.add(p)
                if p in kept:
                    found.add(p)
                else:
                    stack.extend(direct[p])
            through[i] = found
        return through[i]

    return [sorted({q for p in direct[i] for q in ((p,) if p in kept else reached(p))}) if i in kept else []
            for i in range(len(nodes))]


def _layout(nodes, preds: list[list[int]]):
    succs: list[list[int]] = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    depth = [0] * len(nodes)
    for i in _topological(preds, succs):
        depth[i] = max((depth[p] + 1 for p in preds[i]), default=0)
    for i in range(len(nodes)):
        if not preds[i] and succs[i]:
            depth[i] = max(0, min(depth[s] for s in succs[i]) - 1)
    layers: dict[int, list[int]] = defaultdict(list)
    for i in sorted(range(len(nodes)), key=lambda i: (depth[i], i)):
        layers[depth[i]].append(i)
    column: dict[int, int] = {}
    for d in sorted(layers):
        members = layers[d]
        wanted = {}
        for k, i in enumerate(members):
            placed = [column[p] for p in preds[i] if p in column]
            if not placed and succs[i]:  # a source: where its reader's other producers are
                placed = [column[p] for p in preds[succs[i][0]] if p in column]
            wanted[i] = sum(placed) / len(placed) if placed else float(k)
        members.sort(key=lambda i: (wanted[i], i))
        free = 0
        for i in members:
            column[i] = max(free, round(wanted[i]))
            free = column[i] + 1
    return depth, dict(layers), column


def _topological(preds: list[list[int]], succs: list[list[int]]) -> list[int]:
    """Kahn's order (written models are sorted; this also copes with one that is not)."""
    waiting = [len(p) for p in preds]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    seen = set(order)
    return order + [i for i in range(len(preds)) if i not in seen]  # a cycle: drawn at depth 0


def _positions(columns_: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    return {i: (MARGIN + c * (BOX_W + GAP_X), MARGIN + d * (BOX_H + GAP_Y)) for i, (c, d) in columns_.items()}


# What AnnotateNodes writes on a planned node: "onnxcampo: fp16 (reason words); predicted ..."
# (the words may hold parentheses themselves; the times: pipeline.node_numbers_text)
_WRITTEN = re.compile(r"onnxcampo: (fp16|fp32) \((.*)\)$")
_TIMES = re.compile(r"fp32 ([\d.]+) us, fp16 ([\d.]+) us|([\d.]+) us")
_REASONS = {reason.value: reason.name.lower() for reason in Reason}


def _rows_by_node(nodes: list[onnx.NodeProto], report: dict) -> list[NodeRow]:
    """The plan's row of each written node; nodes the plan does not know get a row of their own:
    those of a model onnxcampo wrote before (inspected again: nothing to plan) from the precision,
    reason and times their doc_strings carry, those added after planning (loss scaling, fused
    kernels) and inserted ones as inserted."""
    known = {r.name: r for r in node_rows(report)}
    rows = []
    for n in nodes:
        row = known.get(n.name)
        if row is None or row.op not in (n.op_type, "?"):
            row = _written_row(n) or NodeRow(n.name, n.op_type, UNPLANNED, UNPLANNED,
                                             "not planned: " + "; ".join(report.get("notes", [])))
        elif row.op == "?":
            row = dataclasses.replace(row, op=n.op_type)
        rows.append(row)
    return rows


def _written_row(n: onnx.NodeProto) -> NodeRow | None:
    """The row a node's onnxcampo doc_string describes (the last one, if several), or None."""
    if "onnxcampo: " not in n.doc_string:
        return None
    text = "onnxcampo: " + n.doc_string.rsplit("onnxcampo: ", 1)[-1]
    head, _, numbers = text.partition("; predicted ")
    found = _WRITTEN.match(head.strip())
    if found is None:  # "onnxcampo: inserted: ...", or added after planning (loss scaling, fused kernels)
        return NodeRow(n.name, n.op_type, INSERTED, n.op_type.lower(), text[len("onnxcampo: "):].removeprefix("inserted: "))
    precision, words = found.groups()
    times = _TIMES.match(numbers)
    fp32, fp16, same = times.groups() if times else (None, None, None)
    fp32_us = float(fp32 or same) if (fp32 or same) else None
    fp16_us = float(fp16 or same) if (fp16 or same) else None
    return NodeRow(n.name, n.op_type, precision, _REASONS.get(words, "written"), words, fp32_us, fp16_us)


def _svg(nodes, rows, positions, preds: list[list[int]], *, graph_id: str, hidden: bool = False) -> str:
    """The nodes at ``positions`` (those without one are not drawn), an edge from each of a node's
    ``preds``."""
    width = max((x for x, _ in positions.values()), default=0) + BOX_W + MARGIN
    height = max((y for _, y in positions.values()), default=0) + BOX_H + MARGIN
    edges, boxes = [], []
    prefix = "n" if graph_id == "graph" else "a"
    for i, n in enumerate(nodes):
        if i not in positions:
            continue
        x, y = positions[i]
        for p in preds[i]:
            if p in positions:
                px, py = positions[p]
                edges.append(f"M{px + BOX_W // 2} {py + BOX_H}L{x + BOX_W // 2} {y}")
        row = rows[i]
        label = n.op_type if len(n.op_type) <= 18 else n.op_type[:17] + "\u2026"
        boxes.append(f'<g class="n" id="{prefix}{i}" data-i="{i}" transform="translate({x},{y})">'
                     f'<rect width="{BOX_W}" height="{BOX_H}" rx="4" fill="{COLOURS[row.kind]}"/>'
                     f'<text x="{BOX_W // 2}" y="17">{html.escape(label)}</text>'
                     f'<title>{html.escape(n.name)}</title></g>')
    style = ' style="display:none"' if hidden else ""
    return (f'<svg id="{graph_id}" class="graph" width="{width}" height="{height}" data-w="{width}" data-h="{height}" '
            f'viewBox="0 0 {width} {height}"{style}><path class="e" d="{" ".join(edges)}"/>{"".join(boxes)}</svg>')


def _summary(report: dict, rows: list[NodeRow]) -> str:
    counts = report.get("node_counts") or {}
    # a model onnxcampo wrote, inspected again: nothing planned, its nodes' doc_strings say what they are
    written = not counts and any(r.precision in ("fp16", "fp32") and r.name not in report.get("plan", {}) for r in rows)
    kept = report.get("chosen_plan")
    parts = [f"policy <b>{html.escape(str(report.get('policy')))}</b>, plan kept: "
             f"<b>{html.escape(str(kept) if kept else 'none (nothing planned)')}</b>"]
    if counts:
        parts.append(html.escape(counts_headline(counts)))
    if written:
        parts.append(f"as written (the nodes' doc_strings): {sum(r.kind == 'fp16' for r in rows)} fp16 and "
                     f"{sum(r.kind == 'fp32' for r in rows)} fp32 float compute nodes, "
                     f"{sum(r.kind == 'cast' for r in rows)} Casts and {sum(r.kind == 'pad' for r in rows)} Pad/Slice "
                     "onnxcampo inserted")
    else:
        parts.append(f"{report.get('casts_inserted', 0)} Casts, {report.get('pads_inserted', 0)} Pad/Slice inserted; "
                     f"{sum(r.kind == 'fp32' for r in rows)} fp32 float compute nodes")
    times = report.get("predicted_us") or {}
    cost = (report.get("cost_model") or {}).get("name", "")
    table = "".join(f"<tr><td>{html.escape(name)}</td><td>{t['total_us']:.1f}</td><td>{t['nodes_us']:.1f}</td>"
                    f"<td>{t['casts_us']:.1f}</td><td>{t['casts']}</td></tr>" for name, t in times.items())
    plans = (f'<table class="plans"><caption>predicted time per plan ({html.escape(str(cost))})</caption>'
             f"<tr><th>plan</th><th>total us</th><th>nodes us</th><th>casts us</th><th>Casts</th></tr>{table}</table>"
             if times else "")
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in report.get("notes", []))
    return (f'<div class="top"><div><p>{"<br>".join(parts)}</p>{f"<ul>{notes}</ul>" if notes else ""}</div>'
            f"{plans}</div>")


def _table_row(i: int, row: NodeRow) -> str:
    def us(value):
        return "" if value is None else f"{value:.2f}"

    planned = row.precision in ("fp16", "fp32")
    # what fp16 saves on the node, its Casts paid (negative: fp16 costs): the column to sort by
    gain = (row.fp32_us - row.fp16_us - row.cast_us if planned and row.fp32_us is not None and row.fp16_us is not None
            else None)
    return (f'<tr data-i="{i}" class="k-{row.kind}"><td>{html.escape(row.name)}</td><td>{html.escape(row.op)}</td>'
            f"<td>{html.escape(row.precision)}</td><td>{us(row.fp32_us)}</td><td>{us(row.fp16_us)}</td>"
            f"<td>{f'{row.casts:.3g}' if planned else ''}</td><td>{us(gain)}</td>"
            f"<td>{html.escape(row.reason_text)}</td></tr>")


def _script_json(data) -> str:
    """JSON safe inside a <script> element (no "</script>", no HTML-significant characters)."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_STYLE = """
body{font:13px system-ui,sans-serif;margin:0;color:#222}
header{padding:6px 16px;border-bottom:1px solid #ddd}
.top{display:flex;gap:32px;align-items:flex-start}.top p{margin:4px 0}.top ul{margin:4px 0}
h1{font-size:16px;margin:4px 0}
.key{margin-right:14px;white-space:nowrap}.key svg{vertical-align:middle;margin-right:4px}
table.plans{border-collapse:collapse;margin:4px 0}table.plans td,table.plans th{border:1px solid #ddd;padding:1px 6px;text-align:right}
caption{text-align:left}
main{display:flex;height:60vh;border-bottom:1px solid #ddd}
#view{flex:1;overflow:auto;background:#fafafa}
#details{width:360px;overflow:auto;padding:8px 12px;border-left:1px solid #ddd;white-space:pre-wrap;word-break:break-all}
.e{fill:none;stroke:#999;stroke-width:1}
.n{cursor:pointer}.n text{font-size:11px;text-anchor:middle;fill:#000;pointer-events:none}
.n.sel rect{stroke:#000;stroke-width:3}.n.hit rect{stroke:#e6e600;stroke-width:3}
#find{padding:6px 16px}#find input{width:320px}
#tools{padding:4px 16px;border-bottom:1px solid #ddd}#tools button{margin:0 4px;min-width:28px}#zoom{display:inline-block;width:44px;text-align:center}
#rows th{cursor:pointer;user-select:none}
#rows{max-height:24vh;overflow:auto;padding:0 16px;position:relative}
#rows table{border-collapse:collapse;width:100%}#rows td,#rows th{border-bottom:1px solid #eee;padding:1px 6px;text-align:left}
#rows tr.sel{background:#ffe}#rows tbody tr{cursor:pointer}
"""

_SCRIPT = """
(function(){
var nodes=JSON.parse(document.getElementById('plan-data').textContent);
var details=document.getElementById('details'),view=document.getElementById('view');
var rows=document.querySelectorAll('#rows tbody tr'),selected=null,scale=1;
var graphs=[document.getElementById('graph'),document.getElementById('graph-all')],all=false;
function boxes(i){return [document.getElementById('n'+i),document.getElementById('a'+i)].filter(Boolean)}
function shown(i){return document.getElementById((all?'a':'n')+i)}
function fmt(v){return v===null||v===undefined?'-':Number(v).toFixed(2)}
function centre(g){var t=g.transform.baseVal.consolidate().matrix;  // only the graph's pane scrolls, not the page
  view.scrollLeft=t.e*scale-view.clientWidth/2;view.scrollTop=t.f*scale-view.clientHeight/2}
function select(i,scroll){
  if(selected!==null){boxes(selected).forEach(function(g){g.classList.remove('sel')});rows[selected].classList.remove('sel')}
  selected=i;var n=nodes[i];boxes(i).forEach(function(g){g.classList.add('sel')});rows[i].classList.add('sel');
  var text=n.name+'\\n'+n.op+'  '+n.precision+'\\n\\n'+n.reason_text;
  if(n.precision==='fp16'||n.precision==='fp32'){
    text+='\\n\\npredicted fp32 '+fmt(n.fp32_us)+' us, fp16 '+fmt(n.fp16_us)+' us\\nCasts it causes: '
      +Number(n.casts).toPrecision(3).replace(/\\.?0+$/,'')+' ('+fmt(n.cast_us)+' us)';
    var p=Object.keys(n.priced||{});
    if(p.length){text+='\\n\\npriced by its rule:';p.forEach(function(k){text+='\\n  '+k+' '+fmt(n.priced[k])})}
  }
  text+='\\n\\ninputs: '+n.inputs.join(', ')+'\\noutputs: '+n.outputs.join(', ');
  if(n.doc)text+='\\n\\ndoc_string:\\n'+n.doc;
  if(!shown(i))text+='\\n\\n(shape arithmetic or a constant: drawn with "shape arithmetic and constants" on)';
  details.textContent=text;
  if(scroll&&shown(i))centre(shown(i));
  var box=document.getElementById('rows'),r=rows[i];
  if(r.offsetTop<box.scrollTop||r.offsetTop>box.scrollTop+box.clientHeight-r.offsetHeight)box.scrollTop=r.offsetTop-box.clientHeight/2;
}
graphs.forEach(function(svg){svg.addEventListener('click',function(e){
  var g=e.target.closest('.n');if(g)select(+g.dataset.i,false)})});
rows.forEach(function(r){r.addEventListener('click',function(){select(+r.dataset.i,true)})});
function zoom(to){scale=Math.max(0.05,Math.min(4,to));
  graphs.forEach(function(svg){svg.setAttribute('width',svg.dataset.w*scale);svg.setAttribute('height',svg.dataset.h*scale)});
  document.getElementById('zoom').textContent=Math.round(scale*100)+' %'}
document.getElementById('zin').addEventListener('click',function(){zoom(scale*1.25)});
document.getElementById('zout').addEventListener('click',function(){zoom(scale/1.25)});
document.getElementById('zfit').addEventListener('click',function(){var svg=graphs[all?1:0];
  zoom(Math.min(view.clientWidth/svg.dataset.w,view.clientHeight/svg.dataset.h))});
document.getElementById('all').addEventListener('change',function(e){all=e.target.checked;
  graphs[0].style.display=all?'none':'';graphs[1].style.display=all?'':'none';if(selected!==null)select(selected,true)});
var order={};  // a header click sorts the table by that column, again: the other way
document.querySelectorAll('#rows thead th').forEach(function(th,c){th.addEventListener('click',function(){
  var body=document.querySelector('#rows tbody'),list=Array.prototype.slice.call(rows),down=order[c]=!order[c];
  var numeric=th.classList.contains('num');
  list.sort(function(a,b){var x=a.children[c].textContent,y=b.children[c].textContent,d;
    if(numeric){x=x===''?-1:+x;y=y===''?-1:+y;d=x-y}else d=x.localeCompare(y);
    return (down?-d:d)||(+a.dataset.i-+b.dataset.i)});
  list.forEach(function(r){body.appendChild(r)})})});
var hits=[];
document.getElementById('q').addEventListener('input',function(e){
  var q=e.target.value.trim(),re=null;
  try{re=q?new RegExp(q,'i'):null}catch(err){re=null}
  hits.forEach(function(i){boxes(i).forEach(function(g){g.classList.remove('hit')})});hits=[];
  rows.forEach(function(r,i){
    var n=nodes[i],ok=!q||(re?re.test(n.name)||re.test(n.op)||re.test(n.precision)||re.test(n.reason_text)
      :(n.name+n.op+n.reason_text).indexOf(q)>=0);
    r.style.display=ok?'':'none';if(ok&&q){hits.push(i);boxes(i).forEach(function(g){g.classList.add('hit')})}});
  document.getElementById('count').textContent=q?hits.length+' of '+nodes.length+' nodes':nodes.length+' nodes';
});
document.getElementById('count').textContent=nodes.length+' nodes';
var m=/#node=(.*)$/.exec(location.hash);
var chosen=-1;
if(m){var want=decodeURIComponent(m[1]);for(var i=0;i<nodes.length;i++)if(nodes[i].name===want){chosen=i;break}}
if(chosen>=0)select(chosen,true);
else{var first=graphs[0].querySelector('.n');if(first)view.scrollLeft=first.transform.baseVal.consolidate().matrix.e-40}
document.body.setAttribute('data-ready','1');
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body><header><h1>{title}</h1>{summary}<div>{legend}</div></header>
<div id="tools"><label><input type="checkbox" id="all"> shape arithmetic and constants</label>
<button id="zout" title="zoom out">&minus;</button><span id="zoom">100 %</span><button id="zin" title="zoom in">+</button>
<button id="zfit" title="the whole graph in view">fit</button></div>
<main><div id="view">{svg}</div><div id="details">Click a node (or a row below) for its reason and predicted times.</div></main>
<div id="find"><input id="q" placeholder="search names, ops, reasons (a regular expression)"> <span id="count"></span>
(click a column's name to sort by it)</div>
<div id="rows"><table><thead><tr><th>name</th><th>op</th><th>precision</th><th class="num">fp32 us</th>
<th class="num">fp16 us</th><th class="num">Casts</th><th class="num" title="fp32 us - fp16 us - the Casts' us">fp16 gain us</th>
<th>reason</th></tr></thead><tbody>{table}</tbody></table></div>
<script type="application/json" id="plan-data">{data}</script>
<script>{script}</script>
</body></html>
"""
