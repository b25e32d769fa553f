"""allow_islands (our extension of Campo): allow-list ops that only pay together go fp16 together.

The paper's pass 1 (``allow_by_cost``) prices an allow-list op alone, with a Cast on every
input and output. In a chain ``MatMul -> Add -> Gelu -> MatMul`` each MatMul alone may lose to
its Casts while the chain in fp16 needs Casts only at its two ends. This pass prices such
chains as a whole.

Rules, after ``deny_propagation`` (so no deny-downstream op is ever reopened):
1. an island is a set of allow-list nodes connected through undecided infer/clear nodes, with at
   least one node ``allow_by_cost`` left fp32 because it did not pay alone;
2. its *between* nodes are the undecided infer/clear nodes on paths from one of its allow nodes
   to another (the ones ``fill_infer_clear`` would fill);
3. when the cost model predicts a gain for running the island's fp32 allow nodes and its between
   nodes in fp16 (node times plus every Cast that appears or disappears), its fp32 allow nodes
   are switched to fp16 (``fill_infer_clear`` then fills the between nodes);
4. otherwise each of its fp32 allow nodes, in topological order, is priced together with each
   of the nearest allow nodes it reaches through open infer/clear nodes (``MAX_PARTNERS`` within
   ``MAX_HOPS``; the nodes between the two), and joins the one with the largest gain, if any;
5. an allow node that reaches no other (its island is itself) is priced together with its
   *tail*: the open infer/clear nodes downstream of it, up to decided nodes (a deny-list op, the
   graph's end). A GEMM whose bias and activation chain runs up to a LayerNorm's reduction pays
   in fp16 with that chain, its output Cast moved to the chain's end; ``edge_by_cost`` then
   prices and paints the tail itself.
"""

from __future__ import annotations

from collections import deque

from onnxcampo import estimate
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult

_THROUGH = (Category.INFER, Category.CLEAR)
# Rule 4 looks for partners near a rejected node: within this many open nodes, the nearest few.
# In a residual stream every allow node reaches every other through open Adds, and pricing all
# pairs with the whole stream between them made the pass cubic in the graph's size (a 400-block
# MLP: 17 s, a 20k-node one: hours); partners farther apart pay less anyway (more nodes between).
MAX_HOPS = 8
MAX_PARTNERS = 4


