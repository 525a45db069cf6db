"""What ``hopsched schedule`` says besides its result: after Ctrl-C, and when the id it
scheduled has other messages pending. Kept out of ``schedule.py``: text and one journal read.
"""

from __future__ import annotations

import logging

from hopsched.client.scheduler import Scheduler
from hopsched.errors import HopschedError

__all__ = ["interrupted_schedule", "other_pending"]

log = logging.getLogger("hopsched.cli")


def interrupted_schedule(schedule_id: str) -> str:
    """The line for a ``schedule`` interrupted before the broker confirmed: the message
    may have reached the broker (and be delivered), or not. ``hopsched get`` knows it
    only once the journal has it (written after the confirm); scheduling it again with
    ``--replace`` leaves exactly one, whichever happened."""
    return (
        f"interrupted: schedule {schedule_id} may or may not have been scheduled; check "
        f"with: hopsched get {schedule_id} (unknown to it, it may still be on its way: to "
        f"have it once, schedule it again with --schedule-id {schedule_id} --replace)"
    )


async def other_pending(scheduler: Scheduler, schedule_id: str) -> str | None:
    """A warning if ``schedule_id``, just scheduled without ``replace``, has other
    messages pending (each is delivered: an id scheduled twice by mistake); None if not,
    or if the journal cannot be read (a producer's grant may not read it: then nothing is
    said). Reads the journal from its start (``Scheduler.get``, which counts copies)."""
    try:
        info = await scheduler.get(schedule_id, count_copies=True)
    except HopschedError as error:
        log.debug("not checking for other messages of %s: %s", schedule_id, error)
        return None
    if info is None or (info.pending_copies or 0) < 2:
        return None
    return (
        f"{schedule_id} now has {info.pending_copies} messages pending: it was scheduled "
        "before, and --replace was not given, so each is delivered at its own due time. "
        f"To keep only this one, schedule it again with --replace; to cancel them all: "
        f"hopsched cancel {schedule_id}"
    )
