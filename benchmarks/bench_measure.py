"""What the benchmark measures: deliveries at the target consumer, a process's CPU and
memory, and the broker's state (version, memory, queue depths)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from hopsched.core.envelope import HEADER_DUE, HEADER_HOPS, HEADER_ID
from hopsched.relay.stats import LatenessStats

__all__ = [
    "BENCH_DUE",
    "BENCH_ID",
    "MAX_IN_FLIGHT",
    "BrokerCpu",
    "CallCpu",
    "Collector",
    "Delivery",
    "Pipeline",
    "ProcessSampler",
    "broker_memory",
    "delivery_fields",
    "hop_bound",
    "hops_by_decade",
    "now_us",
    "queue_depths",
    "stop_process",
    "summarize",
    "use_broker_cpu",
    "use_rabbitmqctl",
]

#: Headers the benchmark puts on messages of the strategies other than hopsched,
#: so that every consumer reads lateness the same way (receive instant - due, µs).
BENCH_ID = "x-bench-id"
BENCH_DUE = "x-bench-due"


async def stop_process(process: asyncio.subprocess.Process, timeout_s: float) -> int:
    """SIGTERM ``process`` and wait; SIGKILL it after ``timeout_s``. Its exit status."""
    if process.returncode is not None:
        return process.returncode
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        return await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        return await process.wait()


def now_us() -> int:
    """Wall clock, integer µs since the Unix epoch (what the due headers count in)."""
    return time.time_ns() // 1000


MAX_IN_FLIGHT = 500  # schedule calls awaiting their confirm at once


class Pipeline:
    """Runs coroutines as tasks, at most ``limit`` at once: ``submit`` waits for a free
    slot, so publishes with confirms overlap without an unbounded backlog."""

    def __init__(self, limit: int) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._tasks: set[asyncio.Task[None]] = set()

    async def _run(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        finally:
            self._slots.release()

    async def submit(self, work: Coroutine[Any, Any, None]) -> None:
        await self._slots.acquire()
        task = asyncio.create_task(self._run(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for everything submitted (exceptions are the coroutines' to handle)."""
        if self._tasks:
            await asyncio.gather(*self._tasks)


