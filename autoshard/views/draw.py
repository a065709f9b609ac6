"""A picture of a Plan: modules colored by layout, collectives marked with their bytes.

`picture_graph(plan)` condenses the plan's graph (autoshard.views.graph) to what a reader needs: one box
per module that owns parameters (or runs a sharded loss), the model's inputs and output, and
one marker per collective (a redistribution, or the all-reduce a row-parallel matmul runs
itself) on the data flow between them. Runs of consecutive blocks of a ModuleList
(`blocks.3.attn.q`, `model.layers.3.mlp.up_proj`) that were planned the same way are folded
into one block drawn once with its count, so a 48-block model draws like a 1-block one.
`draw(plan, path)` lays that graph out in layers (longest path, barycenter ordering) and writes
it with matplotlib (an optional dependency: the "draw" extra).
"""
from __future__ import annotations

import os
import re
from collections import Counter

from ..capture.ops import is_loss
from ..runtime.placements import Shard, maybe_local_shape
from .layout import layers, order, skip_lanes
from .report import fmt_bytes

LAYOUT_COLORS = {             # parameter layout -> box color (colorblind-safe Tableau hues)
    "replicate": "#d3d3d3",
    "column": "#76a7d6",
    "row": "#f4a259",
    "vocabulary": "#7cc47c",
    "strided": "#c39bd3",
}
COMM_COLOR = "#c0392b"
_INDEX = re.compile(r"^(?P<prefix>.+?)\.(?P<i>\d+)(?:\.(?P<rest>.*))?$")
FORMATS = (".svg", ".png", ".pdf")     # by extension


def _shape(s) -> str:
    return "[" + ",".join(str(x) for x in s) + "]" if s is not None else ""


def layout_class(strategy: str, placement) -> str:
    """replicate / column / row / vocabulary / strided, from a node's strategy and its largest
    parameter's layout (an embedding split over its hidden size counts as column-parallel)."""
    if isinstance(placement, Shard) and placement.chunks > 1:
        return "strided"
    if strategy == "vocab":
        return "vocabulary"
    if strategy == "row":
        return "row"
    if strategy in ("column", "hidden"):
        return "column"
    if isinstance(placement, Shard):
        return "column" if placement.dim == 0 else "row"
    return "replicate"


def _carries_tensor(d) -> bool:
    pl = d["placement"]
    return bool(d["bytes"]) or (isinstance(pl, tuple) and any(x is not None for x in pl))


def _block(module: str):
    """(ModuleList prefix, index, rest) of a module path with a numeric component, else None."""
    m = _INDEX.match(module or "")
    return (m["prefix"], int(m["i"]), m["rest"] or "") if m else None


