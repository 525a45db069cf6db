"""What the demo prints: which lateness is which, and the same figures in words."""

from __future__ import annotations

import io
import re

from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import hopsched
from hopsched.cli.demo import DemoReport, run_demo
from hopsched.relay.stats import LatenessStats


def rows(text: str) -> dict[str, str]:
    return {
        cells[1].strip(): cells[2].strip()
        for line in text.splitlines()
        if len(cells := line.split("|")) == 4
    }


def stats(values_us: list[int]) -> LatenessStats:
    lateness = LatenessStats()
    for value in values_us:
        lateness.record(value)
    return lateness


lateness_us = st.lists(st.integers(-1_000_000, 100_000_000), max_size=50)


@hypothesis_settings(deadline=None, max_examples=60)  # an HdrHistogram is slow to make
@given(
    scheduled=st.integers(0, 1000),
    missing=st.integers(0, 1000),
    duplicates=st.integers(0, 5),
    consumer=lateness_us,
    relay=lateness_us,
)
def test_the_table_names_where_each_lateness_is_measured_and_the_words_repeat_its_figures(
    scheduled: int, missing: int, duplicates: int, consumer: list[int], relay: list[int]
) -> None:
    delivered = max(0, scheduled - missing)
    at_consumer, at_relay = stats(consumer), stats(relay)
    report = DemoReport(
        scheduled=scheduled,
        delivered=delivered,
        duplicates=duplicates,
        lateness=at_consumer,
        relay_lateness=at_relay,
        target="q",
    )

    text = report.table()
    table = rows(text)
    words = " ".join(text.split("\n\n", 1)[1].split())

    assert (table["scheduled"], table["delivered"], table["lost"]) == (
        str(scheduled),
        str(delivered),
        str(scheduled - delivered),
    )
    assert table["early"] == str(sum(value < 0 for value in consumer))
    for where, measured in (
        ("at the consumer", at_consumer),
        ("relay's publish confirmed", at_relay),
    ):
        p50 = table[f"lateness p50 (ms), {where}"]
        if measured.count:
            assert p50 == f"{measured.percentile_ms(50):.2f}"
        else:
            assert p50 == "n/a"
    assert words.startswith(f"{delivered} of the {scheduled} messages scheduled were delivered")
    assert "when the broker's confirm of the relay's final publish reached the relay" in words
    if consumer:
        assert f"half within {at_consumer.percentile_ms(50):.1f} ms" in words
        assert f"all within {at_consumer.max_ms:.1f} ms" in words
    if relay:
        assert f"(over the whole demo: half within {at_relay.percentile_ms(50):.1f} ms" in words
    assert ("none lost" in words) == (delivered == scheduled)
    assert ("de-duplicate on x-hopsched-id" in words) == (duplicates > 0)
    assert all(len(line) <= 88 for line in text.split("\n\n", 1)[1].splitlines())


async def test_the_demo_reports_both_latenesses_of_the_same_messages(
    settings: hopsched.Settings,
) -> None:
    out = io.StringIO()
    report = await run_demo(settings, count=20, max_delay_s=1.0, seed=7, out=out)

    assert (report.scheduled, report.delivered, report.early, report.lost) == (20, 20, 0, 0)
    assert report.target == f"{settings.prefix}-demo-target"
    # The relay measured the same deliveries (none reached it a second past due here).
    assert 0 < report.relay_lateness.count <= 20
    assert report.relay_lateness.early == 0
    text = report.table()
    assert re.search(r"20 of the 20 messages scheduled were delivered\s+to queue", text)
    assert "removed the demo's ladder" in out.getvalue()
