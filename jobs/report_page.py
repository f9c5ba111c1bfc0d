"""`confidant report PLAN [--metrics RUN.json] -o report.html`: one self-contained HTML page of a plan and
a run of it. Everything is inline (SVG drawn here, CSS, no script needed, nothing fetched), so the
page opens offline and can be mailed.

Parts, each findable by id and data attributes (tests/jobs/test_report_page.py reads them in Chromium):
- `#memory`: per device (`.device-memory[data-device]`) a bar of its planned memory by part
  (`rect[data-part]`, planner.memory_defaults.PARTS), its measured peak (`.measured`) and its budget
  (`.budget`), in MiB;
- `#timeline`: the plan's simulated steps (planner.simulate, the events `confidant simulate` writes
  as a Chrome trace), one row per device (`.timeline-row[data-device]`), one rect per action;
  beside it the measured step times when the metrics hold them (`#measured-steps`);
- `#loss`: the loss per step (`polyline#loss-curve`) and `#metric`, the task's metric before/after.
"""
from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Any, Mapping, Sequence

from ir.errors import InputFileError

MIB = 2 ** 20
PART_COLOURS = {"weights": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#e15759", "frozen": "#76b7b2",
                "activations": "#59a14f", "workspace": "#edc948", "runtime": "#b07aa1", "other": "#9c755f",
                "planned": "#4e79a7", "reserve": "#d3d3d3"}
KIND_COLOURS = {"F": "#4e79a7", "B": "#e15759", "W": "#f28e2b", "UPDATE": "#59a14f", "SEND_ACT": "#bab0ac",
                "SEND_GRAD": "#bab0ac"}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 6px}
