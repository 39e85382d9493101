"""The SVG plots of ``scripts/results_page.py``, written by hand (no plotting library needed): `svg_scatter` (the
KL-against-bits plot), `svg_grid` (scatter panels side by side: one per corpus and context) and `svg_bars` (the speed
plot). Standard library only.

``results_page.py`` imports them (``from _results_plots import ...``: the script's folder is on ``sys.path`` when
it runs as ``python scripts/results_page.py``); the names stay importable from ``results_page``.
"""
from __future__ import annotations

import html
import math
import re
from typing import List, Sequence, Tuple


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def svg_scatter(points: Sequence[Tuple[str, float, float, bool]], xlabel: str, ylabel: str, title: str,
                log_y: bool = True, width: int = 640, height: int = 400) -> str:
    """(label, x, y, baseline?) points; baselines as squares, ours as circles; log y axis by default."""
    pts = [(l, x, y, b) for l, x, y, b in points if x is not None and y is not None and (y > 0 or not log_y)]
    left, right, top, bottom = 70, 20, 36, 50
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs, ys = [p[1] for p in pts] or [0.0, 1.0], [fy(p[2]) for p in pts] or [0.0, 1.0]
    x0, x1 = 0.0, max(xs) * 1.08 or 1.0
    y0, y1 = (math.floor(min(ys)), math.ceil(max(ys))) if log_y else (0.0, max(ys) * 1.1 or 1.0)
    if y1 <= y0:
        y1 = y0 + 1
    px = lambda v: left + (v - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda v: height - bottom - (fy(v) - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{_esc(title)}</text>',
         f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
         f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>']
    step = max(1, int(math.ceil(x1 / 10)))
    for t in range(0, int(x1) + 1, step):
        s.append(f'<line x1="{px(t):.1f}" y1="{height - bottom}" x2="{px(t):.1f}" y2="{height - bottom + 4}" '
                 f'stroke="black"/><text x="{px(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{t}</text>')
    ticks = [10 ** e for e in range(int(y0), int(y1) + 1)] if log_y else [y0 + i * (y1 - y0) / 5 for i in range(6)]
    for t in ticks:
        label = f"1e{int(round(math.log10(t)))}" if log_y else f"{t:.3g}"
        s.append(f'<line x1="{left - 4}" y1="{py(t):.1f}" x2="{width - right}" y2="{py(t):.1f}" stroke="#ddd"/>'
                 f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{label}</text>')
    s.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{_esc(xlabel)}</text>')
    s.append(f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(top + height - bottom) / 2})">{_esc(ylabel)}</text>')
    placed: List[Tuple[float, float, float]] = []  # labels drawn: (x0, x1, baseline y)
    for label, x, y, baseline in sorted(pts, key=lambda p: py(p[2])):
        cx, cy = px(x), py(y)
        color = "#888" if baseline else "#1f6fb4"
        s.append(f'<rect x="{cx - 4:.1f}" y="{cy - 4:.1f}" width="8" height="8" fill="{color}"/>' if baseline else
                 f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4.5" fill="{color}"/>')
        right_side = cx > left + 0.7 * (width - left - right)  # label on the left of points near the right edge
        tx, w = (cx - 6 if right_side else cx + 6), 6.2 * len(label)  # ~6.2 px a character at 11 px
        (lx0, lx1), ty = ((tx - w, tx) if right_side else (tx, tx + w)), cy - 5
        while any(a < lx1 and lx0 < b and abs(ty - t) < 11 for a, b, t in placed):  # below a label it overlaps
            ty += 11
        placed.append((lx0, lx1, ty))
        anchor = ' text-anchor="end"' if right_side else ""
        s.append(f'<text x="{tx:.1f}" y="{ty:.1f}" fill="{color}"{anchor}>{_esc(label)}</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def svg_bars(bars: Sequence[Tuple[str, float]], xlabel: str, title: str, reference: float = 1.0,
             width: int = 640) -> str:
    """Horizontal bars (label, value) with a dashed line at ``reference`` (the plain cache's own speed)."""
    bars = [(l, v) for l, v in bars if v is not None]
    left, right, top, row = 150, 50, 36, 22
    height = top + row * max(len(bars), 1) + 40
    vmax = max([v for _, v in bars] + [reference]) * 1.1
    px = lambda v: left + v / vmax * (width - left - right)  # noqa: E731
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{_esc(title)}</text>']
    for i, (label, v) in enumerate(bars):
        y = top + i * row
        s.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{_esc(label)}</text>'
                 f'<rect x="{left}" y="{y + 3}" width="{px(v) - left:.1f}" height="{row - 6}" '
                 f'fill="{"#888" if label.startswith(("kv", "mlx-")) else "#1f6fb4"}"/>'
                 f'<text x="{px(v) + 4:.1f}" y="{y + 14}">{v:.2f}x</text>')
    y_end = top + row * len(bars)
    s.append(f'<line x1="{px(reference):.1f}" y1="{top}" x2="{px(reference):.1f}" y2="{y_end}" stroke="black" '
             f'stroke-dasharray="4 3"/>')
    s.append(f'<text x="{(left + width - right) / 2}" y="{y_end + 28}" text-anchor="middle">{_esc(xlabel)}</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def svg_grid(panels: Sequence[str], columns: int = 2) -> str:
    """Whole SVG pictures (`svg_scatter` output) as panels of one picture, ``columns`` a row, each at its own size."""
    sizes = [(float(re.search(r'width="([\d.]+)"', p).group(1)), float(re.search(r'height="([\d.]+)"', p).group(1)))
             for p in panels]
    if not panels:
        return '<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"/>\n'
    col_w = max(w for w, _ in sizes)
    rows = [sizes[i:i + columns] for i in range(0, len(sizes), columns)]
    row_h = [max(h for _, h in r) for r in rows]
    width, height = col_w * min(columns, len(panels)), sum(row_h)
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
         f'viewBox="0 0 {width:g} {height:g}" font-family="sans-serif" font-size="11">']
    for i, panel in enumerate(panels):
        x, y = col_w * (i % columns), sum(row_h[: i // columns])
        body = panel.strip().replace("<svg ", f'<svg x="{x:g}" y="{y:g}" ', 1)
        s.append(body)
    s.append("</svg>")
    return "\n".join(s) + "\n"
