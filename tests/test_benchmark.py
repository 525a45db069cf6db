"""The accuracy benchmark runs at a tiny size against the real broker, so it cannot rot.

No timing is asserted: only that it runs, measures every message once, never early,
and writes the JSON fields and plots that ``benchmarks/README.md`` documents.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy.py"
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


def test_tiny_quick_run_writes_json_table_and_plots(broker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    plots = tmp_path / "plots"
    command = [
        sys.executable, str(SCRIPT),
        "--count", "20", "--rate", "50", "--delays", "loguniform:10ms:1s",
        "--strategies", "hopsched-quorum,per-message-ttl,delayed-exchange",
        "--url", broker_url, "--json", str(out), "--plot", str(plots),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
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
    # Available or not, the plugin strategy is reported, never an error.
    assert "delayed-exchange" in strategies
    assert "| hopsched-quorum |" in result.stdout
    for name in ("lateness_cdf.png", "lateness_vs_delay.png", "hops_vs_delay.png"):
        assert (plots / name).stat().st_size > 0