.sub{color:#666} .legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
svg text{font:12px system-ui,sans-serif} .over{fill:#c00;font-weight:bold}
table{border-collapse:collapse} td,th{padding:2px 10px;text-align:right} th:first-child,td:first-child{text-align:left}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _planned_parts(plan_dir: Path, plan) -> dict[str, Mapping[str, int]]:
    """Each device's planned memory split into parts (planner.memory_defaults.memory_parts on the
    plan's cluster and graph, the plan's own total kept: the remainder goes to `other`); a device
    whose parts cannot be priced (a plan without cluster.json) has its total as one part."""
    out: dict[str, Mapping[str, int]] = {d.name: {"planned": d.memory_bytes} for d in plan.devices}
    try:
        from ir.backend import runs_as
        from ir.bundle import load_bundle_dir
        from planner.emit import load_plan_cluster
        from planner.memory_defaults import memory_parts

        cluster = load_plan_cluster(plan_dir)
        graph = load_bundle_dir(plan_dir / plan.devices[0].bundle).graph
    except Exception:  # noqa: BLE001 - an older plan: its totals are still drawn
        return out
    for d in plan.devices:
        try:
            spec = cluster.device(d.name)
            backend = next((b.backend for b in spec.profile.backends if runs_as(b.backend, d.engine, d.threads)),
                           spec.backend)
            spec = dataclasses.replace(spec, picked=backend, activations=d.activations or spec.activations)
            parts = dict(memory_parts(graph, spec, d.first_block, d.last_block, d.stage, plan.stages, plan.schedule,
                                      plan.microbatches, plan.optimizer.name, plan.update_every))
        except Exception:  # noqa: BLE001 - a device the cluster no longer prices: its total alone
            continue
        parts["other"] += d.memory_bytes - sum(parts.values())
        out[d.name] = parts
    return out


def _simulation(plan_dir: Path, steps: int):
    from jobs.planning import plan_simulation
    from planner.simulate import chrome_trace

    plan, sim = plan_simulation(plan_dir, steps)
    return sim, chrome_trace(sim, [d.name for d in plan.devices])


def report_html(plan_dir: Path, metrics: Mapping[str, Any] | None = None, steps: int = 2) -> str:
    """The page for the plan at `plan_dir` and a metrics document of a run of it (or None)."""
    from ir.bundle import load_plan

    plan_dir = Path(plan_dir)
    plan = load_plan(plan_dir)
    parts = _planned_parts(plan_dir, plan)
    measured = {}
    if metrics is not None:
        measured = {d["name"]: d.get("peak_rss_bytes") for d in metrics.get("devices", [])}
    sim, trace = _simulation(plan_dir, steps)
    body = [f"<h1>Plan {_esc(plan_dir.name)}/ of {_esc(plan.model)} over "
            f"{', '.join(_esc(d.name) for d in plan.devices)}</h1>",
            f"<div class='sub'>{_esc(plan.schedule)}, {plan.microbatches} micro-batches of {plan.batch} x {plan.seq}; "
            f"predicted step {plan.predicted_step_s:.3f} s; simulated {sim.step_s:.3f} s"
            + (f"; measured {metrics['measured_step_s']:.3f} s" if metrics and metrics.get("measured_step_s") else "")
            + "</div>",
            _memory_section(plan, parts, measured),
            _timeline_section(trace, [d.name for d in plan.devices], sim.makespan_s, metrics),
            _loss_section(metrics)]
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>Confidant report: {_esc(plan_dir.name)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_report(plan_dir: Path, output: Path, metrics_path: Path | None = None, steps: int = 2) -> Path:
    metrics = None
    if metrics_path is not None:
        from jobs.common.metrics import read_metrics

        try:
            metrics = read_metrics(metrics_path)
        except (ValueError, OSError) as exc:  # JSONDecodeError is a ValueError
            raise InputFileError(f"--metrics {metrics_path}: {exc} (give the --metrics-out document of a run of "
                                 f"this plan)") from None
    page = report_html(plan_dir, metrics, steps)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page, encoding="utf-8")
    return output


def _memory_section(plan, parts: Mapping[str, Mapping[str, int]], measured: Mapping[str, int | None]) -> str:
    width, row, left, right = 900, 34, 140, 190  # the figures' column on the right
    top = max([d.memory_budget_bytes for d in plan.devices] + [d.promised_bytes for d in plan.devices]
              + [m for m in measured.values() if m]) or 1
    scale = (width - left - right) / top
    svg = [f"<svg id='memory-chart' width='{width}' height='{row * len(plan.devices) + 30}' "
           f"xmlns='http://www.w3.org/2000/svg'>"]
    for k, d in enumerate(plan.devices):
        y = 10 + k * row
        peak = measured.get(d.name)
        svg.append(f"<g class='device-memory' data-device='{_esc(d.name)}' data-planned-bytes='{d.memory_bytes}' "
                   f"data-reserved-bytes='{d.reserved_bytes}' data-budget-bytes='{d.memory_budget_bytes}' "
                   f"data-measured-bytes='{peak if peak else ''}'>")
        svg.append(f"<text x='0' y='{y + 15}'>{_esc(d.name)}</text>")
        x = left
        shown = {p: n for p, n in parts.get(d.name, {}).items() if n > 0}
        # a negative remainder (rows of embedding tables charged below their dense copies) shortens
        # the drawn parts alike, so that the bar ends at the planned figure
        shrink = d.memory_bytes / sum(shown.values()) if shown and sum(shown.values()) > d.memory_bytes else 1.0
        for part, n in shown.items():
            w = n * scale * shrink
            svg.append(f"<rect data-part='{part}' x='{x:.1f}' y='{y}' width='{w:.1f}' height='14' "
                       f"fill='{PART_COLOURS.get(part, '#888')}'><title>{_esc(part)}: {n / MIB:.1f} MiB</title></rect>")
            x += w
        if d.reserved_bytes:  # left free by the plan for the fault policy's snapshot copies on the workers
            svg.append(f"<rect data-part='reserve' x='{x:.1f}' y='{y}' width='{d.reserved_bytes * scale:.1f}' "
                       f"height='14' fill='{PART_COLOURS['reserve']}'><title>reserve (the fault policy's snapshot "
                       f"copies on their way): {d.reserved_bytes / MIB:.1f} MiB</title></rect>")
        if peak:
            svg.append(f"<rect class='measured' x='{left}' y='{y + 16}' width='{peak * scale:.1f}' height='6' "
                       f"fill='#333'><title>measured peak {peak / MIB:.0f} MiB</title></rect>")
        bx = left + d.memory_budget_bytes * scale
        svg.append(f"<line class='budget' x1='{bx:.1f}' x2='{bx:.1f}' y1='{y - 3}' y2='{y + 25}' stroke='#c00' "
                   f"stroke-width='2'><title>budget {d.memory_budget_bytes / MIB:.0f} MiB</title></line>")
        over = peak is not None and peak > d.memory_budget_bytes
        svg.append(f"<text x='{width - right + 10}' y='{y + 15}' class='{'over' if over else ''}'>"
                   f"{d.memory_bytes / MIB:.0f}{f' + {d.reserved_bytes / MIB:.0f}' if d.reserved_bytes else ''}"
                   f"{f' / {peak / MIB:.0f}' if peak else ''} of "
                   f"{d.memory_budget_bytes / MIB:.0f} MiB</text>")
        svg.append("</g>")
    svg.append("</svg>")
    shown = sorted({p for v in parts.values() for p, n in v.items() if n > 0}
                   | ({"reserve"} if any(d.reserved_bytes for d in plan.devices) else set()),
                   key=list(PART_COLOURS).index)
    legend = "".join(f"<span><i style='background:{PART_COLOURS[p]}'></i>{_esc(p)}</span>" for p in shown)
    legend += "<span><i style='background:#333'></i>measured peak</span><span><i style='background:#c00'></i>budget</span>"
    return (f"<section id='memory'><h2>Memory per device: planned by part, measured peak, budget (MiB: planned / "
            f"measured of budget)</h2>"
            f"<div class='legend'>{legend}</div>{''.join(svg)}</section>")


def _timeline_section(trace: Mapping, devices: Sequence[str], makespan_s: float,
                      metrics: Mapping[str, Any] | None) -> str:
    width, row, left = 900, 22, 140
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    tids = sorted(names)
    scale = (width - left - 10) / max(makespan_s * 1e6, 1e-9)
    svg = [f"<svg id='timeline-chart' width='{width}' height='{row * len(tids) + 24}' xmlns='http://www.w3.org/2000/svg'>"]
    for k, tid in enumerate(tids):
        y = 4 + k * row
        label = names[tid]
        device = label.split(" (stage")[0] if tid < len(devices) else ""
        attrs = f"class='timeline-row' data-device='{_esc(device)}'" if device else "class='timeline-link'"
        svg.append(f"<g {attrs}><text x='0' y='{y + 13}'>{_esc(label)}</text>")
        for e in events:
            if e.get("ph") != "X" or e["tid"] != tid:
                continue
            kind = e["args"]["kind"]
            svg.append(f"<rect data-kind='{_esc(kind)}' x='{left + e['ts'] * scale:.2f}' y='{y}' "
                       f"width='{max(e['dur'] * scale, 0.5):.2f}' height='16' fill='{KIND_COLOURS.get(kind, '#888')}'>"
                       f"<title>{_esc(e['name'])} {e['dur'] / 1e3:.1f} ms</title></rect>")
        svg.append("</g>")
    svg.append(f"<text x='{left}' y='{row * len(tids) + 18}'>0</text><text x='{width - 60}' "
               f"y='{row * len(tids) + 18}'>{makespan_s:.3f} s</text></svg>")
    legend = "".join(f"<span><i style='background:{c}'></i>{k}</span>" for k, c in KIND_COLOURS.items()
                     if k != "SEND_GRAD")
    out = [f"<section id='timeline'><h2>Simulated steps (the plan's cost model), one row per device</h2>"
           f"<div class='legend'>{legend}</div>{''.join(svg)}"]
    steps = (metrics or {}).get("steps") or []
    if steps:
        top = max(s["seconds"] for s in steps) or 1
        bars = "".join(f"<rect data-step='{s['step']}' x='{left + i * 14}' y='{60 - 56 * s['seconds'] / top:.1f}' "
                       f"width='10' height='{56 * s['seconds'] / top:.1f}' fill='#4e79a7'><title>step {s['step']}: "
                       f"{s['seconds']:.3f} s</title></rect>" for i, s in enumerate(steps))
        out.append(f"<h2>Measured step times (s)</h2><svg id='measured-steps' width='{left + 14 * len(steps) + 80}' "
                   f"height='64' xmlns='http://www.w3.org/2000/svg'><text x='0' y='40'>max {top:.3f} s</text>"
                   f"{bars}</svg>")
    out.append("</section>")
    return "".join(out)


def _loss_section(metrics: Mapping[str, Any] | None) -> str:
    if not metrics or not metrics.get("steps"):
        return "<section id='loss'><h2>Loss</h2><p>No run: give --metrics RUN.json (a run's --metrics-out).</p></section>"
    steps = metrics["steps"]
    losses = [s["loss"] for s in steps]
    lo, hi = min(losses), max(losses)
    width, height, pad = 600, 200, 40
    span = (hi - lo) or 1.0
    n = max(len(losses) - 1, 1)
    points = " ".join(f"{pad + i * (width - 2 * pad) / n:.1f},{height - pad - (v - lo) / span * (height - 2 * pad):.1f}"
                      for i, v in enumerate(losses))
    svg = (f"<svg id='loss-chart' width='{width}' height='{height}' xmlns='http://www.w3.org/2000/svg'>"
           f"<line x1='{pad}' y1='{height - pad}' x2='{width - pad}' y2='{height - pad}' stroke='#999'/>"
           f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{height - pad}' stroke='#999'/>"
           f"<polyline id='loss-curve' data-points='{len(losses)}' fill='none' stroke='#e15759' stroke-width='2' "
           f"points='{points}'/>"
           f"<text x='2' y='{pad + 4}'>{hi:.3g}</text><text x='2' y='{height - pad}'>{lo:.3g}</text>"
           f"<text x='{pad}' y='{height - pad + 16}'>step {steps[0]['step']}</text>"
           f"<text x='{width - pad - 40}' y='{height - pad + 16}'>step {steps[-1]['step']}</text></svg>")
    ev = metrics.get("eval")
    metric = "<p id='metric'>No evaluation in this run (give --eval).</p>"
    if ev:
        before = "" if ev.get("before") is None else f"{ev['before']:.4f} before, "
        extra = "" if ev.get("perplexity") is None else f"; perplexity {ev['perplexity']:.3f}"
        metric = (f"<p id='metric' data-metric='{_esc(ev['metric'])}' data-after='{ev['after']}'>"
                  f"{_esc(ev['metric'])}: {before}{ev['after']:.4f} after{extra}</p>")
    events = [e for e in metrics.get("events", []) if e.get("event") == "memory_over"]
    warn = "".join(f"<p class='over'>{_esc(e['device'])} used {e['peak_rss_bytes'] / MIB:.0f} MiB, over its "
                   f"{'budget' if e['over'] == 'budget' else 'planned figure'}</p>" for e in events)
    return f"<section id='loss'><h2>Loss per step</h2>{svg}{metric}{warn}</section>"


def report_summary(path: Path) -> str:
    """One line for the command to print."""
    return f"wrote {path} (self-contained; open it in any browser)"