class AllowIslands(PassBase):
    name = "allow_islands"

    def run(self, ctx: GraphContext) -> PassResult:
        switched = islands = 0
        seen: set[str] = set()
        for node in ctx.nodes:
            decision = ctx.plan.get(node.name)
            if decision is None or decision.reason is not Reason.ALLOW_DOES_NOT_PAY or node.name in seen:
                continue
            allow, between = self._island(ctx, node)
            seen.update(n.name for n in allow)
            rejected = [n for n in allow if ctx.plan.get(n.name).reason is Reason.ALLOW_DOES_NOT_PAY]
            if not rejected:
                continue
            if len(allow) < 2:
                tail = self._tail(ctx, node)
                numbers = estimate.delta(ctx, ctx.plan, [node, *tail]) if tail else None
                if numbers is not None and numbers["gain_us"] > 0:
                    islands += 1
                    switched += self._switch(ctx, [node], numbers)
                continue
            islands += 1
            numbers = estimate.delta(ctx, ctx.plan, rejected + between)
            if numbers["gain_us"] > 0:
                switched += self._switch(ctx, rejected, numbers)
            else:
                switched += self._pairs(ctx, allow, rejected)
        return PassResult(self.name, False, {"islands": islands, "fp16": switched})

    @staticmethod
    def _switch(ctx: GraphContext, members, numbers) -> int:
        for member in members:
            ctx.plan.override(member.name, Precision.FP16, Reason.ALLOW_ISLAND_PAYS, **numbers)
        return len(members)

    def _pairs(self, ctx: GraphContext, allow, rejected) -> int:
        """Rule 4: an island that does not pay as a whole may still hold neighbours that pay
        together: each still-rejected node joins the neighbour with which the gain is largest."""
        switched = 0
        for member in rejected:
            if ctx.plan.is_fp16(member.name):
                continue
            best = None
            for neighbour in self._allow_neighbours(ctx, member, {n.name for n in allow}):
                pair = [n for n in (member, neighbour) if not ctx.plan.is_fp16(n.name)]
                between = self._between(ctx, [member, neighbour])
                numbers = estimate.delta(ctx, ctx.plan, pair + between)
                if numbers["gain_us"] > 0 and (best is None or numbers["gain_us"] > best[1]["gain_us"]):
                    best = (pair, numbers)
            if best is not None:
                switched += self._switch(ctx, *best)
        return switched

    def _allow_neighbours(self, ctx: GraphContext, start, allow_names: set[str]):
        """The nearest ``MAX_PARTNERS`` allow nodes reached from ``start`` through at most
        ``MAX_HOPS`` open infer/clear nodes, nearest first."""
        found, seen, queue = {}, {start.name}, deque([(start, 0)])
        while queue and len(found) < MAX_PARTNERS:
            node, hops = queue.popleft()
            for neighbour in (*ctx.upstream(node), *ctx.downstream(node)):
                if neighbour.name in seen:
                    continue
                seen.add(neighbour.name)
                if neighbour.name in allow_names:
                    found[neighbour.name] = neighbour
                elif hops < MAX_HOPS and self._open(ctx, neighbour):
                    queue.append((neighbour, hops + 1))
        return list(found.values())[:MAX_PARTNERS]

    def _between(self, ctx: GraphContext, ends) -> list:
        """The open nodes on paths between ``ends`` (within ``MAX_HOPS`` of one of them)."""
        passage = {}
        for end in ends:
            for step in (ctx.upstream, ctx.downstream):
                queue = deque([(end, 0)])
                while queue:
                    node, hops = queue.popleft()
                    if hops >= MAX_HOPS:
                        continue
                    for neighbour in step(node):
                        if neighbour.name not in passage and self._open(ctx, neighbour):
                            passage[neighbour.name] = neighbour
                            queue.append((neighbour, hops + 1))
        below = self._reach(ctx, ends, ctx.downstream, passage)
        above = self._reach(ctx, ends, ctx.upstream, passage)
        return [passage[name] for name in passage if name in below and name in above]

    def _tail(self, ctx: GraphContext, start) -> list:
        """Open infer/clear nodes reached downstream of ``start`` through open nodes only."""
        tail, seen, queue = [], {start.name}, deque([start])
        while queue:
            for neighbour in ctx.downstream(queue.popleft()):
                if neighbour.name not in seen and self._open(ctx, neighbour):
                    seen.add(neighbour.name)
                    tail.append(neighbour)
                    queue.append(neighbour)
        return tail

    @staticmethod
    def _open(ctx: GraphContext, node) -> bool:
        return not ctx.plan.is_decided(node.name) and ctx.categories[node.name] in _THROUGH

    def _island(self, ctx: GraphContext, start):
        """Allow nodes reachable from ``start`` through open infer/clear nodes, and the open
        nodes lying between two of them."""
        allow = {start.name: start}
        passage: dict[str, object] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for neighbour in (*ctx.upstream(node), *ctx.downstream(node)):
                name = neighbour.name
                if name in allow or name in passage:
                    continue
                if ctx.categories[name] is Category.ALLOW and ctx.plan.get(name) is not None \
                        and ctx.plan.get(name).reason in (Reason.ALLOW_PAYS, Reason.ALLOW_DOES_NOT_PAY):
                    allow[name] = neighbour
                    queue.append(neighbour)
                elif self._open(ctx, neighbour):
                    passage[name] = neighbour
                    queue.append(neighbour)
        below = self._reach(ctx, allow.values(), ctx.downstream, passage)
        above = self._reach(ctx, allow.values(), ctx.upstream, passage)
        between = [passage[name] for name in passage if name in below and name in above]
        return list(allow.values()), between

    @staticmethod
    def _reach(ctx: GraphContext, sources, step, passage) -> set[str]:
        reached: set[str] = set()
        queue = deque(sources)
        while queue:
            for neighbour in step(queue.popleft()):
                if neighbour.name in passage and neighbour.name not in reached:
                    reached.add(neighbour.name)
                    queue.append(neighbour)
        return reached
