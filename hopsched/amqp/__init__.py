"""A lean AMQP 0-9-1 client on pamqp's codec, for the relay's and ``schedule()``'s hot path.

It does what those paths need and nothing else: connection negotiation (PLAIN and
EXTERNAL authentication, TLS, vhost), heartbeats, ``connection.blocked``, channels
with publisher confirms (ack, nack, ``basic.return`` for ``mandatory``),
consumers with manual acks, ``channel.flow``, broker-side consumer cancels, and
closes reported as hopsched errors. aio-pika remains the public surface (callers
pass ``aio_pika.Message``) and runs everything off the hot path.

Why: a bare aiormq consume -> confirmed publish -> ack loop costs ~580 µs of CPU per
message here, most of it client machinery (tasks, futures, queues, one ``send()``
per frame); on this codec with callbacks and writes coalesced per read the same
loop costs ~100 µs.
"""

from hopsched.amqp.channel import Channel, ConfirmCallback, Delivery, Outcome, Returned
from hopsched.amqp.connection import Connection, ConnectionParams, connect, silent_peer
from hopsched.amqp.wire import Properties, Table

__all__ = [
    "Channel",
    "ConfirmCallback",
    "Connection",
    "ConnectionParams",
    "Delivery",
    "Outcome",
    "Properties",
    "Returned",
    "Table",
    "connect",
    "silent_peer",
]
