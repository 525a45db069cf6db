"""The strategies compared: each declares its broker objects under its own prefix,
starts whatever process it needs, publishes one scheduled message (confirmed), and
deletes everything it declared when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, ClassVar

import aio_pika
import aiormq
from bench_ladder import ladder_environment, ladder_name, parse_label
from bench_measure import BENCH_DUE, BENCH_ID, MAX_IN_FLIGHT, Pipeline, now_us, stop_process

import hopsched

try:
    from hopsched.urls import split_urls
except ImportError:  # a hopsched measured through --hopsched-path from before node lists

    def split_urls(url: str) -> list[str]:
        return [url]


try:  # the relay's own publisher; a hopsched from before it (--hopsched-path) has none
    from hopsched import amqp
    from hopsched.amqp.publisher import Publisher, target_lane
    from hopsched.connect import Connector
except ImportError as error:
    _NO_FAST_PUBLISHER: str | None = f"{error}"
else:
    _NO_FAST_PUBLISHER = None

__all__ = [
    "BURST_BATCH",
    "STRATEGIES",
    "HopschedIngress",
    "HopschedQuorum",
    "Producer",
    "Strategy",
    "at_datetime",
    "make_strategy",
    "relay_command",
]

_HERE = Path(__file__).resolve().parent
_READY_TIMEOUT_S = 30.0
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Messages per ``schedule_many`` call when a workload gives many at once.
BURST_BATCH = 1000
#: Messages the broker floor publishes per loop iteration in a burst, as many as the
#: relay releases (``hopsched.relay.holds``).
FLOOR_SLICE = 500


def relay_command(
    url: str, prefix: str, prefetch: int, queue_type: str = "quorum", *extra: str
) -> list[str]:
    """``python -m hopsched relay`` as users run it (``extra``: more relay options, e.g.
    ``--metrics-port``). ``-P`` keeps the working directory off ``sys.path``, so the
    relay imports the hopsched this process imported (a checkout given by
    ``--hopsched-path`` is first on ``PYTHONPATH``), not one that happens to sit in the
    directory the benchmark was started from."""
    return [
        sys.executable, "-P", "-m", "hopsched", "relay",
        "--url", url,
        "--prefix", prefix,
        "--queue-type", queue_type,
        "--prefetch", str(prefetch),
        *extra,
    ]  # fmt: skip


class Producer:
    """One of several concurrent producers of the publish-throughput phase: its own
    connection, publishing one confirmed message per ``publish`` call."""

    async def publish(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _ChannelProducer(Producer):
    """A producer on its own aio-pika connection and confirming channel, publishing as
    the strategy's ``publish_on`` does."""

    def __init__(self, strategy: Strategy, index: int) -> None:
        self.strategy = strategy
        self.index = index
        self.connection: aio_pika.abc.AbstractConnection | None = None
        self.channel: aio_pika.abc.AbstractChannel | None = None

    async def open(self) -> _ChannelProducer:
        self.connection = await aio_pika.connect(
            self.strategy.node_url, name=f"bench-{self.strategy.name}-producer-{self.index}"
        )
        self.channel = await self.connection.channel(publisher_confirms=True)
        return self

    async def publish(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        await self.strategy.publish_on(self.channel, schedule_id, delay_us, body)

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
            self.connection = None


def at_datetime(due_us: int) -> datetime:
    """``due_us`` as an aware datetime, exactly (no float seconds on the way)."""
    return _EPOCH + timedelta(microseconds=due_us)


class Strategy:
    """One way of delaying messages, set up under ``prefix`` on the broker at ``url``.

    Subclasses declare their objects in ``_declare`` (recording every name in
    ``queues``/``exchanges`` so ``close`` deletes them), may start a process in
    ``_start_process``, and publish in ``schedule``.
    """

    name: ClassVar[str]
    #: What ``broker publishes per delivered message`` counts for this strategy.
    counting: ClassVar[str]
    #: Declare arguments of the target queue (durable classic without any).
    target_arguments: ClassVar[dict[str, Any]] = {}

    def __init__(self, url: str, run_id: str, prefetch: int) -> None:
        self.url = url  # hopsched's Settings.url: one node, or a cluster's comma-separated
        self.node_url = split_urls(url)[0]  # for the benchmark's own aio-pika connections
        self.prefetch = prefetch
        self.prefix = f"hopsched-bench-{self.name}-{run_id}".replace("/", "-")
        self.target_queue = f"{self.prefix}-target"  # hopsched refuses its own {prefix}.…
        self.queues: list[str] = [self.target_queue]
        self.exchanges: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self.log_warnings: list[str] = []  # the process's WARNING and ERROR lines
        self.connection: aio_pika.abc.AbstractConnection | None = None
        self.channel: aio_pika.abc.AbstractChannel | None = None
        #: Variables set for the strategy's process (a hopsched relay's ladder).
        self.environment: dict[str, str] = {}

    async def unavailable(self, *, burst: bool = False) -> str | None:
        """Why this strategy cannot run on this broker (in the burst scenario if
        ``burst``), or None."""
        return None

    async def open(self) -> None:
        """Connect, declare, start the strategy's process and wait until it consumes."""
        self.connection = await aio_pika.connect(self.node_url, name=f"bench-{self.name}")
        self.channel = await self.connection.channel(publisher_confirms=True)
        await self.channel.declare_queue(
            self.target_queue, durable=True, arguments=self.target_arguments or None
        )
        await self._declare(self.channel)
        await self._start_process()

    async def _start_process(self) -> None:
        command = self._process_command()
        if command is not None:
            if self._log is None:
                self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            self.process = await asyncio.create_subprocess_exec(
                *command, stdout=self._log, stderr=self._log, env={**os.environ, **self.environment}
            )
            await self._wait_consuming()

    async def restart_process(self) -> float:
        """Stop the strategy's process (SIGTERM) and start a new one; seconds from its
        start until it consumes."""
        await self.stop_process()
        started = time.perf_counter()
        await self._start_process()
        return time.perf_counter() - started

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        raise NotImplementedError

    def _process_command(self) -> list[str] | None:
        return None

    @property
    def consumed_queue(self) -> str:
        """The queue the strategy's process consumes (it is ready once it has a consumer)."""
        raise NotImplementedError

    async def _wait_consuming(self) -> None:
        assert self.connection is not None
        assert self.process is not None
        deadline = asyncio.get_running_loop().time() + _READY_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            if self.process.returncode is not None:
                raise RuntimeError(f"{self.name}: its process exited:\n{self.process_log()}")
            async with self.connection.channel() as channel:
                with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                    queue = await channel.declare_queue(self.consumed_queue, passive=True)
                    if (queue.declaration_result.consumer_count or 0) > 0:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name}: no consumer on {self.consumed_queue} after 30 s")

    def process_log(self, tail: int = 4000) -> str:
        """The last ``tail`` characters the strategy's process wrote (stdout and stderr)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-tail:]

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        """Publish one message due ``delay_us`` from now, to the target queue; confirmed."""
        raise NotImplementedError

    async def schedule_at(self, schedule_id: str, due_us: int, body: bytes) -> None:
        """Publish one message due at ``due_us``; confirmed."""
        await self.schedule(schedule_id, due_us - now_us(), body)

    async def schedule_burst(
        self, ids: list[str], due_us: int, body: bytes
    ) -> tuple[str, list[str]]:
        """Schedule one message per id, all due at ``due_us``, as fast as the strategy
        goes; how it did, and the calls that failed."""
        failures: list[str] = []

        async def one(schedule_id: str) -> None:
            try:
                await self.schedule_at(schedule_id, due_us, body)
            except Exception as error:
                failures.append(f"{schedule_id}: {error!r}")

        pipeline = Pipeline(MAX_IN_FLIGHT)
        for schedule_id in ids:
            await pipeline.submit(one(schedule_id))
        await pipeline.drain()
        return f"one call per message, {MAX_IN_FLIGHT} in flight", failures

    def message(
        self, schedule_id: str, due_us: int, body: bytes, **kwargs: Any
    ) -> aio_pika.Message:
        headers = {BENCH_ID: schedule_id, BENCH_DUE: due_us, **kwargs.pop("headers", {})}
        return aio_pika.Message(
            body, headers=headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **kwargs
        )

    def client_publishes(self, hops: int) -> int:
        """Publishes by clients (scheduler, relay, worker) for one delivered message."""
        return 1

    async def publish_on(
        self, channel: aio_pika.abc.AbstractChannel, schedule_id: str, delay_us: int, body: bytes
    ) -> None:
        """Publish one message due ``delay_us`` from now on ``channel`` (confirming), as
        ``schedule`` does on the strategy's own: for the strategies that can give the
        publish-throughput phase a producer per connection."""
        raise NotImplementedError

    async def open_producer(self, index: int) -> Producer | None:
        """A producer of its own for the publish-throughput phase (its own connection);
        None: this strategy is not measured there."""
        return None

    async def ingested_count(self) -> int | None:
        """How many messages the strategy's process has taken from where producers
        publish and put where they wait (None: nothing to wait for after the confirms)."""
        return None

    async def stop_process(self) -> int | None:
        """SIGTERM the strategy's process and wait; its exit status."""
        if self.process is None:
            return None
        return await stop_process(self.process, 30.0)

    async def close(self) -> list[str]:
        """Stop the process, delete every queue and exchange declared; what failed."""
        await self.stop_process()
        self.log_warnings = [
            line
            for line in self.process_log(tail=1_000_000).splitlines()
            if " WARNING " in line or " ERROR " in line
        ]
        if self._log is not None:
            self._log.close()
            self._log = None
        problems: list[str] = []
        connection = await aio_pika.connect(self.node_url, name=f"bench-{self.name}-cleanup")
        async with connection:
            for kind, names in (("queue", self.queues), ("exchange", self.exchanges)):
                for name in names:
                    try:
                        async with connection.channel() as channel:
                            if kind == "queue":
                                await channel.queue_delete(name)
                            else:
                                await channel.exchange_delete(name)
                    except Exception as error:  # keep deleting the rest
                        problems.append(f"{kind} {name}: {error!r}")
        if self.connection is not None:
            await self.connection.close()
            self.connection = None
        return problems


