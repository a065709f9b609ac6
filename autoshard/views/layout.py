"""Where the picture's items go: layers, order within a layer, lanes for edges that skip layers.

A plain layered layout (longest-path layers, barycenter ordering) of the condensed graph that
`draw.picture_graph` makes; `draw.draw` places boxes and markers by it.
"""
from __future__ import annotations


def layers(F):
    """Longest-path layers, sources moved down to just above their first reader."""
    import networkx as nx
    layer = {}
    for n in nx.topological_sort(F):
        layer[n] = max((layer[u] + 1 for u in F.predecessors(n)), default=0)
    for n in sorted(F, key=lambda n: -layer[n]):
        if F.in_degree(n) == 0 and F.out_degree(n):
            layer[n] = min(layer[s] for s in F.successors(n)) - 1
    return layer


def order(F, layer, sweeps: int = 6):
    """Rows of each layer and every item's x: barycenter sweeps, down and up, from the graph's order."""
    rows: dict[int, list] = {}
    for n in sorted(F, key=lambda n: F.nodes[n]["order"]):
        rows.setdefault(layer[n], []).append(n)
    x = {}

    def place():
        for row in rows.values():
            for i, n in enumerate(row):
                x[n] = i - (len(row) - 1) / 2
    place()
    for s in range(sweeps):
        down = s % 2 == 0
        for lv in sorted(rows, reverse=not down):
            row = rows[lv]
            nb = (lambda n: list(F.predecessors(n))) if down else (lambda n: list(F.successors(n)))

            def bary(n):
                ns = nb(n)
                return sum(x[m] for m in ns) / len(ns) if ns else x[n]
            row.sort(key=lambda n: (bary(n), F.nodes[n]["order"]))
            for i, n in enumerate(row):
                x[n] = i - (len(row) - 1) / 2
    return rows, x


def skip_lanes(F, layer, pos, half_w, margin):
    """Edges that skip layers run down a vertical lane left of what they pass: {edge: lane x},
    lanes side by side where their spans overlap."""
    lanes, taken = {}, []                   # taken: (x, y_top, y_bottom)
    skips = sorted((e for e in F.edges if layer[e[1]] - layer[e[0]] > 1), key=lambda e: (layer[e[1]] - layer[e[0]]))
    for a, b in skips:
        lo, hi = layer[a], layer[b]
        inside = [n for n in F if lo <= layer[n] <= hi]
        x = min(pos[n][0] - half_w(n) for n in inside) - margin
        ya, yb = pos[a][1], pos[b][1]
        while any(abs(tx - x) < 0.05 and not (yb > t0 or ya < t1) for tx, t0, t1 in taken):
            x -= 0.16
        taken.append((x, ya, yb))
        lanes[(a, b)] = x
    return lanes
