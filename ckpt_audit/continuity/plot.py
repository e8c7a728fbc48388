"""An SVG of the watched metric around each resume: window, trend, threshold band, and the points after.

Hand-written SVG (no plotting dependency): one panel per resume point, stacked. Grey: the attempt before the
resume (the judged window shaded); dashed grey: what that attempt logged past the checkpoint and was thrown away;
blue: the attempt after the resume; red band: trend +/- threshold x noise. Pure: returns the document as a string.
"""

from __future__ import annotations

import math
from html import escape

from ckpt_audit.continuity.audit import ContinuityResult, PointResult
from ckpt_audit.continuity.metrics import Series

W, PANEL_H = 760, 240
PAD_L, PAD_R, PAD_T, PAD_B = 64, 20, 34, 36


def _stretches(s: Series, pr: PointResult, window: int) -> tuple[list, list, list]:
    """(before, thrown away, after) as (step, value) lists for one resume point."""
    i, r = pr.point.index, pr.point.resume_step
    j = i - 1
    old_tail: list[tuple[int, float]] = []  # the previous attempt past r, logged then discarded
    while j >= 0 and s.steps[j] > r and (j == i - 1 or s.steps[j] < s.steps[j + 1]):
        old_tail.append((s.steps[j], s.values[j]))
        j -= 1
    before: list[tuple[int, float]] = []
    while j >= 0 and len(before) < window + window // 2 and (not before or s.steps[j] < before[-1][0]):
        before.append((s.steps[j], s.values[j]))
        j -= 1
    after: list[tuple[int, float]] = []
    for k in range(i, len(s.steps)):
        if k > i and s.steps[k] <= s.steps[k - 1]:
            break
        after.append((s.steps[k], s.values[k]))
        if len(after) >= max(window // 2, 6):
            break
    return before[::-1], old_tail[::-1], after


def _panel(out: list[str], s: Series, pr: PointResult, result: ContinuityResult, top: float) -> None:
    j = pr.judgement
    before, thrown, after = _stretches(s, pr, result.window)
    pts = [p for p in before + thrown + after if math.isfinite(p[1])]
    if not pts:
        return
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    band = []
    if j.sufficient and math.isfinite(j.noise) and j.window_first_step is not None:
        hw = j.threshold * j.noise
        bx = [j.window_first_step, x1]
        band = [(x, j.expected(x) - hw, j.expected(x) + hw) for x in bx]
    ys = [p[1] for p in pts] + [b for _, lo, hi in band for b in (lo, hi)]
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    margin = (y1 - y0) * 0.06
    y0, y1 = y0 - margin, y1 + margin
    x1 = max(x1, x0 + 1)
    pw, ph = W - PAD_L - PAD_R, PANEL_H - PAD_T - PAD_B

    def X(step: float) -> float:
        return PAD_L + (step - x0) / (x1 - x0) * pw

    def Y(v: float) -> float:
        return top + PAD_T + (y1 - v) / (y1 - y0) * ph

    p = pr.point
    verdict = "no verdict" if not j.sufficient else ("JUMP" if j.jumped else "ok")
    score = f"score {j.score:+.1f} (threshold {j.threshold:g})" if j.sufficient else f"{j.n_before} points before"
    out.append(
        f'<text x="{PAD_L}" y="{top + 20:.1f}" class="title">{escape(result.metric)}: resume from step '
        f"{p.resume_step} ({escape('+'.join(p.sources))}) — {verdict}, {escape(score)}</text>"
    )
    out.append(f'<rect x="{PAD_L}" y="{top + PAD_T}" width="{pw}" height="{ph}" class="frame"/>')
    if j.window_first_step is not None and j.window_last_step is not None:
        out.append(
            f'<rect x="{X(j.window_first_step):.1f}" y="{top + PAD_T}" '
            f'width="{max(X(j.window_last_step) - X(j.window_first_step), 1):.1f}" height="{ph}" class="window"/>'
        )
    if band:
        (xa, la, ha), (xb, lb, hb) = band
        out.append(
            f'<polygon points="{X(xa):.1f},{Y(ha):.1f} {X(xb):.1f},{Y(hb):.1f} {X(xb):.1f},{Y(lb):.1f} '
            f'{X(xa):.1f},{Y(la):.1f}" class="band"/>'
        )
        out.append(
            f'<line x1="{X(xa):.1f}" y1="{Y(j.expected(xa)):.1f}" x2="{X(xb):.1f}" '
            f'y2="{Y(j.expected(xb)):.1f}" class="trend"/>'
        )
    rx = X(p.resume_step + 0.5)
    out.append(f'<line x1="{rx:.1f}" y1="{top + PAD_T}" x2="{rx:.1f}" y2="{top + PAD_T + ph}" class="resume"/>')
    for cls, seq in (("before", before), ("thrown", thrown), ("after", after)):
        seq = [q for q in seq if math.isfinite(q[1])]
        if len(seq) > 1:
            out.append(f'<polyline points="{" ".join(f"{X(a):.1f},{Y(b):.1f}" for a, b in seq)}" class="{cls}"/>')
        for a, b in seq:
            out.append(f'<circle cx="{X(a):.1f}" cy="{Y(b):.1f}" r="2.2" class="{cls}-pt"/>')
    for v in (y0 + margin, (y0 + y1) / 2, y1 - margin):
        out.append(f'<text x="{PAD_L - 6}" y="{Y(v) + 4:.1f}" class="tick" text-anchor="end">{v:.4g}</text>')
    for st in sorted({x0, p.resume_step, x1}):
        out.append(
            f'<text x="{X(st):.1f}" y="{top + PAD_T + ph + 16:.1f}" class="tick" text-anchor="middle">{st}</text>'
        )
    out.append(f'<text x="{PAD_L + pw}" y="{top + PAD_T + ph + 30:.1f}" class="tick" text-anchor="end">step</text>')


STYLE = """
  .title { font: 600 13px sans-serif; fill: #222; }
  .tick { font: 11px sans-serif; fill: #555; }
  .frame { fill: #fff; stroke: #bbb; }
  .window { fill: #e8eef7; }
  .band { fill: #d62728; fill-opacity: 0.12; }
  .trend { stroke: #d62728; stroke-dasharray: 4 3; stroke-width: 1.2; }
  .resume { stroke: #333; stroke-dasharray: 2 3; }
  polyline { fill: none; stroke-width: 1.6; }
  polyline.before { stroke: #777; } polyline.thrown { stroke: #aaa; stroke-dasharray: 5 3; }
  polyline.after { stroke: #1f77b4; }
  .before-pt { fill: #777; } .thrown-pt { fill: #bbb; } .after-pt { fill: #1f77b4; }
"""


def render_svg(result: ContinuityResult) -> str:
    """The SVG document: a panel per resume point, or one note when the log shows no resume."""
    n = max(1, len(result.points))
    h = n * PANEL_H + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}">',
        f"<style>{STYLE}</style>",
        f'<rect width="{W}" height="{h}" fill="#fafafa"/>',
    ]
    if not result.points:
        out.append(
            f'<text x="{PAD_L}" y="40" class="title">{escape(result.metric)}: no resume point in '
            f"{escape(', '.join(result.paths))}</text>"
        )
    for k, pr in enumerate(result.points):
        _panel(out, result.series, pr, result, k * PANEL_H)
    legend = (
        "grey: before the resume (shaded: judged window) · dashed: thrown away · blue: after · "
        "red: trend ± threshold × noise"
    )
    out.append(f'<text x="{PAD_L}" y="{h - 8}" class="tick">{escape(legend)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