class Hopsched(Strategy):
    """hopsched's Scheduler, and its relay as a separate process (``python -m hopsched relay``)."""

    queue_type: ClassVar[hopsched.settings.QueueType]
    counting = (
        "client publishes: scheduler 1 + relay (hops - 1 re-publishes + 1 delivery); "
        "dead-letters: 1 per hop"
    )

    def __init__(
        self, url: str, run_id: str, prefetch: int, ladder: dict[str, int] | None = None
    ) -> None:
        """``ladder``: Settings fields of the ladder (``bench_ladder``), for the Scheduler
        and, as ``HOPSCHED_*`` variables, the relay process; None: the default ladder."""
        if ladder:
            self.name = f"{self.name}/{ladder_name(ladder)}"
        super().__init__(url, run_id, prefetch)
        self.settings = hopsched.Settings(
            url=url,
            prefix=self.prefix,
            queue_type=self.queue_type,
            prefetch=prefetch,
            **(ladder or {}),
        )
        self.environment = ladder_environment(ladder or {})
        self.topology = hopsched.Topology.from_settings(self.settings)
        # all_queues: the relay declares the ingress's queues too (a hopsched measured
        # through --hopsched-path may predate them)
        every = getattr(self.topology, "all_queues", self.topology.queues)
        self.queues += list(every())
        self.exchanges.append(self.topology.expired_exchange)
        self.scheduler: hopsched.Scheduler | None = None

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.scheduler = hopsched.Scheduler(self.settings, declare=True)
        await self.scheduler.__aenter__()

    def _process_command(self) -> list[str]:
        return relay_command(self.url, self.prefix, self.prefetch, self.queue_type)

    @property
    def consumed_queue(self) -> str:
        return self.topology.relay_queue

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.scheduler is not None
        await self.scheduler.schedule(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            delay=timedelta(microseconds=delay_us),
            routing_key=self.target_queue,
            schedule_id=schedule_id,
        )

    async def schedule_at(self, schedule_id: str, due_us: int, body: bytes) -> None:
        assert self.scheduler is not None
        await self.scheduler.schedule(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            at=at_datetime(due_us),
            routing_key=self.target_queue,
            schedule_id=schedule_id,
        )

    async def schedule_burst(
        self, ids: list[str], due_us: int, body: bytes
    ) -> tuple[str, list[str]]:
        """``Scheduler.schedule_many`` in batches of ``BURST_BATCH``, one after another;
        a hopsched without it (an earlier checkout) gets one ``schedule()`` per message."""
        if not hasattr(self.scheduler, "schedule_many"):
            return await super().schedule_burst(ids, due_us, body)
        assert self.scheduler is not None
        at = at_datetime(due_us)
        failures: list[str] = []
        for start in range(0, len(ids), BURST_BATCH):
            batch = ids[start : start + BURST_BATCH]
            requests = [
                hopsched.ScheduleRequest(body, self.target_queue, at=at, schedule_id=schedule_id)
                for schedule_id in batch
            ]
            try:
                results: list[Any] = await self.scheduler.schedule_many(
                    requests, return_exceptions=True
                )
            except Exception as error:  # the whole batch (e.g. no confirm in time)
                results = [error] * len(batch)
            failures += [
                f"{schedule_id}: {result!r}"
                for schedule_id, result in zip(batch, results, strict=True)
                if isinstance(result, BaseException)
            ]
        return f"schedule_many, batches of {BURST_BATCH:,}", failures

    def client_publishes(self, hops: int) -> int:
        # hops 0: scheduler -> relay queue, relay -> target; else 1 + (hops - 1) + 1.
        return 2 if hops == 0 else hops + 1

    def relayed(self, hops: int) -> int:
        """Messages the relay takes for one delivered message: each hop's expiry into the
        relay queue (the scheduler publishes the first hop), or 1 when it never hops."""
        return max(hops, 1)

    async def open_producer(self, index: int) -> Producer | None:
        return await _SchedulerProducer(self, index).open()

    async def close(self) -> list[str]:
        if self.scheduler is not None:
            await self.scheduler.close()
            self.scheduler = None
        return await super().close()


