"""The accuracy benchmark runs at a tiny size against the real broker, so it cannot rot.

No timing is asserted: only that it runs, measures every message once, never early,
and writes the JSON fields and plots that ``benchmarks/README.md`` documents.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.private_nodes import (
    PROBE_PLUGIN,
    PROBE_PLUGIN_VERSION,
    require_rabbitmq,
    write_probe_plugin,
)

from hopsched.core.envelope import HEADER_DUE, HEADER_HOPS, HEADER_ID

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "accuracy.py"
#: A tiny run takes seconds; one beside other work at load 12 took over 120 s. Below
#: pytest's timeout (300 s), so a hung run fails here, with its output.
RUN_TIMEOUT_S = 270


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    """``command`` in a session of its own: a run over ``RUN_TIMEOUT_S`` is killed with
    every process it started (its relay), not alone, and fails the test."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for signum, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    out, err = process.communicate(timeout=wait_s)
                    break
            pytest.fail(
                f"{shlex.join(command)} ran over {RUN_TIMEOUT_S} s; it printed:\n{out}{err}"
            )
    return subprocess.CompletedProcess(command, process.returncode, out, err)


FIELDS = (
    "scheduled",
    "delivered",
    "lost",
    "early",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p999_ms",
    "max_ms",
    "mean_hops",
    "max_hops",
    "broker_publishes_per_msg",
    "sustained_schedule_rate_per_s",
    "process_cpu_s",
    "process_peak_rss_mb",
)
#: What every hopsched row adds: CPU per relayed message and per schedule.
HOPSCHED_FIELDS = (
    "relayed_msgs",
    "relay_cpu_us_per_relayed_msg",
    "scheduler_cpu_s",
    "scheduler_cpu_us_per_msg",
)