class CallCpu:
    """This process's CPU time while at least one call is in flight (``begin`` before
    each, ``end`` after), and the calls counted.

    Calls awaiting their confirms overlap, so per-call intervals cannot be summed; the
    union of them can. It holds what ran in this process meanwhile, the calls and their
    confirms' processing but also the benchmark's pacing: an upper bound per call.
    """

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        self._active = 0
        self._since = 0.0

    def begin(self) -> None:
        if self._active == 0:
            self._since = time.process_time()
        self._active += 1

    def end(self, calls: int = 1) -> None:
        self._active -= 1
        self.calls += calls
        if self._active == 0:
            self.cpu_s += time.process_time() - self._since

    def us_per_call(self) -> float | None:
        return round(self.cpu_s * 1e6 / self.calls, 1) if self.calls else None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message received at the target consumer."""

    received_us: int
    due_us: int
    hops: int
    #: The due time hopsched stamped (``x-hopsched-due``) on a message that also has the
    #: producer's (``x-bench-due``, which ``due_us`` is): the ingress row's, whose relay
    #: stamps it from when it took the message; None for every other row.
    stamped_due_us: int | None = None

    @property
    def lateness_us(self) -> int:
        return self.received_us - self.due_us


def _hops(headers: Mapping[str, Any]) -> int:
    """Passes through a TTL queue: hopsched's hop count, else the broker's ``x-death``
    history (one entry per queue and reason, each with a count)."""
    hops = headers.get(HEADER_HOPS)
    if isinstance(hops, int):
        return hops
    deaths = headers.get("x-death") or []
    return sum(int(death.get("count", 1)) for death in deaths if isinstance(death, Mapping))


def delivery_fields(
    headers: Mapping[str, Any] | None,
) -> tuple[str, int, int, int | None] | None:
    """(schedule id, due µs, hops, stamped due µs or None) from a delivered message's
    headers: hopsched's own, or the benchmark's ``x-bench-*`` ones; None for a stray (no
    id or no integer due time).
    A message with both due times (the ``hopsched-ingress`` row: the producer's
    ``x-bench-due``, and the ``x-hopsched-due`` the relay stamps from when it took the
    message) is measured from the producer's, as the plugin's row is."""
    headers = headers or {}
    schedule_id = headers.get(HEADER_ID, headers.get(BENCH_ID))
    due_us = headers.get(BENCH_DUE, headers.get(HEADER_DUE))
    if not isinstance(schedule_id, str) or not isinstance(due_us, int):
        return None
    stamped = headers.get(HEADER_DUE) if BENCH_DUE in headers else None
    return schedule_id, due_us, _hops(headers), stamped if isinstance(stamped, int) else None


@dataclass
class Collector:
    """Deliveries of one workload, by schedule id; duplicates and strays counted."""

    expected: set[str]
    deliveries: dict[str, Delivery] = field(default_factory=dict)
    duplicates: int = 0
    strays: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    awaited: int = 0  # how many deliveries end the wait (the long F01 ones are not awaited)

    def add(
        self,
        schedule_id: str,
        due_us: int,
        hops: int,
        received_us: int,
        stamped_due_us: int | None = None,
    ) -> None:
        """One delivery, its fields already read (``delivery_fields``)."""
        if schedule_id not in self.expected:
            self.strays += 1
        elif schedule_id in self.deliveries:
            self.duplicates += 1
        else:
            self.deliveries[schedule_id] = Delivery(received_us, due_us, hops, stamped_due_us)
            if len(self.deliveries) >= self.awaited:
                self.done.set()

    def record(self, headers: Mapping[str, Any] | None, received_us: int) -> None:
        fields = delivery_fields(headers)
        if fields is None:
            self.strays += 1
        else:
            schedule_id, due_us, hops, stamped = fields
            self.add(schedule_id, due_us, hops, received_us, stamped)


def summarize(deliveries: list[Delivery]) -> dict[str, Any]:
    """Lateness percentiles (HDR histogram, ms), early count, min, mean and max hops."""
    stats = LatenessStats()
    for delivery in deliveries:
        stats.record(delivery.lateness_us)
    hops = [d.hops for d in deliveries]
    return {
        "early": stats.early,
        "min_ms": min((d.lateness_us for d in deliveries), default=0) / 1000,
        "p50_ms": stats.percentile_ms(50),
        "p90_ms": stats.percentile_ms(90),
        "p99_ms": stats.percentile_ms(99),
        "p999_ms": stats.percentile_ms(99.9),
        "max_ms": stats.max_ms,
        "mean_ms": stats.mean_ms,
        "mean_hops": sum(hops) / len(hops) if hops else 0.0,
        "max_hops": max(hops, default=0),
    }


def hop_bound(delay_us: int, hold_window_ms: int) -> int:
    """The hops a delay should take at most: ceil(log2(delay / hold window)) + 2, and 2 for
    a delay at or below the hold window (which needs no hop). Exact integer arithmetic; a
    hold window below 1 ms counts as 1 ms."""
    window_us = max(hold_window_ms, 1) * 1000
    doublings = 0
    while window_us << doublings < delay_us:
        doublings += 1
    return doublings + 2


_FIRST_DECADE_US = 10_000  # decades of requested delay start at 10 ms; below: one row


def _duration_label(us: int) -> str:
    return f"{us // 1000} ms" if us < 1_000_000 else f"{us // 1_000_000} s"


def hops_by_decade(points: list[tuple[int, Delivery]], hold_window_ms: int) -> list[dict[str, Any]]:
    """Hops per decade of requested delay ([10 ms, 100 ms), [100 ms, 1 s), ...; delays
    below 10 ms in one row [0 ms, 10 ms)), for the decades that have deliveries: n, mean
    and max hops, ``bound`` = ``hop_bound`` of the decade's upper end, and ``over_bound``
    = messages with more hops than ``hop_bound`` of their own delay."""
    by_decade: dict[int, list[tuple[int, int]]] = {}
    for delay_us, delivery in points:
        decade, lower = -1, _FIRST_DECADE_US
        while delay_us >= lower:
            decade, lower = decade + 1, lower * 10
        by_decade.setdefault(decade, []).append((delay_us, delivery.hops))
    rows = []
    for decade in sorted(by_decade):
        members = by_decade[decade]
        upper_us = _FIRST_DECADE_US * 10 ** (decade + 1)
        lower_us = 0 if decade < 0 else upper_us // 10
        hops = [h for _, h in members]
        rows.append(
            {
                "decade": f"[{_duration_label(lower_us)}, {_duration_label(upper_us)})",
                "n": len(members),
                "mean_hops": round(sum(hops) / len(hops), 2),
                "max_hops": max(hops),
                "bound": hop_bound(upper_us, hold_window_ms),
                "over_bound": sum(1 for d, h in members if h > hop_bound(d, hold_window_ms)),
            }
        )
    return rows


def _vm_hwm_bytes(pid: int) -> int:
    """The kernel's peak RSS of ``pid`` (``VmHWM`` in /proc/PID/status), 0 if unknown."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class ProcessSampler:
    """CPU seconds and peak RSS of one process (a relay or a worker), sampled twice a second.

    Peak RSS is the larger of the largest sample and the kernel's ``VmHWM``.
    """

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self.peak_rss = 0
        self.rss = 0
        self.cpu_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            with self._process.oneshot():
                times = self._process.cpu_times()
                self.cpu_s = times.user + times.system
                self.rss = self._process.memory_info().rss
            self.peak_rss = max(self.peak_rss, self.rss, _vm_hwm_bytes(self._process.pid))

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self.sample()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


