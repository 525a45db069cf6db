"""``hopsched cancel``'s word on a cancel's timing: in time from ``CANCEL_LEAD_S`` before
the due time on (as ``Cancelled.in_time``), else late, never both."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hopsched.cli.schedule import _timing
from hopsched.client.scheduler import CANCEL_LEAD_S
from hopsched.journal.records import CANCELLED, ScheduleInfo

DUE_US = 1_800_000_000_000_000


@given(lead_us=st.integers(min_value=-(10**9), max_value=10**9))
def test_a_cancel_is_in_time_exactly_from_the_lead_on(lead_us: int) -> None:
    info = ScheduleInfo("id", CANCELLED, DUE_US, DUE_US - 10**9, "", "q")

    said = _timing(info, DUE_US - lead_us)

    in_time = lead_us >= CANCEL_LEAD_S * 1_000_000
    assert said.startswith(": in time, it will not be delivered") is in_time
    assert said.endswith("it may have been delivered") is not in_time