class _SchedulerProducer(Producer):
    """A producer of its own ``hopsched.Scheduler`` (its own connection): ``schedule()``."""

    def __init__(self, strategy: Hopsched, index: int) -> None:
        self.strategy = strategy
        self.scheduler = hopsched.Scheduler(strategy.settings)

    async def open(self) -> _SchedulerProducer:
        await self.scheduler.__aenter__()
        return self

    async def publish(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        await self.scheduler.schedule(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            delay=timedelta(microseconds=delay_us),
            routing_key=self.strategy.target_queue,
            schedule_id=schedule_id,
        )

    async def close(self) -> None:
        await self.scheduler.close()


class HopschedQuorum(Hopsched):
    name = "hopsched-quorum"
    queue_type = "quorum"


class HopschedIngress(Hopsched):
    """hopsched's x-delay ingress (``hopsched.core.ingress``, docs/ingress.md): producers
    publish as to the delayed-message plugin, to an exchange with an ``x-delay`` header
    (ms), through aio-pika with confirms, as the ``delayed-exchange`` row does; the relay
    (its own process, as for ``hopsched-quorum``) takes each message from
    ``{prefix}.ingress``, schedules it and delivers it through ``{prefix}.due.E``, to
    which the target queue is bound. Quorum ladder. Lateness is measured from the
    producer's clock (``x-bench-due``, read just before publishing), as for the plugin,
    not from the due time the relay stamps (``x-hopsched-due``, from when it took the
    message on RabbitMQ 3.10/3.11)."""

    name = "hopsched-ingress"
    queue_type = "quorum"
    counting = (
        "client publishes: producer 1 (-> ingress queue) + relay (1 into the ladder, "
        "hops - 1 re-publishes, 1 delivery; 1 when it never hops); dead-letters: 1 per hop"
    )

    def __init__(
        self, url: str, run_id: str, prefetch: int, ladder: dict[str, int] | None = None
    ) -> None:
        super().__init__(url, run_id, prefetch, ladder)
        self.exchange = f"{self.prefix}-delayed"  # what producers publish to
        self.due_exchange = self.topology.due_exchange(self.exchange)
        self.exchanges += [self.exchange, self.due_exchange]

    async def open(self) -> None:
        """The ladder and the relay as for ``hopsched-quorum``; then, once the relay has
        declared ``{prefix}.ingress`` and consumes it, the ingress (type ``direct``, as the
        plugin row's ``x-delayed-type``) and the target queue bound to its due exchange
        by its own name, as it is bound to the plugin's exchange."""
        await super().open()
        await self._wait_consuming_queue(self.topology.ingress_queue)
        from hopsched.broker.ingress import bind_to_due_exchange, declare_ingress
        from hopsched.core.ingress import Ingress

        await declare_ingress(self.settings, Ingress(self.exchange, "direct"))
        await bind_to_due_exchange(
            self.settings, self.exchange, self.target_queue, routing_key=self.target_queue
        )

    async def _wait_consuming_queue(self, name: str) -> None:
        assert self.connection is not None
        deadline = asyncio.get_running_loop().time() + _READY_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            async with self.connection.channel() as channel:
                with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
                    queue = await channel.declare_queue(name, passive=True)
                    if (queue.declaration_result.consumer_count or 0) > 0:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name}: no consumer on {name} after 30 s")

    async def unavailable(self, *, burst: bool = False) -> str | None:
        try:
            from hopsched.broker.ingress import declare_ingress  # noqa: F401
        except ImportError as error:  # a hopsched from before the ingress (--hopsched-path)
            return f"not available: this hopsched has no x-delay ingress ({error})"
        return None

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        await self.publish_on(self.channel, schedule_id, delay_us, body)

    async def schedule_at(self, schedule_id: str, due_us: int, body: bytes) -> None:
        await self.schedule(schedule_id, due_us - now_us(), body)

    async def schedule_burst(
        self, ids: list[str], due_us: int, body: bytes
    ) -> tuple[str, list[str]]:
        return await Strategy.schedule_burst(self, ids, due_us, body)

    async def publish_on(
        self, channel: aio_pika.abc.AbstractChannel, schedule_id: str, delay_us: int, body: bytes
    ) -> None:
        delay_ms = -(-delay_us // 1000)  # as the plugin row: rounded up, never early
        message = self.message(
            schedule_id,
            now_us() + delay_us,
            body,
            headers={"x-delay": delay_ms},
            message_id=schedule_id,  # the schedule id the relay gives it
        )
        exchange = await channel.get_exchange(self.exchange, ensure=False)
        await exchange.publish(message, routing_key=self.target_queue)

    async def open_producer(self, index: int) -> Producer | None:
        return await _ChannelProducer(self, index).open()

    async def ingested_count(self) -> int | None:
        """Messages in the step queues: a long-delayed message the relay has taken from
        ``{prefix}.ingress`` waits there (its first hop) once its publish is confirmed."""
        assert self.connection is not None
        total = 0
        async with self.connection.channel() as channel:
            for name in self.topology.step_queues:
                queue = await channel.declare_queue(name, passive=True)
                total += queue.declaration_result.message_count or 0
        return total

    def client_publishes(self, hops: int) -> int:
        # hops 0: producer -> ingress queue, relay -> target; else 1 + 1 + (hops - 1) + 1.
        return 2 if hops == 0 else hops + 2

    def relayed(self, hops: int) -> int:
        # the ingress delivery, then each hop's expiry into the relay queue
        return hops + 1


class HopschedClassic(Hopsched):
    name = "hopsched-classic"
    queue_type = "classic"


class PerMessageTtl(Strategy):
    """The textbook recipe: one classic queue, per-message ``expiration``, dead-lettered
    to the target (https://www.rabbitmq.com/docs/ttl#per-message-ttl-in-publishers)."""

    name = "per-message-ttl"
    counting = "client publishes: 1; dead-letters: 1 (wait queue -> target)"

    @property
    def wait_queue(self) -> str:
        return f"{self.prefix}.wait"

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.queues.append(self.wait_queue)
        await channel.declare_queue(
            self.wait_queue,
            durable=True,
            arguments={
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.target_queue,
            },
        )

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        expiration_ms = -(-delay_us // 1000)  # whole ms, rounded up: never early
        due_us = now_us() + delay_us
        message = self.message(
            schedule_id, due_us, body, expiration=timedelta(milliseconds=expiration_ms)
        )
        await self.channel.default_exchange.publish(message, routing_key=self.wait_queue)


#: The seconds ladder's levels: TTL 2^level s for level 27..0 (NServiceBus, Celery 5.5).
LADDER_BITS = 28


class SecondsLadder(Strategy):
    """The broker-routed binary ladder of NServiceBus's RabbitMQ transport
    (``DelayInfrastructure``: 28 levels, max delay 2^28 - 1 s) and Celery 5.5's "native
    delayed delivery" (kombu ``kombu/transport/native_delayed_delivery.py``,
    https://github.com/celery/kombu): per level a topic exchange and a queue with TTL
    2^level s; the routing key is the delay's 28 bits, most significant first, then the
    destination. A queue takes keys whose bit for its level is 1 and dead-letters to the
    next level's exchange; an exchange forwards keys whose bit is 0 to the next level's
    exchange; level 0 ends in the delivery exchange, bound to the target by ``#.KEY``.
    No relay: the broker routes everything.

    The delay is rounded **up** to whole seconds, as the issue asks (never early); Celery
    5.5 truncates it instead (``int(countdown)``), which delivers up to 1 s early.
    Queues are quorum, as Celery 5.5 requires for native delayed delivery.
    """

    name = "seconds-ladder"
    counting = (
        "client publishes: 1; dead-letters: 1 per level queue entered (popcount of the seconds)"
    )
    _TARGET_KEY = "bench"

    def level(self, level: int) -> str:
        return f"{self.prefix}.delay.{level}"

    @property
    def delivery_exchange(self) -> str:
        return f"{self.prefix}.delay.delivery"

    @property
    def target_exchange(self) -> str:
        return f"{self.prefix}.target-x"

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.exchanges += [self.level(n) for n in range(LADDER_BITS)]
        self.exchanges += [self.delivery_exchange, self.target_exchange]
        self.queues += [self.level(n) for n in range(LADDER_BITS)]
        exchanges = {}
        for n in range(LADDER_BITS - 1, -1, -1):
            exchanges[n] = await channel.declare_exchange(
                self.level(n), aio_pika.ExchangeType.TOPIC, durable=True
            )
        delivery = await channel.declare_exchange(
            self.delivery_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        for n in range(LADDER_BITS - 1, -1, -1):
            queue = await channel.declare_queue(
                self.level(n),
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-overflow": "reject-publish",
                    "x-dead-letter-strategy": "at-least-once",
                    "x-message-ttl": (1 << n) * 1000,
                    "x-dead-letter-exchange": self.level(n - 1) if n else self.delivery_exchange,
                },
            )
            # Bit n sits after (27 - n) other bits: "*.*.1.#" takes keys whose bit n is 1.
            skip = "*." * (LADDER_BITS - 1 - n)
            await queue.bind(exchanges[n], routing_key=f"{skip}1.#")
            next_exchange = exchanges[n - 1] if n else delivery
            await next_exchange.bind(exchanges[n], routing_key=f"{skip}0.#")
        target = await channel.declare_exchange(
            self.target_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        await target.bind(delivery, routing_key=f"#.{self._TARGET_KEY}")
        queue = await channel.declare_queue(self.target_queue, durable=True)
        await queue.bind(target, routing_key=f"#.{self._TARGET_KEY}")

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        seconds = min(-(-delay_us // 1_000_000), (1 << LADDER_BITS) - 1)
        bits = ".".join(f"{seconds:0{LADDER_BITS}b}")
        due_us = now_us() + delay_us
        exchange = await self.channel.get_exchange(self.level(LADDER_BITS - 1), ensure=False)
        await exchange.publish(
            self.message(schedule_id, due_us, body), routing_key=f"{bits}.{self._TARGET_KEY}"
        )


class BrokerFloor(Strategy):
    """Not a scheduler: every message goes straight to the target, due the instant it is
    published. Its lateness is the broker's own publish -> consume time at this rate and
    on this machine: the floor under the last leg of every strategy (a scheduler that
    publishes exactly at the due time still arrives this late)."""

    name = "broker-floor"
    counting = "client publishes: 1; dead-letters: 0"

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        pass

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        message = self.message(schedule_id, now_us(), body)
        await self.channel.default_exchange.publish(message, routing_key=self.target_queue)

    async def unavailable(self, *, burst: bool = False) -> str | None:
        if burst and _NO_FAST_PUBLISHER is not None:
            return (
                "not available: this hopsched has no hopsched.amqp.publisher.Publisher "
                f"(the burst's floor uses it; {_NO_FAST_PUBLISHER})"
            )
        return None

    async def schedule_burst(
        self, ids: list[str], due_us: int, body: bytes
    ) -> tuple[str, list[str]]:
        """At ``due_us``, every message straight to the target with the relay's own
        publisher (``hopsched.amqp.publisher.Publisher`` on a ``Connector`` connection),
        confirms pipelined, released as the relay releases a burst (``hopsched.relay.holds``:
        woken a millisecond early, the rest waited by yielding, slices of
        ``FLOOR_SLICE`` with a loop iteration, so a write, between them). Connection,
        channel and properties are ready before that instant."""
        connection = await Connector(hopsched.Settings(url=self.url), name="bench-floor").connect()
        publisher = Publisher(connection)
        lane = target_lane("")
        failures: list[str] = []
        loop = asyncio.get_running_loop()
        confirmed, warmed = loop.create_future(), loop.create_future()
        pending = len(ids)

        def settled(schedule_id: str, outcome: amqp.Outcome, detail: Any) -> None:
            nonlocal pending
            if outcome is not amqp.Outcome.ACK:
                failures.append(f"{schedule_id}: {outcome.value} {detail!r}")
            pending -= 1
            if pending == 0:
                confirmed.set_result(None)

        try:
            properties = [
                amqp.Properties(
                    delivery_mode=2,
                    headers=amqp.Table.from_dict({BENCH_ID: schedule_id, BENCH_DUE: due_us}),
                ).encode()
                for schedule_id in ids
            ]
            # Opens the lane's channel now, not at the due instant: a routing key no queue
            # has, so the broker returns it (mandatory) and the target never sees it.
            publisher.publish(
                lane, "", f"{self.prefix}.nowhere", b"", properties[0],
                lambda outcome, detail: warmed.set_result(outcome),
            )  # fmt: skip
            await warmed
            await asyncio.sleep(max(0.0, (due_us - now_us()) / 1e6 - 0.001))
            while now_us() < due_us:  # noqa: ASYNC110 - the last ms, which a timer overshoots
                await asyncio.sleep(0)
            for start in range(0, len(ids), FLOOR_SLICE):
                for schedule_id, encoded in zip(
                    ids[start : start + FLOOR_SLICE],
                    properties[start : start + FLOOR_SLICE],
                    strict=True,
                ):
                    publisher.publish(
                        lane, "", self.target_queue, body, encoded,
                        functools.partial(settled, schedule_id),
                    )  # fmt: skip
                await asyncio.sleep(0)
            await confirmed
        finally:
            await publisher.close()
            await connection.close()
        how = f"at the due instant, hopsched.amqp.publisher.Publisher, slices of {FLOOR_SLICE}"
        return how, failures


class BrokerFloorQuorum(BrokerFloor):
    """The broker floor into a quorum target queue: the broker's own publish -> consume
    time through a quorum queue (a message is delivered once its Raft log entry is
    committed), the floor under the first leg of ``hopsched-ingress`` on RabbitMQ
    3.10/3.11, whose delay starts when the relay takes the message from the quorum
    queue ``{prefix}.ingress``."""

    name = "broker-floor-quorum"
    target_arguments: ClassVar[dict[str, Any]] = {"x-queue-type": "quorum"}


class ConsumerHold(Strategy):
    """The Celery-ETA / Dramatiq way: a worker (``bench_hold_worker.py``, its own process)
    consumes at once, holds each message in memory until due, publishes it to the target
    with a confirm, then acks. Unlimited prefetch: Celery raises its prefetch for every ETA
    task it holds."""

    name = "consumer-hold"
    counting = "client publishes: 2 (producer -> hold queue, worker -> target); dead-letters: 0"

    @property
    def consumed_queue(self) -> str:
        return f"{self.prefix}.hold"

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.queues.append(self.consumed_queue)
        await channel.declare_queue(self.consumed_queue, durable=True)

    def _process_command(self) -> list[str]:
        return [
            sys.executable,
            str(_HERE / "bench_hold_worker.py"),
            self.url,
            self.consumed_queue,
            self.target_queue,
        ]

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        message = self.message(schedule_id, now_us() + delay_us, body)
        await self.channel.default_exchange.publish(message, routing_key=self.consumed_queue)

    def client_publishes(self, hops: int) -> int:
        return 2


class DelayedExchange(Strategy):
    """The ``rabbitmq_delayed_message_exchange`` plugin: an ``x-delayed-message`` exchange
    and the ``x-delay`` header (ms), when the broker has the plugin enabled."""

    name = "delayed-exchange"
    counting = "client publishes: 1; dead-letters: 0 (the plugin stores messages itself)"

    @property
    def exchange(self) -> str:
        return f"{self.prefix}.delayed"

    async def unavailable(self, *, burst: bool = False) -> str | None:
        probe = f"{self.prefix}.probe"
        connection = await aio_pika.connect(self.node_url, name="bench-delayed-probe")
        try:
            async with connection.channel() as channel:
                await channel.declare_exchange(
                    probe, "x-delayed-message", arguments={"x-delayed-type": "direct"}
                )
                await channel.exchange_delete(probe)
        except (aiormq.exceptions.AMQPError, ConnectionError) as error:
            text = str(error.args[0] if error.args else error)
            return (
                "not available: this broker has no x-delayed-message exchange type "
                f"(plugin rabbitmq_delayed_message_exchange not enabled; broker said {text!r})"
            )
        finally:
            with contextlib.suppress(Exception):
                await connection.close()
        return None

    async def _declare(self, channel: aio_pika.abc.AbstractChannel) -> None:
        self.exchanges.append(self.exchange)
        exchange = await channel.declare_exchange(
            self.exchange, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"}
        )
        queue = await channel.declare_queue(self.target_queue, durable=True)
        await queue.bind(exchange, routing_key=self.target_queue)

    async def schedule(self, schedule_id: str, delay_us: int, body: bytes) -> None:
        assert self.channel is not None
        await self.publish_on(self.channel, schedule_id, delay_us, body)

    async def publish_on(
        self, channel: aio_pika.abc.AbstractChannel, schedule_id: str, delay_us: int, body: bytes
    ) -> None:
        delay_ms = -(-delay_us // 1000)
        message = self.message(
            schedule_id, now_us() + delay_us, body, headers={"x-delay": delay_ms}
        )
        exchange = await channel.get_exchange(self.exchange, ensure=False)
        # not mandatory: the plugin returns every delayed message as unroutable at publish
        await exchange.publish(message, routing_key=self.target_queue, mandatory=False)

    async def open_producer(self, index: int) -> Producer | None:
        return await _ChannelProducer(self, index).open()


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        HopschedQuorum,
        HopschedClassic,
        HopschedIngress,
        PerMessageTtl,
        SecondsLadder,
        ConsumerHold,
        DelayedExchange,
        BrokerFloor,
        BrokerFloorQuorum,
    )
}


def make_strategy(name: str, url: str, run_id: str, prefetch: int) -> Strategy:
    """The strategy ``name``; a hopsched one may name its ladder after a '/', as
    ``ladder_name`` labels it (``hopsched-quorum/ratio4``, ``hopsched-quorum/min1024``)."""
    base, _, label = name.partition("/")
    if label:
        cls = STRATEGIES[base]
        assert issubclass(cls, Hopsched), f"{base}: only hopsched strategies have a ladder"
        return cls(url, run_id, prefetch, ladder=parse_label(label))
    return STRATEGIES[name](url, run_id, prefetch)