def _bench(name: str) -> ModuleType:
    """A ``benchmarks/bench_*`` module (they import each other by bare name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_consumer_lines_carry_what_the_collector_records() -> None:
    consumer, measure = _bench("bench_consumer"), _bench("bench_measure")
    collector = measure.Collector({"a", "b\tc"}, awaited=2)
    messages = [
        {HEADER_ID: "a", HEADER_DUE: 1_000, HEADER_HOPS: 3},
        {measure.BENCH_ID: "b\tc", measure.BENCH_DUE: 2_000, "x-death": [{"count": 2}]},
        {HEADER_ID: "a", HEADER_DUE: 1_000, HEADER_HOPS: 3},  # duplicate
        {measure.BENCH_ID: "zz", measure.BENCH_DUE: 5},  # unknown id
        {},  # no id, no due time
        {HEADER_ID: "a\nb", HEADER_DUE: 1},  # would break the line
    ]
    lines = [
        consumer.format_line(measure.delivery_fields(headers), 10_000 + i)
        for i, headers in enumerate(messages)
    ]
    assert lines[4] == lines[5] == consumer.STRAY
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)
    for line in lines:
        fields = consumer.parse_line(line)
        if fields is None:
            collector.strays += 1
        else:
            collector.add(*fields)
    assert collector.deliveries == {
        "a": measure.Delivery(10_000, 1_000, 3),
        "b\tc": measure.Delivery(10_001, 2_000, 2),
    }
    assert (collector.duplicates, collector.strays) == (1, 3)
    assert collector.done.is_set()
    # record (headers in) counts the same way
    direct = measure.Collector({"a", "b\tc"}, awaited=2)
    for i, headers in enumerate(messages):
        direct.record(headers, 10_000 + i)
    assert direct.deliveries == collector.deliveries
    assert (direct.duplicates, direct.strays) == (1, 3)


def test_tiny_quick_run_writes_json_table_and_plots(broker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    plots = tmp_path / "plots"
    command = [
        sys.executable, str(SCRIPT),
        "--count", "20", "--rate", "50", "--delays", "loguniform:10ms:1s",
        "--strategies", "hopsched-quorum,per-message-ttl,delayed-exchange",
        "--url", broker_url, "--json", str(out), "--plot", str(plots),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["broker"]["version"]
    assert report["machine"]["cpu_count"] >= 1
    assert report["workload"]["count"] == 20
    strategies = report["strategies"]
    for name in ("hopsched-quorum", "per-message-ttl"):
        row = strategies[name]
        missing = [field for field in FIELDS if field not in row]
        assert not missing, f"{name} lacks {missing}"
        assert row["scheduled"] == 20
        assert row["delivered"] == row["scheduled"]
        assert row["lost"] == 0
        assert row["early"] == 0
    assert strategies["hopsched-quorum"]["process_peak_rss_mb"] > 0
    for field in HOPSCHED_FIELDS:
        assert strategies["hopsched-quorum"][field] > 0, field
        assert field not in strategies["per-message-ttl"], field
    assert report["hopsched"]["has_schedule_many"] is True
    decades = strategies["hopsched-quorum"]["hops_by_decade"]
    assert sum(row["n"] for row in decades) == 20
    assert "hops_by_decade" not in strategies["per-message-ttl"]
    assert "| hopsched-quorum | [" in result.stdout  # the hops per delay decade table
    # Available or not, the plugin strategy is reported, never an error.
    assert "delayed-exchange" in strategies
    assert "| hopsched-quorum |" in result.stdout
    for name in ("lateness_cdf.png", "lateness_vs_delay.png", "hops_vs_delay.png"):
        assert (plots / name).stat().st_size > 0


def test_tiny_ingress_run_measures_lateness_relay_cpu_and_publish_throughput(
    broker_url: str, tmp_path: Path
) -> None:
    """The ``hopsched-ingress`` row: producers publish with ``x-delay`` to an ingress
    exchange, the relay delivers through the due exchange to the target queue; every
    message once, never early, with the relay's CPU per message; and the
    publish-throughput phase with several producers, the relay waited for until it has
    taken them all. No plugin needed; the plugin's row is reported, available or not."""
    out = tmp_path / "out.json"
    command = [
        sys.executable, str(SCRIPT),
        "--count", "20", "--rate", "50", "--delays", "loguniform:10ms:2s",
        "--strategies", "hopsched-ingress,delayed-exchange",
        "--publish-throughput", "60", "--producers", "3", "--producer-in-flight", "5",
        "--url", broker_url, "--json", str(out),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    strategies = json.loads(out.read_text())["strategies"]
    row = strategies["hopsched-ingress"]
    missing = [field for field in (*FIELDS, *HOPSCHED_FIELDS) if field not in row]
    assert not missing, f"hopsched-ingress lacks {missing}"
    assert (row["scheduled"], row["delivered"], row["lost"], row["early"]) == (20, 20, 0, 0)
    assert (row["duplicates"], row["strays"]) == (0, 0)
    assert row["relayed_msgs"] >= 20  # each message is taken from the ingress queue
    assert row["relay_cpu_us_per_delivered_msg"] > 0
    assert "cleanup_problems" not in row
    published = row["publish_throughput"]
    assert published["producers"] == 3
    assert (published["confirmed"], published["failures"]) == (60, 0)
    assert published["ingested"] == 60  # all taken by the relay into the step queues
    assert published["confirmed_per_s"] > 0
    assert published["ingested_per_s"] > 0
    assert "delayed-exchange" in strategies  # available or not
    assert "| hopsched-ingress | 60 | 0 |" in result.stdout  # the throughput table


def test_tiny_burst_run_reports_first_and_last_delivery(broker_url: str, tmp_path: Path) -> None:
    """Two small bursts through hopsched and the broker floor, measuring a copy of this
    repository's hopsched through --hopsched-path as an earlier checkout would be."""
    checkout = tmp_path / "checkout"
    shutil.copytree(
        BENCHMARKS.parent / "hopsched",
        checkout / "hopsched",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    out = tmp_path / "out.json"
    command = [
        sys.executable, str(SCRIPT), "--scenario", "burst",
        "--burst-counts", "100,200", "--burst-lead", "1s",
        "--strategies", "hopsched-quorum,delayed-exchange,broker-floor",
        "--hopsched-path", str(checkout), "--url", broker_url, "--json", str(out),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["hopsched"]["path"] == str(checkout.resolve())
    assert "--hopsched-path" in report["command"]
    assert report["burst"]["counts"] == [100, 200]
    strategies = report["strategies"]
    assert "delayed-exchange, 100 at once" in strategies  # available or not, reported
    for count in (100, 200):
        for name in ("hopsched-quorum", "broker-floor"):
            row = strategies[f"{name}, {count} at once"]
            assert (row["scheduled"], row["delivered"]) == (count, count)
            assert row["lost"] == row["early"] == row["duplicates"] == 0
            assert 0 <= row["min_ms"] <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        hopsched_row = strategies[f"hopsched-quorum, {count} at once"]
        assert hopsched_row["scheduled_with"].startswith("schedule_many")
        assert hopsched_row["scheduled_ahead_of_due_s"] > 0
        assert hopsched_row["relayed_msgs"] > 0
        for field in HOPSCHED_FIELDS:
            # CPU time comes in clock ticks (10 ms): a burst of 100 may cost less than one
            assert hopsched_row[field] >= 0, field
    assert "| hopsched-quorum, 200 at once | 200 | 200 | 0 | 0 | 0 |" in result.stdout


def test_throughput_summary_shows_both_relay_phases_and_the_ratios() -> None:
    report = _bench("bench_report")
    relay = {
        "hops_per_s": 600.0,
        "relay_cpu_s": 15.0,
        "relay_cpu_us_per_hop": 700.0,
        "relay_peak_rss_mb": 40.0,
    }
    text = report.throughput_summary(
        {
            "raw_loop": {"messages": 20_000, "msgs_per_s": 800.0},
            "relay": relay,
            "relay_x2": {**relay, "hops_per_s": 900.0, "relay_cpu_s": 24.0},
            "scheduler": {
                "schedule": {
                    "how": "schedule(), 500 in flight",
                    "available": True,
                    "msgs_per_s": 4000.0,
                    "cpu_s": 4.0,
                    "cpu_us_per_msg": 200.0,
                },
                "schedule_many": {
                    "how": "schedule_many, batches of 1,000",
                    "available": False,
                    "reason": "not in this hopsched",
                },
            },
            "relay_to_raw_ratio": 0.75,
            "scale_out_ratio": 1.5,
            "cpu_count": 2,
            "max_rate_p99_within_10ms": None,
        }
    )
    assert "| relay, 1 process | 600 | 15.00 | 700 | 40.0 |" in text
    assert "| relay, 2 processes | 900 | 24.00 | 700 | 40.0 |" in text
    assert "| schedule(), 500 in flight | 4,000 | 4.00 | 200 | - |" in text
    assert "| schedule_many, batches of 1,000 | not in this hopsched | - | - | - |" in text
    assert "2 relays / 1: 1.50 on 2 CPUs" in text


def test_hops_by_decade_bounds_and_table() -> None:
    measure, report = _bench("bench_measure"), _bench("bench_report")
    # at or below the window: 2; just above: ceil(log2 1.000001) + 2; ceil(log2 10) + 2
    bounds = {0: 2, 1_000_000: 2, 1_000_001: 3, 2_000_000: 3, 10_000_000: 6}
    assert {d: measure.hop_bound(d, 1000) for d in bounds} == bounds
    assert measure.hop_bound(1000, 0) == 2  # a zero window counts as 1 ms

    def point(delay_us: int, hops: int) -> tuple[int, object]:
        return delay_us, measure.Delivery(received_us=delay_us, due_us=delay_us, hops=hops)

    points = [
        point(5_000, 0),  # below 10 ms
        point(20_000, 0),
        point(50_000, 3),  # over its own bound of 2
        point(1_000_000, 3),  # exactly the window: own bound 2, so over
        point(1_500_000, 2),  # own bound ceil(log2 1.5) + 2 = 3
        point(2_000_000, 3),  # own bound 3
        point(86_400_000_000, 20),  # own bound ceil(log2 86,400) + 2 = 19
    ]
    rows = measure.hops_by_decade(points, 1000)
    assert rows == [
        {"decade": "[0 ms, 10 ms)", "n": 1, "mean_hops": 0.0, "max_hops": 0, "bound": 2,
         "over_bound": 0},
        {"decade": "[10 ms, 100 ms)", "n": 2, "mean_hops": 1.5, "max_hops": 3, "bound": 2,
         "over_bound": 1},
        {"decade": "[1 s, 10 s)", "n": 3, "mean_hops": 2.67, "max_hops": 3, "bound": 6,
         "over_bound": 1},
        {"decade": "[10000 s, 100000 s)", "n": 1, "mean_hops": 20.0, "max_hops": 20,
         "bound": 19, "over_bound": 1},
    ]  # fmt: skip
    table = report.decade_table(
        {
            "hopsched-quorum": {"hold_window_ms": 1000, "hops_by_decade": rows},
            "per-message-ttl": {"mean_hops": 1.0},  # not a ladder: left out
        }
    )
    assert "| hopsched-quorum | [1 s, 10 s) | 3 | 2.67 | 3 | 6 | 1 |" in table
    assert "per-message-ttl" not in table
    assert report.decade_table({"per-message-ttl": {"mean_hops": 1.0}}) == ""


@pytest.mark.slow
def test_a_burst_on_a_private_node_with_a_plugin_from_another_directory(tmp_path: Path) -> None:
    """--rabbitmq runs the burst scenario on a private node; --plugins-dir and
    --enable-plugin give it a plugin from a directory of its own, which the JSON lists
    with the plugins the node ran. The installation is the private-node tests' own."""
    installation = require_rabbitmq()
    chosen = "machine" if installation.chroot is None else str(installation.chroot)
    plugins_dir = tmp_path / "plugins"
    write_probe_plugin(plugins_dir)
    out = tmp_path / "out.json"
    command = [
        sys.executable, str(SCRIPT), "--scenario", "burst", "--rabbitmq", chosen,
        "--plugins-dir", str(plugins_dir), "--enable-plugin", PROBE_PLUGIN,
        "--burst-counts", "50", "--burst-lead", "1s",
        "--strategies", "delayed-exchange,broker-floor", "--json", str(out),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    [broker] = report["brokers"].values()
    assert broker["version"] == installation.version
    assert broker["plugins"][PROBE_PLUGIN] == PROBE_PLUGIN_VERSION
    assert report["broker"]["url"] is None
    row = report["strategies"]["broker-floor, 50 at once"]
    assert (row["scheduled"], row["delivered"], row["lost"], row["early"]) == (50, 50, 0, 0)
    assert "delayed-exchange, 50 at once" in report["strategies"]  # available or not


def test_ladder_option_parses_labels_and_refuses_a_bad_ladder() -> None:
    ladder = _bench("bench_ladder")
    assert ladder.parse_ladder("default") == {}
    fields = ladder.parse_ladder("step_ratio=4, min_step_ms=1024, max_step_ms=2**30")
    assert fields == {"step_ratio": 4, "min_step_ms": 1024, "max_step_ms": 2**30}
    assert ladder.ladder_name(fields) == "ratio4-min1024-max1073741824"
    assert ladder.parse_label(ladder.ladder_name(fields)) == fields
    assert ladder.ladder_environment({"step_ratio": 4}) == {"HOPSCHED_STEP_RATIO": "4"}
    with pytest.raises(ValueError, match="powers of four"):
        ladder.parse_ladder("step_ratio=4,min_step_ms=32")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        ladder.parse_ladder("hold_window_ms=10")


def test_a_tiny_run_per_ladder_gives_the_relay_and_the_scheduler_that_ladder(
    broker_url: str, tmp_path: Path
) -> None:
    """A ratio-4 row whose relay ran the default ladder would be refused at its start
    (``LadderMismatchError``): the row delivering everything shows both had ratio 4."""
    out = tmp_path / "out.json"
    command = [
        sys.executable, str(SCRIPT),
        "--count", "20", "--rate", "50", "--delays", "loguniform:10ms:6s",
        "--strategies", "hopsched-quorum", "--ladder", "default", "--ladder", "step_ratio=4",
        "--url", broker_url, "--json", str(out),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    strategies = json.loads(out.read_text())["strategies"]
    assert set(strategies) == {"hopsched-quorum", "hopsched-quorum/ratio4"}
    for name, row in strategies.items():
        assert (row["delivered"], row["lost"], row["early"]) == (20, 0, 0), name
    assert strategies["hopsched-quorum/ratio4"]["ladder"].startswith("step_ratio=4,")
    assert strategies["hopsched-quorum"]["ladder"].startswith("step_ratio=2,")


def test_a_tiny_client_floor_run_measures_every_row_and_leaves_nothing(
    broker_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "floor.json"
    command = [
        sys.executable, "-P", str(BENCHMARKS / "client_floor.py"), "--url", broker_url,
        "--count", "30", "--rate", "100", "--rounds", "1", "--json", str(out),
    ]  # fmt: skip
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    relay_rows = ("ack", "publish-ack", "hold", "relay")
    for row in ("publish", "publish2", *relay_rows):
        (figures,) = report["runs"][row]
        assert figures["cpu_us_per_message"] >= 0, row  # CPU time is read in ticks
        assert 0 <= figures["system_share"] <= 1, row
        assert f"| {report['rows'][row]} |" in result.stdout
    assert len(report["runs"]["schedule"]) == len(relay_rows)  # it feeds each relay row
