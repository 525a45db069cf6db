"""Every broker object's name and arguments, built in one place, and ``declare()``."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq

from hopsched.errors import AccessRefusedError, TopologyMismatchError
from hopsched.ladder import Ladder
from hopsched.settings import QueueType, Settings

__all__ = ["DEAD_LETTER_ROUTING_KEY", "Permissions", "Topology"]

#: Every step queue dead-letters with this routing key, whatever key the message had.
DEAD_LETTER_ROUTING_KEY = "expired"

_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for (?P<kind>queue|exchange) '(?P<queue>[^']+)' "
    r"in vhost '[^']*': "
    r"received (?P<received>.+?) but current is (?P<current>.+)$"
)
# How RabbitMQ 3.x words an argument value in that message.
_VALUE = re.compile(
    r"^(?:the value '(?P<typed>.*)' of type '[^']*'|'(?P<quoted>.*)'|(?P<bare>.*))$"
)


@dataclass(frozen=True, slots=True)
class Permissions:
    """A user's RabbitMQ permissions in one vhost: three regexes matched against
    exchange and queue names (https://www.rabbitmq.com/docs/access-control)."""

    configure: str
    write: str
    read: str

    def command(self, user: str, vhost: str = "/") -> str:
        """The ``rabbitmqctl set_permissions`` command line that grants them."""
        return shlex.join(
            [
                "rabbitmqctl",
                "set_permissions",
                "-p",
                vhost,
                user,
                self.configure,
                self.write,
                self.read,
            ]
        )


@dataclass(frozen=True, slots=True)
class Topology:
    """Names and arguments of the ladder's queues and exchange for one prefix.

    * step queues ``{prefix}.step.{ttl_ms}``: durable, ``x-message-ttl``, dead-lettered
      to ``{prefix}.expired`` with routing key ``expired``; no ``x-expires``, no length
      limit;
    * direct exchange ``{prefix}.expired`` bound to queue ``{prefix}.relay``;
    * queue ``{prefix}.parked`` for what the relay cannot deliver.

    Quorum queues get ``x-dead-letter-strategy=at-least-once`` and
    ``x-overflow=reject-publish`` (required by that strategy,
    https://www.rabbitmq.com/docs/quorum-queues#dead-lettering; RabbitMQ >= 3.10).
    """

    prefix: str
    ladder: Ladder
    queue_type: QueueType

    @classmethod
    def from_settings(cls, settings: Settings) -> Topology:
        return cls(settings.prefix, settings.ladder, settings.queue_type)

    @property
    def expired_exchange(self) -> str:
        return f"{self.prefix}.expired"

    @property
    def relay_queue(self) -> str:
        return f"{self.prefix}.relay"

    @property
    def parked_queue(self) -> str:
        return f"{self.prefix}.parked"

    def step_queue(self, step_ms: int) -> str:
        return f"{self.prefix}.step.{step_ms}"

    @property
    def step_queues(self) -> tuple[str, ...]:
        return tuple(self.step_queue(step) for step in self.ladder.steps)

    def permissions(self, target_exchanges: Iterable[str] = ()) -> Permissions:
        """The least a scheduler and relay on this prefix need, delivering to
        ``target_exchanges`` ("" is the default exchange).

        * configure: declare the prefix's queues and exchange;
        * write: publish to ``amq.default`` (hops, parking, targets on the default
          exchange), to ``{prefix}.expired`` (messages due at once) and to the target
          exchanges; bind ``{prefix}.relay``;
        * read: consume ``{prefix}.relay``, get ``{prefix}.parked``, bind from
          ``{prefix}.expired``, and declare step queues: a queue with a dead-letter
          exchange needs read on itself and write on that exchange
          (https://www.rabbitmq.com/docs/dlx#security).

        Write on ``amq.default`` reaches every queue of the vhost by name: limit final
        targets with ``Settings.allowed_targets`` (relay ``--allow-target``).
        """
        prefix = re.escape(self.prefix) + r"\."
        targets = sorted({re.escape(name) for name in target_exchanges if name})
        write = "|".join([rf"{prefix}(expired|relay)", r"amq\.default", *targets])
        own = rf"^{prefix}(step\.[0-9]+|expired|relay|parked)$"
        return Permissions(configure=own, write=f"^({write})$", read=own)

    def _queue_arguments(self) -> dict[str, Any]:
        if self.queue_type == "quorum":
            return {"x-queue-type": "quorum"}
        return {"x-queue-type": "classic"}

    def step_arguments(self, step_ms: int) -> dict[str, Any]:
        """Arguments of the step queue whose TTL is ``step_ms`` ms."""
        arguments = self._queue_arguments()
        arguments.update(
            {
                "x-message-ttl": step_ms,
                "x-dead-letter-exchange": self.expired_exchange,
                "x-dead-letter-routing-key": DEAD_LETTER_ROUTING_KEY,
            }
        )
        if self.queue_type == "quorum":
            arguments["x-dead-letter-strategy"] = "at-least-once"
            arguments["x-overflow"] = "reject-publish"
        return arguments

    def queues(self) -> dict[str, dict[str, Any]]:
        """Every queue's name and declare arguments: steps, relay, parked."""
        queues = {self.step_queue(s): self.step_arguments(s) for s in self.ladder.steps}
        queues[self.relay_queue] = self._queue_arguments()
        queues[self.parked_queue] = self._queue_arguments()
        return queues

    async def declare(self, connection: aio_pika.abc.AbstractConnection) -> None:
        """Declare everything, idempotently (safe to run from every process).

        Raises:
            TopologyMismatchError: a queue exists with other arguments (AMQP 406);
                names the queue, the argument and the fix. Not worth retrying.
            AccessRefusedError: the user may not declare them (AMQP 403).
        """
        declaring = self.expired_exchange
        async with connection.channel(publisher_confirms=False) as channel:
            try:
                exchange = await channel.declare_exchange(
                    self.expired_exchange, aio_pika.ExchangeType.DIRECT, durable=True
                )
                for name, arguments in self.queues().items():
                    declaring = name
                    queue = await channel.declare_queue(name, durable=True, arguments=arguments)
                    if name == self.relay_queue:
                        await queue.bind(exchange, routing_key=DEAD_LETTER_ROUTING_KEY)
            except aiormq.exceptions.ChannelPreconditionFailed as error:
                raise await self._explain(connection, declaring, error) from None
            except aiormq.exceptions.ChannelAccessRefused as error:
                raise AccessRefusedError(
                    f"declaring {declaring!r}: {error.args[0] if error.args else error}. "
                    f"Every hopsched process declares its prefix's queues and exchange, so "
                    f"its user needs configure, write and read permission on "
                    f"'^{re.escape(self.prefix)}\\.' (rabbitmqctl set_permissions)"
                ) from None

    async def _explain(
        self,
        connection: aio_pika.abc.AbstractConnection,
        queue: str,
        error: aiormq.exceptions.ChannelPreconditionFailed,
    ) -> TopologyMismatchError:
        """The mismatch, named by its root cause where that is the queue type.

        RabbitMQ names only the first argument that differs, which for a quorum/classic
        mix is a quorum-only one (x-dead-letter-strategy, x-overflow). Redeclaring with
        the other type's arguments, a no-op if they match, tells the real difference.
        """
        text = str(error.args[0] if error.args else error)
        if queue not in self.queues():
            return _mismatch(text)
        other: QueueType = "classic" if self.queue_type == "quorum" else "quorum"
        try:
            async with connection.channel(publisher_confirms=False) as channel:
                arguments = Topology(self.prefix, self.ladder, other).queues()[queue]
                await channel.declare_queue(queue, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            return _mismatch(text)
        return TopologyMismatchError(queue, "x-queue-type", self.queue_type, other, text)


def _mismatch(text: str) -> TopologyMismatchError:
    match = _INEQUIVALENT.search(text)
    if match is None:
        return TopologyMismatchError("?", "?", "?", "?", text)
    return TopologyMismatchError(
        match["queue"],
        match["arg"],
        _unquote(match["received"]),
        _unquote(match["current"]),
        text,
        kind=match["kind"],
    )


def _unquote(value: str) -> str:
    match = _VALUE.match(value.strip())
    assert match is not None  # the pattern's last branch matches anything
    result = match["typed"] if match["typed"] is not None else match["quoted"]
    if result is None:
        result = "(not set)" if match["bare"] == "none" else match["bare"]
    return result
