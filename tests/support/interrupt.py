"""Run one admin tool and SIGKILL it at an exact step: how the tests interrupt a tool.

    python interrupt.py upgrade|replay|teardown STEP COUNT

The process kills itself (SIGKILL: no cleanup, no close) at the first ``Progress``
step that starts with STEP and whose count is at least COUNT, e.g. ``"moved
p.relay.upgrade -> p.relay" 200`` (after the 200th message moved back is confirmed,
before it is acked) or ``"removed p.relay" 0``. The settings are the CLI's
(``HOPSCHED_URL``, ``HOPSCHED_PREFIX``, ``HOPSCHED_QUEUE_TYPE``). Exits 0 if the step
never came.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from hopsched.broker.objects import Progress, teardown, upgrade
from hopsched.broker.parked import replay_parked
from hopsched.connect import connect
from hopsched.settings import Settings
from hopsched.topology import Topology


def kill_at(wanted: str, count: int) -> Progress:
    def progress(step: str, done: int) -> None:
        if step.startswith(wanted) and done >= count:
            os.kill(os.getpid(), signal.SIGKILL)

    return progress


async def run(tool: str, progress: Progress) -> None:
    settings = Settings.from_env()
    if tool == "replay":
        await replay_parked(settings, None, progress=progress)
        return
    topology = Topology.from_settings(settings)
    connection = await connect(settings, name=f"hopsched-{tool}")
    async with connection:
        if tool == "upgrade":
            await upgrade(topology, connection, progress=progress)
        elif tool == "teardown":
            await teardown(topology, connection, force=True, progress=progress)
        else:
            raise SystemExit(f"unknown tool {tool!r}")


if __name__ == "__main__":
    tool, step, count = sys.argv[1:]
    asyncio.run(run(tool, kill_at(step, int(count))))
