"""What ``hopsched schedule`` says besides its result: after Ctrl-C, and when the id it
scheduled has other messages pending. Kept out of ``cli.py``: text and one journal read.
"""

from __future__ import annotations

__all__ = ["interrupted_schedule"]


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
