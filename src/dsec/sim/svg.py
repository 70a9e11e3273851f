"""Line charts as plain SVG text, for the simulation report and the dashboard.

Written by hand on purpose: matplotlib is optional (the ``sim`` extra) and draws only PNGs here, while this chart
must exist on every install that can run the simulator and must stay sharp in a browser at any width. A few
polylines, axes with round ticks and a legend need no plotting library. Every text is XML-escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

WIDTH, HEIGHT = 760, 380
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 66, 52  # margins around the plot area (the legend sits above it)


@dataclass(frozen=True)
class Series:
    label: str
    color: str
    points: Sequence[tuple[float, float]]
    dashed: bool = False


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    count = math.ceil((hi - first) / step - 1e-9)
    return [round(first + i * step, 12) for i in range(count + 1)]


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def _text(x: float, y: float, text: str, anchor: str = "middle", **attrs: str) -> str:
    extra = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(text)}</text>'


def line_chart(title: str, xlabel: str, ylabel: str, series: Sequence[Series]) -> str:
    """An SVG document: the series as polylines over shared axes starting at y = 0, a legend in a row above."""
    xs = [x for s in series for x, _ in s.points] or [0.0, 1.0]
    ys = [y for s in series for _, y in s.points] or [0.0, 1.0]
    xt, yt = ticks(min(xs), max(xs)), ticks(min(0.0, min(ys)), (max(ys) or 1.0) * 1.05)  # headroom over the top
    x0, x1, y0, y1 = xt[0], max(xt[-1], xt[0] + 1e-9), yt[0], max(yt[-1], yt[0] + 1e-9)
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label={quoteattr(title)} font-family="sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        _text(WIDTH / 2, 24, title, font_size="15", font_weight="bold"),
    ]
    for v in xt:
        out.append(f'<line x1="{px(v):.1f}" y1="{TOP}" x2="{px(v):.1f}" y2="{TOP + ph}" stroke="#eeeeee"/>')
        out.append(_text(px(v), TOP + ph + 16, _label(v)))
    for v in yt:
        out.append(f'<line x1="{LEFT}" y1="{py(v):.1f}" x2="{LEFT + pw}" y2="{py(v):.1f}" stroke="#eeeeee"/>')
        out.append(_text(LEFT - 6, py(v) + 4, _label(v), anchor="end"))
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888888"/>')
    out.append(_text(LEFT + pw / 2, HEIGHT - 12, xlabel))
    out.append(_text(16, TOP + ph / 2, ylabel, transform=f"rotate(-90 16 {TOP + ph / 2:.1f})"))
    lx = float(LEFT)
    for s in series:
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke={quoteattr(s.color)} stroke-width="2"{dash}/>')
        out.append(f'<line x1="{lx:.1f}" y1="42" x2="{lx + 22:.1f}" y2="42" stroke={quoteattr(s.color)} '
                   f'stroke-width="2"{dash}/>')  # fmt: skip
        out.append(_text(lx + 28, 46, s.label, anchor="start"))
        lx += 44 + 6.5 * len(s.label)  # about the width of the label at 12 px
    out.append("</svg>")
    return "\n".join(out) + "\n"


def rates(timeline: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(simulated hours, useful steps/s over the interval that ends there) from cumulative (s, steps) points."""
    out: list[tuple[float, float]] = []
    prev_t, prev_s = 0.0, 0.0
    for t, s in timeline:
        if t > prev_t:
            out.append((t / 3600.0, (s - prev_s) / (t - prev_t)))
        prev_t, prev_s = t, s
    return out