def _condense(plan, G):
    """The graph of visible items: module units, inputs, output, collective markers."""
    import networkx as nx

    owners = {name.rpartition(".")[0] for name in plan.layouts}
    modules = dict(plan.graph_module.named_modules())
    fx_nodes = {n.name: n for n in plan.graph_module.graph.nodes}

    unit: dict[str, str] = {}                  # fx node -> visible key
    info: dict[str, dict] = {}
    for n, d in G.nodes(data=True):
        if d["kind"] == "input" and d["bytes"]:
            key = n
            info[key] = dict(kind="input", name=n, module="", order=None, shape=d["shape"])
        elif d["kind"] == "output":
            key = n
            info[key] = dict(kind="output", name="output", module="", order=None)
        elif d["kind"] == "op":
            params = [u for u in G.predecessors(n) if G.nodes[u]["kind"] == "param"]
            leaf = d["fx_op"] == "call_module" and d["target"] in owners
            if not (params or leaf or d["dim"] is not None or is_loss(fx_nodes[n], modules)):
                continue
            key = d["module"] if (params or leaf) and d["module"] else n
            if key not in info:
                info[key] = dict(kind="unit", name=key, module=d["module"] if (params or leaf) else "",
                                 order=None, params=[], ops=[], strategy=d["strategy"])
            u = info[key]
            u["ops"].append(d["op"])
            if d["dim"] is not None or u["strategy"] == "replicate":
                u["strategy"] = d["strategy"]
            for q in params:
                u["params"].append(q)
            if leaf:
                u["params"] += [name for name in plan.layouts if name.rpartition(".")[0] == d["target"]]
        else:
            continue
        unit[n] = key
    H = nx.DiGraph()
    H.add_nodes_from(G.nodes)
    H.add_edges_from((u, v) for u, v in G.edges if _carries_tensor(G.nodes[u]))
    p = plan.world_size
    for ri, r in enumerate(plan.redistributions):
        if not (r.forward or r.backward):
            continue
        m = f"comm:{ri}"
        kinds = [("fwd", k) for k in r.forward] + [("bwd", k) for k in r.backward]
        info[m] = dict(kind="comm", name=r.node, module=G.nodes[r.node]["module"], kinds=kinds,
                       bytes=r.ring_bytes(p), what=f"{r.src}->{r.dst}", order=None,
                       anchor=r.node)
        for c in r.consumers:
            if H.has_edge(r.node, c):
                H.remove_edge(r.node, c)
            H.add_edge(r.node, m)
            H.add_edge(m, c)
        unit[m] = m
    for n, d in G.nodes(data=True):
        if d["comm"]:
            m = f"comm:{n}"
            info[m] = dict(kind="comm", name=n, module=d["module"], kinds=[("", k) for k, _ in d["comm"]],
                           bytes=d["comm_bytes"], what=f"{d['op']} ({d['strategy']})", order=None, anchor=n)
            outs = list(H.successors(n))
            H.remove_edges_from((n, v) for v in outs)
            H.add_edges_from((m, v) for v in outs)
            H.add_edge(n, m)
            unit[m] = m
    fx_order = {n: i for i, n in enumerate(G.nodes)}
    for x, key in unit.items():                          # order: the item's first fx node
        it = info[key]
        o = fx_order[x] if x in fx_order else fx_order[it["anchor"]] + 0.5
        it["order"] = o if it["order"] is None else min(it["order"], o)
    C = nx.DiGraph()
    for key, it in info.items():
        C.add_node(key, **it)
    for x, key in unit.items():              # visible -> the visible items reached through hidden nodes
        stack, seen = list(H.successors(x)), set()
        while stack:
            y = stack.pop()
            if y in seen:
                continue
            seen.add(y)
            if y in unit:
                if unit[y] != key:
                    C.add_edge(key, unit[y])
            else:
                stack.extend(H.successors(y))
    return C


def _signature(C, key, rest):
    it = C.nodes[key]
    if it["kind"] == "comm":
        return ("comm", rest, tuple(it["kinds"]), it["bytes"], it["what"])
    return (it["kind"], rest, it.get("strategy"), tuple(sorted(it.get("layouts", ()))))


