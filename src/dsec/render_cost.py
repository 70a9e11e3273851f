"""The cost listing (``dsec cost``): device-hours per pool and phase from a ``GET /v1/cost`` answer, and the lines
under it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.table import Table
from rich.text import Text

from dsec.render_table import Record, _Col, _mib, _table


def _amount(v: float) -> str:
    """Hours and prices: whole above 100, three significant digits below (a minute of one device is 0.0167)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _hours(key: str) -> Callable[[Record], str]:
    return lambda r: _amount(r["device_hours"][key])


def _share(key: str) -> Callable[[Record], str]:
    def cell(r: Record) -> str:
        total = r["device_hours"]["total"]
        return f"{100 * r['device_hours'][key] / total:.0f}%" if total > 0 else "-"

    return cell


_COST_COLUMNS = (
    _Col("pool", lambda r: Text(r["pool"]), ident=True),
    _Col("group", lambda r: Text(r.get("group") or "*"), ident=True, default=False),
    _Col("workers", lambda r: str(r["workers"]), "right", drop=1),
    _Col("device-h", _hours("total"), "right"),
    _Col("useful", _share("useful"), "right"),
    _Col("degraded", _share("degraded"), "right"),
    _Col("recovering", _share("recovering"), "right"),
    _Col("idle", _share("idle"), "right"),
    _Col("useful h", _hours("useful"), "right", default=False),
    _Col("degraded h", _hours("degraded"), "right", default=False),
    _Col("recovering h", _hours("recovering"), "right", default=False),
    _Col("idle h", _hours("idle"), "right", default=False),
    _Col("cost", lambda r: _amount(r["cost"]["total"]), "right"),
    _Col("snap MiB", lambda r: _mib((r.get("implicit") or {}).get("snapshots", {}).get("bytes")), "right", drop=3),
)


def cost_rows(report: Mapping[str, Any], *, groups: bool = False) -> list[dict[str, Any]]:
    """The table's rows of a ``GET /v1/cost`` answer: one per pool (``group`` None), each followed by its groups'
    when ``groups``."""
    rows: list[dict[str, Any]] = []
    for p in report["pools"]:
        rows.append({**p, "group": None})
        if groups:
            for name, g in p["groups"].items():
                rows.append({"pool": p["pool"], "group": name, **g})
    return rows


def cost_table(report: Mapping[str, Any], *, wide: bool = False, width: int | None = None) -> Table:
    """Device-hours per pool over the report's window, the share of each phase and the price (``wide``: each
    group's row too and the hours of each phase)."""
    span = (report["until"] - report["since"]) / 3600
    title = f"cost over {span:.2f} h at {report['price_per_device_hour']:g} per device-hour"
    return _table(title, _COST_COLUMNS, cost_rows(report, groups=wide), wide, width)


def cost_summary(report: Mapping[str, Any]) -> list[str]:
    """The lines under the cost table: totals, DSec's own overhead, the opportunity cost, what is estimated."""
    h, cost = report["device_hours"], report["cost"]
    lines = [
        f"total: {_amount(h['total'])} device-h (useful {_amount(h['useful'])}, degraded {_amount(h['degraded'])}, "
        f"recovering {_amount(h['recovering'])}, idle {_amount(h['idle'])}); cost {_amount(cost['total'])}"
    ]
    proc = report["implicit"]["process"]
    if proc:
        lines.append(
            f"control plane: {proc['cpu_s']:.1f} CPU s over {proc['uptime_s'] / 3600:.2f} h up, "
            f"RSS {_mib(proc['rss_bytes'])} MiB; probe overhead per step: not reported"
        )
    for p in report["pools"]:
        opp = p["opportunity"]
        rec = opp["recoveries"]
        parts = []
        if opp["degraded_steps"] is not None:
            parts.append(f"~{opp['degraded_steps']:.0f} steps degraded (estimate)")
        for t in opp["throughput"]:
            d = t["degraded_minus_useful"]
            if d["mean"] is not None:
                ci = f" [{d['ci95'][0]:.3g}, {d['ci95'][1]:.3g}]" if d["ci95"] else ""
                parts.append(f"{t['worker']} degraded-useful {d['mean']:+.3g} steps/s{ci} (n={d['n']})")
        if rec.get("saved_device_hours_estimate") is not None:
            parts.append(f"heals saved ~{rec['saved_device_hours_estimate']:.3f} device-h vs restarts (estimate)")
        if parts:
            lines.append(f"{p['pool']}: " + "; ".join(parts))
    lines += [f"estimated: {e}" for e in report["estimated"]]
    return lines