#: The command that runs ``rabbitmqctl`` against the measured broker (``use_rabbitmqctl``).
_RABBITMQCTL: list[str] = ["rabbitmqctl"]


#: Reads the measured broker's CPU seconds so far (``use_broker_cpu``), if it can be told.
_BROKER_CPU: list[Callable[[], float]] = []
#: How long ``BrokerCpu.start`` watches the broker before a phase for its idle rate, s.
IDLE_SAMPLE_S = 2.0


def use_broker_cpu(probe: Callable[[], float] | None) -> None:
    """Read the broker's CPU with ``probe`` (a private node's ``cpu_seconds``); None: it
    cannot be told (the machine's broker serves others too), and no row counts it."""
    _BROKER_CPU[:] = [] if probe is None else [probe]


class BrokerCpu:
    """The broker's CPU over one phase, less what it spends idle (its timers, metrics
    emission: about 2 ms per second on an idle RabbitMQ 3.10.8 or 4.0.5 node here) at
    the rate measured just before the phase: what the strategy cost the broker."""

    def __init__(self, probe: Callable[[], float], idle_per_s: float) -> None:
        self.probe = probe
        self.idle_per_s = idle_per_s
        self.before = probe()
        self.since = time.monotonic()

    @classmethod
    async def start(cls) -> BrokerCpu | None:
        """Measure the idle rate, then start counting; None when no probe is set."""
        if not _BROKER_CPU:
            return None
        probe = _BROKER_CPU[0]
        cpu, at = probe(), time.monotonic()
        await asyncio.sleep(IDLE_SAMPLE_S)
        return cls(probe, (probe() - cpu) / (time.monotonic() - at))

    def fields(self, messages: int) -> dict[str, Any]:
        """``broker_cpu_s`` (all of it), ``broker_idle_cpu_ms_per_s`` and
        ``broker_cpu_us_per_msg`` (less idle, per message delivered)."""
        gross = self.probe() - self.before
        net = max(0.0, gross - self.idle_per_s * (time.monotonic() - self.since))
        return {
            "broker_cpu_s": round(gross, 2),
            "broker_idle_cpu_ms_per_s": round(self.idle_per_s * 1e3, 1),
            "broker_cpu_us_per_msg": round(net * 1e6 / messages, 1) if messages else None,
        }


def use_rabbitmqctl(command: Sequence[str] | None) -> None:
    """Read the broker's memory and queue depths with ``command`` (a prefix such as a
    private node's ``PrivateBroker.rabbitmqctl_command``); None: plain ``rabbitmqctl``,
    which reaches this machine's own node."""
    _RABBITMQCTL[:] = list(command or ["rabbitmqctl"])


def _rabbitmqctl(*args: str) -> Any:
    """``rabbitmqctl -q ARGS --formatter json`` parsed, or None (no rabbitmqctl, not root)."""
    if _RABBITMQCTL == ["rabbitmqctl"] and shutil.which("rabbitmqctl") is None:
        return None
    try:
        result = subprocess.run(
            [*_RABBITMQCTL, "-q", *args, "--formatter", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return json.loads(result.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


async def broker_memory() -> dict[str, int] | None:
    """The broker's memory in bytes (total as the broker counts it, and per quorum/classic
    queue processes and message index), from ``rabbitmqctl status``; None if unavailable."""
    status = await asyncio.to_thread(_rabbitmqctl, "status")
    if not isinstance(status, dict) or not isinstance(status.get("memory"), dict):
        return None
    memory = status["memory"]
    total = memory.get("total")
    picked = {
        "total": total.get("erlang") if isinstance(total, dict) else total,
        "rss": total.get("rss") if isinstance(total, dict) else None,
    }
    for key in ("quorum_queue_procs", "quorum_ets", "queue_procs", "msg_index", "binary"):
        picked[key] = memory.get(key)
    return {k: int(v) for k, v in picked.items() if isinstance(v, int)}


async def queue_depths(prefix: str) -> dict[str, int] | None:
    """Messages (ready + unacknowledged) of every queue whose name starts with ``prefix``,
    from ``rabbitmqctl list_queues``; None if unavailable."""
    rows = await asyncio.to_thread(_rabbitmqctl, "list_queues", "name", "messages")
    if not isinstance(rows, list):
        return None
    return {
        row["name"]: int(row.get("messages") or 0)
        for row in rows
        if isinstance(row, dict) and str(row.get("name", "")).startswith(prefix)
    }