def picture_graph(plan, G=None, fold: bool = True):
    """The condensed, folded graph `draw` lays out (a networkx.DiGraph).

    Nodes: kind (unit / input / output / comm), name (within its fold), module, layout (a
    LAYOUT_COLORS key, units), text lines, fold (the run it belongs to, or None); comm nodes:
    kinds, bytes (ring bytes per rank, one block). Graph attribute `folds`: a list of dicts
    (prefix, start, end, count, nodes) for the runs of identically planned blocks."""
    import networkx as nx

    from .graph import to_networkx

    G = to_networkx(plan) if G is None else G
    C = _condense(plan, G)
    p = plan.world_size
    gm_params = dict(plan.graph_module.named_parameters(remove_duplicate=False))
    for key, it in C.nodes(data=True):
        if it["kind"] != "unit":
            continue
        names = [G.nodes[q]["target"] if q in G else q for q in it["params"]]
        names = list(dict.fromkeys(names))
        it["param_names"] = names
        big = max(names, key=lambda q: gm_params[q].numel()) if names else None
        pl = plan.layouts[big] if big else None
        it["placement"] = pl
        it["layout"] = layout_class(it["strategy"], pl)
        it["layouts"] = [str(plan.layouts[q]) for q in names]
        if big is not None:
            t = gm_params[big]
            it["weight"] = (tuple(t.shape), maybe_local_shape(t.shape, pl, p))
    # ---- fold runs of identical blocks
    block_of, rest_of = {}, {}
    for key, it in C.nodes(data=True):
        b = _block(it["module"])
        if b and fold:
            block_of[key] = b[:2]
            rest_of[key] = b[2]
    members: dict = {}
    for key in sorted(block_of, key=lambda k: C.nodes[k]["order"]):
        members.setdefault(block_of[key], []).append(key)
    sig = {}
    for blk, keys in members.items():
        seen = Counter()
        labelled = []
        for k in keys:
            s = _signature(C, k, rest_of[k])
            labelled.append((s, seen[s]))
            seen[s] += 1
        sig[blk] = tuple(labelled)
    runs, by_prefix = [], {}
    for prefix, i in sorted(members, key=lambda b: (min(C.nodes[k]["order"] for k in members[b]))):
        by_prefix.setdefault(prefix, []).append(i)
    rep = {}                                   # node -> folded key
    fold_of = {}
    for prefix, idxs in by_prefix.items():
        idxs = sorted(idxs)
        start = 0
        while start < len(idxs):
            end = start
            while end + 1 < len(idxs) and idxs[end + 1] == idxs[end] + 1 and \
                    sig[(prefix, idxs[end + 1])] == sig[(prefix, idxs[start])]:
                end += 1
            run = dict(prefix=prefix, start=idxs[start], end=idxs[end], count=end - start + 1, nodes=[])
            runs.append(run)
            r = len(runs) - 1
            first = members[(prefix, idxs[start])]
            for i in idxs[start:end + 1]:
                for k, k0 in zip(members[(prefix, i)], first):
                    rep[k] = k0
                    fold_of[k] = r
            run["nodes"] = list(first)
            start = end + 1
    F = nx.DiGraph(folds=runs)
    for key, it in C.nodes(data=True):
        if rep.get(key, key) != key:
            continue
        attrs = dict(it)
        attrs["fold"] = fold_of.get(key)
        own = it["name"] if it["kind"] != "comm" else (it["module"] or it["name"])   # a module reads better
        attrs["label"] = rest_of.get(key) or own if attrs["fold"] is not None else own
        F.add_node(key, **attrs)
    for a, b in C.edges:
        fa, fb = rep.get(a, a), rep.get(b, b)
        if fa == fb:
            continue
        if a in fold_of and fold_of.get(a) == fold_of.get(b) and block_of[a] != block_of[b]:
            continue                            # block i -> block i+1 of one run: the repeat
        if F.nodes[fa]["order"] >= F.nodes[fb]["order"]:
            continue                            # would close a cycle after folding
        F.add_edge(fa, fb)
    # keep dependencies, not every path: a residual stream reaches each later block and norm
    # through additions (hidden), which would draw as edges from everything to everything below
    reduced = nx.transitive_reduction(F)
    F.remove_edges_from([e for e in list(F.edges) if not reduced.has_edge(*e)])
    return F


def _unit_text(it):
    """Two lines: the module (and a weight it shares with another module), then the op, its
    strategy, the layout of its largest parameter and that parameter's full -> per-rank shape."""
    title = it["label"]
    tied = [q for q in it.get("param_names", ()) if q.rpartition(".")[0] != it["module"]]
    if tied and it["module"]:
        title += f"  (tied: {tied[0]})"
    op = "/".join(dict.fromkeys(o.split(".")[0] for o in it["ops"]))
    detail = f"{op} · {it['strategy']}"
    if it.get("weight"):
        full, local = it["weight"]
        shapes = f"{_shape(full)}→{_shape(local)}" if full != local else _shape(full)
        detail += f"  {it['placement']} {shapes}" if isinstance(it["placement"], Shard) else f"  {shapes}"
    return [title, detail]


def _comm_text(it, count):
    kinds = " + ".join(f"{d} {k}".strip() for d, k in it["kinds"])
    b = fmt_bytes(it["bytes"])
    return f"{kinds}  {b}" + (f" (×{count} = {fmt_bytes(it['bytes'] * count)})" if count > 1 else "")


