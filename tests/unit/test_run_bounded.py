"""``run_bounded``: a command that outlives its bound is killed with its children, and
leaves no pipe for the garbage collector to close."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from pathlib import Path

import pytest

from hopsched.testing.localbroker import run_bounded


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in {"Z", "X"}


async def test_a_command_returns_its_status_and_output() -> None:
    status, out, err = await run_bounded(["sh", "-c", "echo out; echo err >&2; exit 3"], within=10)
    assert (status, out, err) == (3, "out\n", "err\n")


async def test_a_command_over_its_bound_is_killed_with_its_children(tmp_path: Path) -> None:
    """Like RabbitMQ's scripts, the shell runs its long part as a child (no exec)."""
    child = tmp_path / "child"
    script = f"sleep 60 & echo $! > {child}; wait; true"
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pipe closed by the GC warns: fail here
        with pytest.raises(TimeoutError):
            await run_bounded(["sh", "-c", script], within=0.5)
        gc.collect()
    assert time.monotonic() - started < 10
    pid = int(child.read_text())
    async with asyncio.timeout(10):
        while alive(pid):  # noqa: ASYNC110 (another process: nothing to await)
            await asyncio.sleep(0.05)
