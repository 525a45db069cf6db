"""Relays run as a user runs them: the ``hopsched relay`` command in a process of its
own, to kill, stop and restart (``RelayProcess``, the ``relay_processes`` fixture)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import hopsched

RELAY_START_S = 30.0


def _hopsched_command() -> list[str]:
    """The ``hopsched`` script of this environment, as a user runs it."""
    script = Path(sys.executable).parent / "hopsched"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hopsched"]


class RelayProcess:
    """``hopsched relay`` in a subprocess; its log (stderr) is kept line by line."""

    def __init__(
        self, settings: hopsched.Settings, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.settings = settings
        self.args = args
        # on top of the test's; with PYTHONPATH (another version's code) it runs as
        # ``python -m hopsched``: this environment's script imports this version's
        self.env = env or {}
        self.lines: list[str] = []
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._new_line = asyncio.Event()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    async def start(self) -> RelayProcess:
        """Start it and return once it logs that it consumes."""
        assert self._process is None or self._process.returncode is not None
        env = (
            dict(os.environ)
            | {
                "HOPSCHED_URL": self.settings.url,
                "HOPSCHED_PREFIX": self.settings.prefix,
                "HOPSCHED_QUEUE_TYPE": self.settings.queue_type,
                "HOPSCHED_HOLD_WINDOW_MS": str(self.settings.hold_window_ms),
            }
            | self.env
        )
        consuming = self.count("relay consuming")
        command = (
            [sys.executable, "-m", "hopsched"] if "PYTHONPATH" in self.env else _hopsched_command()
        )
        self._process = await asyncio.create_subprocess_exec(
            *command,
            "relay",
            *self.args,
            env=env,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.env.get("PYTHONPATH"),  # not a checkout whose package would come first
        )
        self._reader = asyncio.create_task(self._read(self._process))
        await self.wait_for("relay consuming", consuming + 1, RELAY_START_S)
        return self

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            self.lines.append(line.decode(errors="replace"))
            self._new_line.set()
        self._new_line.set()

    async def wait_for(self, text: str, count: int, within: float) -> None:
        """Wait until ``count`` log lines hold ``text``; fail the test (with the log) if not."""
        try:
            async with asyncio.timeout(within):
                while self.count(text) < count:
                    if self.returncode is not None and self._reader and self._reader.done():
                        pytest.fail(f"the relay exited {self.returncode}:\n{self.log}")
                    self._new_line.clear()
                    await self._new_line.wait()
        except TimeoutError:
            pytest.fail(f"{count} x {text!r} not in the relay's log after {within} s:\n{self.log}")

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def pause(self) -> None:
        """SIGSTOP: the relay stalls (as in a long GC pause or a frozen VM)."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        """SIGKILL (a crash) and reap it."""
        assert self._process is not None
        self._process.kill()
        await self._finish()

    async def terminate(self, within: float) -> float:
        """SIGTERM; the seconds until it exited (fails the test after ``within`` s)."""
        assert self._process is not None
        started = time.monotonic()
        self._process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(within):
                await self._finish()
        except TimeoutError:
            pytest.fail(f"the relay did not exit within {within} s of SIGTERM:\n{self.log}")
        return time.monotonic() - started

    async def _finish(self) -> None:
        assert self._process is not None
        assert self._reader is not None
        await self._process.wait()
        await self._reader

    async def close(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._finish()


@pytest.fixture
async def relay_processes() -> AsyncIterator[Callable[..., Awaitable[RelayProcess]]]:
    """``await relay_processes(settings, *args)``: a started relay, killed after the test."""
    started: list[RelayProcess] = []

    async def start(settings: hopsched.Settings, *args: str) -> RelayProcess:
        relay = RelayProcess(settings, *args)
        started.append(relay)
        return await relay.start()

    yield start
    for relay in started:
        await relay.close()
    unawaited = [line for relay in started for line in relay.lines if "never retrieved" in line]
    assert not unawaited, f"a relay task failed with nobody awaiting it: {unawaited}"
