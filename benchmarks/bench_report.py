"""Output: the markdown table and the PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_measure import Delivery

__all__ = [
    "burst_table",
    "decade_table",
    "ingest_lag_table",
    "markdown_table",
    "plot",
    "publish_throughput_table",
    "throughput_summary",
]

_COLUMNS = [
    ("strategy", "strategy"),
    ("scheduled", "sched"),
    ("delivered", "deliv"),
    ("lost", "lost"),
    ("pending", "pending"),
    ("overdue", "overdue"),
    ("duplicates", "dup"),
    ("early", "early"),
    ("p50_ms", "p50 ms"),
    ("p90_ms", "p90 ms"),
    ("p99_ms", "p99 ms"),
    ("p999_ms", "p99.9 ms"),
    ("max_ms", "max ms"),
    ("after_schedule_p99_ms", "p99 ms, due after publishing"),
    ("mean_hops", "hops mean"),
    ("max_hops", "hops max"),
    ("broker_publishes_per_msg", "broker pub/msg"),
    ("sustained_schedule_rate_per_s", "sched/s"),
    ("process_cpu_s", "proc CPU s"),
    ("relay_cpu_us_per_relayed_msg", "relay CPU µs/msg"),
    ("relay_cpu_us_per_delivered_msg", "relay CPU µs/delivered"),
    ("scheduler_cpu_us_per_msg", "sched CPU µs/msg"),
    ("broker_cpu_us_per_msg", "broker CPU µs/msg"),
    ("total_cpu_us_per_msg", "total CPU µs/msg"),
    ("process_peak_rss_mb", "proc peak RSS MB"),
    ("bench_loop_lag_p99_ms", "bench lag p99 ms"),
]
_BURST_COLUMNS = [
    ("strategy", "strategy"),
    ("scheduled", "sched"),
    ("delivered", "deliv"),
    ("lost", "lost"),
    ("early", "early"),
    ("duplicates", "dup"),
    ("min_ms", "first ms"),
    ("p50_ms", "p50 ms"),
    ("p99_ms", "p99 ms"),
    ("max_ms", "last (max) ms"),
    ("first_to_last_delivery_s", "first → last s"),
    ("mean_hops", "hops mean"),
    ("schedule_s", "scheduling s"),
    ("relay_cpu_us_per_relayed_msg", "relay CPU µs/msg"),
    ("scheduler_cpu_us_per_msg", "sched CPU µs/msg"),
    ("broker_cpu_us_per_msg", "broker CPU µs/msg"),
    ("total_cpu_us_per_msg", "total CPU µs/msg"),
    ("process_peak_rss_mb", "proc peak RSS MB"),
]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(
    strategies: dict[str, dict[str, Any]], columns: list[tuple[str, str]] = _COLUMNS
) -> str:
    """One row per strategy; an unavailable one says why."""
    lines = [
        "| " + " | ".join(title for _, title in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for name, row in strategies.items():
        if not row.get("available", True):
            reason = str(row.get("reason", "not available")).split(" (")[0]  # JSON has it all
            rest = ["-"] * (len(columns) - 2)
            lines.append(f"| {name} | {reason} | " + " | ".join(rest) + " |")
            continue
        cells = [name] + [_cell(row.get(key)) for key, _ in columns[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def burst_table(strategies: dict[str, dict[str, Any]]) -> str:
    """The burst scenario's rows: lateness of the first and last delivery among messages
    all due at one instant, and how each strategy scheduled them."""
    hows = sorted({f"{name.split(',')[0]}: {row['scheduled_with']}"
                   for name, row in strategies.items() if row.get("scheduled_with")})  # fmt: skip
    table = markdown_table(strategies, _BURST_COLUMNS)
    return table + ("\n\nscheduled with: " + "; ".join(hows) if hows else "")


def decade_table(strategies: dict[str, dict[str, Any]]) -> str:
    """Hops per decade of requested delay, one row per hopsched strategy and decade with
    deliveries; "" when no strategy has them (only hopsched's runs do)."""
    rows = [(name, row) for name, row in strategies.items() if row.get("hops_by_decade")]
    if not rows:
        return ""
    windows = sorted({row["hold_window_ms"] for _, row in rows})
    lines = [
        f"hops per delay decade (hold window {' / '.join(map(str, windows))} ms; bound = "
        "⌈log2(decade's upper end / hold window)⌉ + 2, at least 2; over bound = messages "
        "with more hops than ⌈log2(own delay / hold window)⌉ + 2, at least 2)",
        "",
        "| strategy | decade | n | mean hops | max hops | bound | over bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        for d in row["hops_by_decade"]:
            lines.append(
                f"| {name} | {d['decade']} | {d['n']} | {d['mean_hops']:.2f} | "
                f"{d['max_hops']} | {d['bound']} | {d['over_bound']} |"
            )
    return "\n".join(lines)


def throughput_summary(throughput: dict[str, Any]) -> str:
    """The throughput scenario's bulk phases: the raw aio-pika loop, one relay process and
    two (scale-out), with the ratios and the machine's CPU count."""
    raw, one, two = throughput["raw_loop"], throughput["relay"], throughput["relay_x2"]
    best = throughput.get("max_rate_p99_within_10ms")
    lines = [
        f"| bulk phase ({raw['messages']:,} messages) | msgs or hops/s | CPU s "
        "| CPU µs/msg | peak RSS MB (per process) |",
        "|---|---|---|---|---|",
        f"| raw aio-pika loop | {raw['msgs_per_s']:,.0f} | - | - | - |",
    ]
    for row, what in ((one, "relay, 1 process"), (two, "relay, 2 processes")):
        lines.append(
            f"| {what} | {row['hops_per_s']:,.0f} | {row['relay_cpu_s']:.2f} | "
            f"{row['relay_cpu_us_per_hop']:.0f} | {row['relay_peak_rss_mb']:.1f} |"
        )
    for row in throughput["scheduler"].values():
        if not row["available"]:
            lines.append(f"| {row['how']} | {row['reason']} | - | - | - |")
            continue
        lines.append(
            f"| {row['how']} | {row['msgs_per_s']:,.0f} | {row['cpu_s']:.2f} | "
            f"{row['cpu_us_per_msg']:.0f} | - |"
        )
    lines += [
        "",
        f"relay (1 process) / raw loop: {throughput['relay_to_raw_ratio']:.2f} · scale-out, "
        f"2 relays / 1: {throughput['scale_out_ratio']:.2f} on {throughput['cpu_count']} CPUs · "
        f"highest schedule rate with p99 ≤ 10 ms: {f'{best}/s' if best else 'none'}",
    ]
    return "\n".join(lines)


_FLOOR_MS = 0.01  # lateness at or below this is drawn at it on the log axes


def plot(points: dict[str, list[tuple[int, Delivery]]], directory: Path, title: str) -> list[Path]:
    """Lateness CDF per strategy (log x), lateness and hops against requested delay."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(figsize=(8, 5))
    for name, rows in points.items():
        values = sorted(max(d.lateness_us / 1000, _FLOOR_MS) for _, d in rows)
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.step(values, fractions, where="post", label=f"{name} (n={len(values)})")
    axes.set_xscale("log")
    axes.set_xlabel(f"lateness at the consumer, ms (log; ≤ {_FLOOR_MS} ms drawn at {_FLOOR_MS})")
    axes.set_ylabel("fraction of delivered messages")
    axes.set_title(f"Lateness CDF\n{title}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    written.append(_save(figure, directory / "lateness_cdf.png"))

    written.append(
        _scatter(
            points,
            lambda d: max(d.lateness_us / 1000, _FLOOR_MS),
            "lateness, ms (log)",
            f"Lateness against requested delay\n{title}",
            directory / "lateness_vs_delay.png",
            log_y=True,
        )
    )
    written.append(
        _scatter(
            points,
            lambda d: d.hops,
            "hops (passes through a TTL queue)",
            f"Hops against requested delay\n{title}",
            directory / "hops_vs_delay.png",
            log_y=False,
        )
    )
    return written


def _scatter(
    points: dict[str, list[tuple[int, Delivery]]],
    y: Callable[[Delivery], float],
    ylabel: str,
    title: str,
    path: Path,
    *,
    log_y: bool,
) -> Path:
    """One dot per delivered message: requested delay (log x) against ``y``."""
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, rows in points.items():
        xs = [max(delay / 1000, _FLOOR_MS) for delay, _ in rows]
        axes.scatter(xs, [y(d) for _, d in rows], s=4, alpha=0.5, label=name)
    axes.set_xscale("log")
    if log_y:
        axes.set_yscale("log")
    axes.set_xlabel("requested delay, ms (log)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", markerscale=3)
    return _save(figure, path)


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def publish_throughput_table(strategies: dict[str, dict[str, Any]]) -> str:
    """The publish-throughput phase (``--publish-throughput``): one row per strategy
    measured there; empty when none was."""
    rows = [
        (name, row["publish_throughput"])
        for name, row in strategies.items()
        if row.get("publish_throughput")
    ]
    if not rows:
        return ""
    first = rows[0][1]
    lines = [
        f"confirmed publish throughput: {first['messages']:,} messages due in "
        f"{first['delay_s']:g} s, {first['producers']} producers (own connection each), "
        f"{first['in_flight_per_producer']} in flight each",
        "",
        "| strategy | confirmed | failures | confirmed msgs/s | taken by the relay, msgs/s "
        "| process CPU µs/msg |",
        "|---|---|---|---|---|---|",
    ]
    for name, got in rows:
        cells = (
            got["confirmed"],
            got["failures"],
            got["confirmed_per_s"],
            got["ingested_per_s"],
            got["process_cpu_us_per_msg"],
        )
        lines.append(f"| {name} | " + " | ".join(_cell(value) for value in cells) + " |")
    return "\n".join(lines)


def ingest_lag_table(strategies: dict[str, dict[str, Any]]) -> str:
    """The ingress rows' ingest lag and lateness from the relay's own due time
    (``bench_run.ingest_lag``); empty when no row has them."""
    rows = [(name, row) for name, row in strategies.items() if "ingest_lag_p50_ms" in row]
    if not rows:
        return ""
    keys = [
        f"{name}_{key}_ms"
        for name in ("ingest_lag", "lateness_from_relay_due")
        for key in ("p50", "p90", "p99", "max")
    ]
    lines = [
        "ingest lag (publish -> the relay takes it from the ingress queue) and lateness from "
        "the relay's own due time (taken + x-delay), ms",
        "",
        "| strategy | lag p50 | lag p90 | lag p99 | lag max "
        "| from relay due p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        lines.append(f"| {name} | " + " | ".join(_cell(row[key]) for key in keys) + " |")
    return "\n".join(lines)
