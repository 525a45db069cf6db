"""The relay's consumer of ``{prefix}.ingress``, on a connection of its own.

The ingress is a side entrance (``x-delay`` messages, docs/ingress.md); the ladder is
the relay's work. RabbitMQ answers a ``basic.consume`` on a quorum queue whose member
is down by closing the whole *connection* (541 INTERNAL_ERROR; seen on 3.10.8 with the
queue's Ra server stopped), and one still recovering after a crash may not answer at
all (a CI run: ``{prefix}.ingress`` silent for minutes after a ``kill -9``, while the
relay queue answered). On the relay's own connection either stopped every delivery.
Here, the relay relays the ladder meanwhile and this consumer tries again with
back-off, logging as ``RetryLog`` says; the ingress messages wait in their queue.

Its deliveries are handled by the session (``on_delivery``) and acked on its channel
once the publish they lead to, on the session's connection, is confirmed (``Ackers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pamqp import commands

from hopsched import amqp
from hopsched.amqp.acks import Ackers
from hopsched.connect import CONNECT_TIMEOUT_S, RECONNECT_FIRST_S, RECONNECT_MAX_S, RetryLog
from hopsched.errors import BrokerConnectionLost, BrokerUnavailableError, ChannelClosedError
from hopsched.topology import RELAY_CONSUMER_ARGUMENTS

__all__ = ["CONSUME_TIMEOUT_S", "WATCH_S", "IngressConsumer", "unconsumed"]

log = logging.getLogger("hopsched.relay")

#: How long a relay waits for ``basic.consume`` on a queue, s: a quorum queue still
#: starting after a node's restart (RabbitMQ 4.0.5) may never answer it, which held a
#: relay in a test, consuming nothing for over a minute. A healthy broker answers in
#: milliseconds, a loaded one in seconds.
CONSUME_TIMEOUT_S = 15.0

#: How often a consuming relay asks the broker whether the ingress is there and
#: consumed, s (``IngressConsumer._watch``): a passive declare.
WATCH_S = 5.0

#: What ends an attempt to consume the ingress (and is tried again).
_TROUBLE = (BrokerUnavailableError, BrokerConnectionLost, ChannelClosedError, OSError, TimeoutError)


class IngressConsumer:
    """Consumes ``queue`` on its own connection to ``url`` until ``close()``.

    Args:
        url: the node the relay's session is on (its connector's ``url``).
        queue: ``{prefix}.ingress``.
        prefetch: its consumer's prefetch (``basic.qos``), as the relay queue's.
        log_interval_s: once failures repeat, how often one is logged (``RetryLog``).
        acks: the session's ``Ackers``: its channel is added, and dropped once closed.
        on_delivery: called with each delivery, in the read that brought it.
        on_cancel: called if the broker cancels the consumer or the queue is gone (it
            was deleted): the session declares the prefix again (unless it was torn
            down), then calls ``consume_again()``.
        on_refused: called with the refusal if the broker answers 403 (no read
            permission): the session ends and the relay exits, as for its own queue.
        session_closed: the session's connection's ``closed``: once done, a failure
            here is the same loss, which the session handles (it closes this).
    """

    def __init__(
        self,
        *,
        url: str,
        queue: str,
        prefetch: int,
        log_interval_s: float,
        acks: Ackers,
        on_delivery: Callable[[amqp.Delivery], None],
        on_cancel: Callable[[], None],
        on_refused: Callable[[str], None],
        session_closed: asyncio.Future[Any],
    ) -> None:
        self.queue = queue
        self._params = amqp.ConnectionParams.from_url(url)
        self._prefetch = prefetch
        self._log_interval_s = log_interval_s
        self._acks = acks
        self._on_delivery = on_delivery
        self._on_cancel = on_cancel
        self._on_refused = on_refused
        self._session_closed = session_closed
        self._connection: amqp.Connection | None = None
        self._channel: amqp.Channel | None = None
        self._tag: str | None = None
        self._again = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ending = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"consume {self.queue}")

    def consume_again(self) -> None:
        """The prefix was declared again after the broker cancelled the consumer."""
        self._again.set()

    async def stop_consuming(self) -> None:
        """Cancel the consumer (a relay stopping): deliveries sent already still come."""
        await self._end_task()
        channel, tag = self._channel, self._tag
        self._tag = None
        if channel is not None and tag is not None:
            with contextlib.suppress(*_TROUBLE):
                await channel.cancel(tag)

    async def close(self, timeout_s: float) -> None:
        """Stop trying and close the connection: what is unacked goes back to the queue."""
        await self._end_task()
        await self._drop(timeout_s)

    async def _end_task(self) -> None:
        """Cancel the task until it ends: a cancel can be lost (Python 3.11's
        ``asyncio.wait_for`` returns, the cancel lost, when what it waits for completes
        at the same time; hopsched's own waits use ``asyncio.timeout``), and the
        session waits for this task as it ends (it waited for ever in one run)."""
        self._ending = True
        task = self._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)

    async def _run(self) -> None:
        delay, retries = RECONNECT_FIRST_S, RetryLog(self._log_interval_s)
        while not self._ending:
            try:
                await self._consume()
                if retries.failures:
                    log.info("consuming %s after %d failed tries", self.queue, retries.failures)
                    retries.reset()
                delay = RECONNECT_FIRST_S
                await self._watch()
                continue  # consume again
            except _TROUBLE as error:
                if self._session_closed.done():  # the broker went: the session says so
                    return
                if isinstance(error, ChannelClosedError) and error.reply_code == 403:
                    self._on_refused(
                        f"the broker refused ({error}): this needs read permission on {self.queue}"
                    )
                    return
                if isinstance(error, ChannelClosedError) and error.reply_code == 404:
                    log.warning("%s is gone; declaring the prefix's queues again", self.queue)
                    await self._drop(1.0)
                    self._on_cancel()  # as for a consumer the broker cancelled
                    await self._again.wait()
                    self._again.clear()
                    continue
                said, more = retries.say()
                if said:
                    log.error(
                        "cannot consume %s (%s): its x-delay messages wait there while the "
                        "ladder is relayed; trying again in %.1f s%s (docs/operations.md, "
                        '"An ingress queue that does not answer")',
                        self.queue,
                        _reason(error),
                        delay,
                        more,
                    )
            await self._drop(1.0)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _consume(self) -> None:
        """Connect and open a channel unless there is one; consume the queue."""
        if self._channel is None:
            connection = await amqp.connect(
                self._params, name="hopsched-relay-ingress", timeout_s=CONNECT_TIMEOUT_S
            )
            self._connection = connection
            channel = await connection.channel()
            await channel.qos(self._prefetch)
            self._acks.add(channel)
            self._channel = channel
        async with asyncio.timeout(CONSUME_TIMEOUT_S):
            self._tag = await self._channel.consume(
                self.queue,
                self._on_delivery,
                lambda _: self._on_cancel(),
                arguments=RELAY_CONSUMER_ARGUMENTS,
            )

    async def _watch(self) -> None:
        """While it consumes: return once the session asks for a consume again, or the
        broker lists no consumer of the queue (the old consumer cancelled, if still
        there); raise what ends it otherwise.

        Every ``WATCH_S`` a passive declare asks whether the queue is there and
        consumed: a quorum queue whose member stops (and one deleted then, which
        RabbitMQ forces) tells its consumers nothing, and answers a passive declare
        with no consumer (RabbitMQ 3.10.8); one deleted answers 404; one that does not
        answer within ``CONSUME_TIMEOUT_S`` is in trouble too.

        Raises:
            ChannelClosedError, BrokerConnectionLost: the channel or connection went
                (404: the queue is gone).
            TimeoutError: the passive declare was not answered.
        """
        channel, connection = self._channel, self._connection
        assert channel is not None
        assert connection is not None
        while True:
            waits: set[asyncio.Future[Any]] = {
                asyncio.ensure_future(asyncio.shield(channel.closed)),
                asyncio.ensure_future(asyncio.shield(connection.closed)),
                asyncio.ensure_future(self._again.wait()),
            }
            try:
                await asyncio.wait(waits, timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
            for closed in (channel.closed, connection.closed):
                if closed.done():
                    raise closed.result()
            if self._again.is_set():
                self._again.clear()
                break
            async with asyncio.timeout(CONSUME_TIMEOUT_S):
                declared = await channel.call(
                    commands.Queue.Declare(queue=self.queue, passive=True)
                )
            if unconsumed(self.queue, declared):
                break
        if self._tag is not None:  # consume again: the old consumer may be there still
            with contextlib.suppress(*_TROUBLE):
                await channel.cancel(self._tag)

    async def _drop(self, timeout_s: float) -> None:
        """Close the connection (a channel the broker may never answer is not waited
        for: the connection goes)."""
        connection, channel = self._connection, self._channel
        self._connection = self._channel = None
        self._tag = None
        if channel is not None:
            self._acks.discard(channel)
        if connection is not None:
            await connection.close(timeout_s=timeout_s)


def unconsumed(queue: str, declared: object) -> bool:
    """Whether ``declared``, the answer to a passive declare of ``queue``, which this
    relay consumes, lists no consumer (its quorum member stopped: ``_watch``); says so."""
    if isinstance(declared, commands.Queue.DeclareOk) and not declared.consumer_count:
        log.warning(
            "%s lists no consumer, though this relay consumes it (its quorum member "
            "stopped?); consuming it again",
            queue,
        )
        return True
    return False


def _reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return (
            f"it did not answer within {CONSUME_TIMEOUT_S:g} s: a quorum queue still "
            "starting after a broker restart?"
        )
    text = str(error)
    if "541" in text:
        text += " at its basic.consume: its quorum queue's member down?"
    return text