def draw(plan, path, *, fold: bool = True, title: str | None = None, dpi: int = 110):
    """Write a picture of `plan` to `path` (.svg, .png or .pdf, by extension); returns `path`."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"Plan.draw({str(path)!r}): the extension picks the format; use one of {', '.join(FORMATS)}")
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    except ImportError as e:
        raise ImportError("Plan.draw needs matplotlib, an optional dependency of autoshard: "
                          "pip install 'autoshard[draw]' (or pip install matplotlib)") from e
    from .graph import to_networkx

    G = to_networkx(plan)
    F = picture_graph(plan, G, fold=fold)
    p = plan.world_size
    layer = layers(F)
    rows, xs = order(F, layer)
    folds = F.graph["folds"]
    BW, BH, XS, YS = 2.7, 0.5, 3.1, 0.78           # box width/height, column and layer spacing (inches)
    levels = sorted(rows)
    ylev = {lv: -k * YS for k, lv in enumerate(levels)}
    pos = {n: (xs[n] * XS, ylev[layer[n]]) for n in F}

    def half_w(n):
        return 0.09 if F.nodes[n]["kind"] == "comm" else BW / 2

    def half_h(n):
        return 0.09 if F.nodes[n]["kind"] == "comm" else BH / 2
    def label_w(n):                              # right end of a marker's label (7.5 pt text)
        return 0.25 + 0.062 * len(_comm_text(F.nodes[n], count_of[n]))
    lanes = skip_lanes(F, layer, pos, half_w, 0.3)
    count_of = {n: folds[F.nodes[n]["fold"]]["count"] if F.nodes[n]["fold"] is not None else 1 for n in F}
    boxes = []                                   # fold boxes: (run, x0, y0, x1, y1)
    for r, run in enumerate(folds):
        ns = [n for n in F if F.nodes[n]["fold"] == r]
        if not ns:
            continue
        own = [x for (a, b), x in lanes.items() if F.nodes[a]["fold"] == r and F.nodes[b]["fold"] == r]
        x0 = min([pos[n][0] - half_w(n) for n in ns] + own) - 0.25
        x1 = max(pos[n][0] + (label_w(n) if F.nodes[n]["kind"] == "comm" else BW / 2) for n in ns) + 0.55
        y0 = min(pos[n][1] - half_h(n) for n in ns) - 0.12
        y1 = max(pos[n][1] + half_h(n) for n in ns) + 0.32
        boxes.append((run, x0, y0, x1, y1))
    xmin = min([pos[n][0] - half_w(n) for n in F] + list(lanes.values()) + [b[1] for b in boxes]) - 0.3
    xmax = max([pos[n][0] + BW / 2 for n in F] + [b[3] for b in boxes]
               + [pos[n][0] + label_w(n) for n in F if F.nodes[n]["kind"] == "comm"]) + 0.3
    top, bottom = 0.9, ylev[levels[-1]] - 0.7
    width, height = xmax - xmin, top - bottom
    legend_w = 4.0
    fig_h = max(height + 0.5, 6.5)
    fig = Figure(figsize=(width + legend_w, fig_h))
    ax = fig.add_axes((0, 0, width / (width + legend_w), height / fig_h))
    lg = fig.add_axes((width / (width + legend_w), 0, legend_w / (width + legend_w), 1))
    for a in (ax, lg):
        a.set_axis_off()
    ax.set_xlim(xmin, xmax)
    ax.set_ylim(bottom, top)
    for run, x0, y0, x1, y1 in boxes:
        ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    fc="#f6f6f0", ec="#888888", lw=1.0, ls="--", zorder=0))
        rng = f"{run['start']}" if run["count"] == 1 else f"{run['start']}–{run['end']}"
        ax.text(x0 + 0.12, y1 - 0.06, f"{run['prefix']}.{rng}" + (f"   ×{run['count']}" if run["count"] > 1 else ""),
                ha="left", va="top", fontsize=9.5, fontweight="bold", color="#555555", zorder=1)
        if run["count"] > 1:                      # the output of block i is the input of block i+1
            ax.add_patch(FancyArrowPatch((x1 - 0.18, y0 + 0.1), (x1 - 0.18, y1 - 0.1), arrowstyle="-|>",
                                         mutation_scale=10, lw=1.0, ls=(0, (4, 3)), color="#888888", zorder=1))
            ax.text(x1 - 0.26, (y0 + y1) / 2, f"output of block i feeds block i+1 (×{run['count']})", rotation=90,
                    ha="right", va="center", fontsize=7.5, color="#777777", zorder=1)
    for a, b in F.edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        into, out_of = F.nodes[b]["kind"] == "comm", F.nodes[a]["kind"] == "comm"
        color = COMM_COLOR if into or out_of else "#666666"
        lw = 1.9 if into else (1.2 if out_of else 0.9)
        if (a, b) in lanes:
            lx = lanes[(a, b)]
            drop = ya - BH / 2 - 0.1                  # leave downwards, then run under the source's layer
            ax.plot([xa, xa, lx, lx], [ya - half_h(a), drop, drop, yb], color=color, lw=lw, zorder=2,
                    solid_joinstyle="round")
            ax.add_patch(FancyArrowPatch((lx, yb), (xb - half_w(b), yb), arrowstyle="-|>", mutation_scale=9,
                                         lw=lw, color=color, zorder=2, shrinkA=0, shrinkB=0))
            continue
        ax.add_patch(FancyArrowPatch((xa, ya - half_h(a)), (xb, yb + half_h(b)), arrowstyle="-|>",
                                     mutation_scale=9, lw=lw, color=color, zorder=2, shrinkA=0, shrinkB=0))
    for n, it in F.nodes(data=True):
        x, y = pos[n]
        kind = it["kind"]
        if kind == "comm":
            ax.plot([x], [y], marker="D", ms=9, color=COMM_COLOR, zorder=4)
            ax.text(x + 0.18, y, _comm_text(it, count_of[n]), ha="left", va="center", fontsize=7.5,
                    color=COMM_COLOR, zorder=5, bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
            continue
        if kind == "unit":
            fc, lines = LAYOUT_COLORS[it["layout"]], _unit_text(it)
        elif kind == "input":
            fc, lines = "white", [it["name"], f"input {_shape(it['shape'])}"]
        else:
            fc, lines = "white", ["output"]
        ax.add_patch(FancyBboxPatch((x - BW / 2, y - BH / 2), BW, BH, boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=fc, ec="#333333", lw=0.9, zorder=3))
        ax.text(x, y + (0.09 if len(lines) > 1 else 0), lines[0], ha="center", va="center", fontsize=8.5,
                fontweight="bold", zorder=5)
        if len(lines) > 1:
            ax.text(x, y - 0.12, lines[1], ha="center", va="center", fontsize=7, zorder=5, color="#222222")
    handles = [Patch(fc=c, ec="#333333", label=k) for k, c in LAYOUT_COLORS.items()]
    handles.append(Line2D([], [], color=COMM_COLOR, marker="D", lw=1.8,
                          label="collective, bytes per rank\n(one block; × count)"))
    lg.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.02, 1 - 0.5 / fig_h), fontsize=9, frameon=False,
              title="parameter layout", title_fontsize=10, alignment="left")
    lg.text(0.05, 1 - 2.9 / fig_h, _summary_text(plan, G, folds), ha="left", va="top",
            fontsize=8.5, family="monospace", transform=lg.transAxes)
    fig.text(0.01, 1 - 0.12 / fig_h, title or f"autoshard plan · {p} ranks · {plan.tracer} / {plan.search}",
             ha="left", va="top", fontsize=12, fontweight="bold")
    fig.savefig(path, dpi=dpi)
    return path


def _summary_text(plan, G, folds) -> str:
    p = plan.world_size
    lines = [f"per rank ({p} ranks)",
             f"  params  {plan.params_per_rank:,} of {plan.params_total:,}",
             f"          {fmt_bytes(G.graph['param_bytes_per_rank'])} "
             f"({plan.params_per_rank / max(plan.params_total, 1):.2f} of full)",
             f"  training state  {fmt_bytes(plan.memory['parameters'] + plan.memory['gradients'] + plan.memory['optimizer'])}",
             f"  step peak  {fmt_bytes(plan.memory['peak'])}",
             "",
             "communication per step (fwd+bwd)",
             f"  {fmt_bytes(plan.comm_bytes)} per rank"]
    for k, (c, b) in sorted(plan.comm_by_kind.items()):
        lines.append(f"  {k}: {c} x, {fmt_bytes(b)}")
    lines += ["", f"est. step {plan.step_time * 1e3:.3f} ms",
              f"  (comm {plan.comm_time * 1e3:.3f}, compute {plan.compute_time * 1e3:.3f})"]
    rep = [r for r in folds if r["count"] > 1]
    if rep:
        lines += ["", "folded: blocks planned alike", "drawn once"]
        lines += [f"  {r['prefix']}.{r['start']}–{r['end']}  ×{r['count']}" for r in rep]
    return "\n".join(lines)
