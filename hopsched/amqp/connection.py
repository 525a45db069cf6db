"""An AMQP 0-9-1 connection on ``asyncio.Protocol``: handshake, heartbeats, blocking, close.

Writes are buffered and sent once per event-loop iteration (after the frames of one
read are handled, or on the next ``call_soon``), so a relay that acks and publishes
for a batch of deliveries makes one ``send()`` for all of them.

The broker's side of each step follows RabbitMQ's AMQP 0-9-1 reference
(https://www.rabbitmq.com/amqp-0-9-1-reference) and its extensions: publisher
confirms, consumer cancel notifications, ``connection.blocked``
(https://www.rabbitmq.com/docs/connection-blocked) and
``authentication_failure_close``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from pamqp import commands
from pamqp.base import Frame

from hopsched.amqp.channel import Channel
from hopsched.amqp.wire import (
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    FrameError,
    FrameReader,
    decode_method,
    method_frame,
)
from hopsched.errors import BrokerConnectionLost, BrokerUnavailableError
from hopsched.urls import mask_url

__all__ = ["Connection", "ConnectionParams", "connect", "silent_peer"]

log = logging.getLogger("hopsched.amqp")

#: RabbitMQ's default channel_max; a client may ask for fewer, never more.
_CHANNEL_MAX = 2047
_REPLY_SUCCESS = 200
_DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
#: How long lazily sent data (acks) may wait for other data to share a socket write, s:
#: paced at 500 messages/s, a relay's ack then rides with its next publish instead of
#: costing a write (and a loop iteration) of its own.
LAZY_SEND_S = 0.005
#: Bytes one read from the socket takes at most (asyncio's own reads take 256 KiB).
_READ_BUFFER_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionParams:
    """Where and how to connect, parsed from an AMQP URL.

    The query options are aio-pika's (and aiormq's), so one URL serves both:
    ``heartbeat`` (s), ``auth=external`` (TLS client certificate), ``cafile``,
    ``capath``, ``cadata``, ``certfile``, ``keyfile``, ``no_verify_ssl=1``, ``name``
    (``Settings`` checks them).
    """

    url: str
    host: str
    port: int
    vhost: str
    username: str
    password: str
    tls: bool
    heartbeat_s: int
    mechanism: str
    name: str | None
    options: dict[str, str]

    @classmethod
    def from_url(cls, url: str) -> ConnectionParams:
        """Raises ValueError: not an amqp(s) URL."""
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"{mask_url(url)}: not an amqp:// or amqps:// URL with a host")
        options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        return cls(
            url=url,
            host=parts.hostname,
            port=parts.port or _DEFAULT_PORTS[parts.scheme],
            vhost=unquote(path) if path else "/",
            username=unquote(parts.username or "guest"),
            password=unquote(parts.password or "guest"),
            tls=parts.scheme == "amqps",
            # 20 s: a frozen broker or a dead network is noticed within 40 s (two missed
            # heartbeats), where RabbitMQ's 60 s default would take two minutes.
            heartbeat_s=int(options.get("heartbeat", "20")),
            mechanism=options.get("auth", "plain").upper(),
            name=options.get("name"),
            options=options,
        )

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context the query options describe, or None for ``amqp://``."""
        if not self.tls:
            return None
        cadata = self.options.get("cadata")
        context = ssl.create_default_context(
            cafile=self.options.get("cafile"),
            capath=self.options.get("capath"),
            cadata=base64.b64decode(cadata) if cadata else None,  # DER, as aiormq reads it
        )
        if "certfile" in self.options:
            context.load_cert_chain(self.options["certfile"], self.options.get("keyfile"))
        if self.options.get("no_verify_ssl", "0") != "0":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


async def connect(
    params: ConnectionParams, *, name: str = "hopsched", timeout_s: float = 10.0
) -> Connection:
    """Open a connection: TCP, then TLS for ``amqps://``, the AMQP handshake,
    ``connection.open``; all within ``timeout_s``. A connect that raises leaves no
    socket open: it closes its own before raising, not in a later loop callback.

    Raises:
        BrokerUnavailableError: no TCP connection, TLS handshake or AMQP handshake
            within ``timeout_s`` (the text says which), login refused, vhost missing or
            not allowed; the text names the masked URL.
        OSError: the TCP connect failed, or TLS did (``ssl.SSLError``, also for a client
            certificate the broker refuses after the handshake, as TLS 1.3 does).
    """
    loop = asyncio.get_running_loop()
    connection = Connection(params, name=params.name or name)
    timed_out = (
        f"{params.masked_url}: no TCP connection within {timeout_s:g} s (a firewall "
        "dropping packets, or a host that is down)"
    )
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout_s):
            if params.tls:  # TCP first: a timeout in TLS is not one in TCP
                sock = await _tcp_connected(params.host, params.port)
                timed_out = silent_peer(params.masked_url, timeout_s, "TLS")
                await loop.create_connection(
                    lambda: connection,
                    sock=sock,
                    ssl=params.ssl_context(),
                    server_hostname=params.host,
                )
            else:
                await loop.create_connection(lambda: connection, params.host, params.port)
            timed_out = silent_peer(params.masked_url, timeout_s, "AMQP")
            await connection._handshake()
    except BaseException as error:
        connection.abort()
        # asyncio closes the socket of a connect it gave up on, and abort() closes ours,
        # in a loop callback queued by now: run it, so that nothing is left open for a
        # loop that ends first (seen in CI: the garbage collector found it open).
        with contextlib.suppress(BaseException):
            await asyncio.sleep(0)
        if sock is not None and sock.fileno() != -1:  # not taken by a transport
            sock.close()
        if isinstance(error, TimeoutError):
            raise BrokerUnavailableError(timed_out) from None
        raise
    return connection


async def _tcp_connected(host: str, port: int) -> socket.socket:
    """A TCP connection to the first of ``host``'s addresses that takes one.

    Raises:
        OSError: none did (the first address's error, or all of them if they differ).
    """
    loop = asyncio.get_running_loop()
    errors: list[OSError] = []
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as error:
            sock.close()
            errors.append(error)
        except BaseException:
            sock.close()
            raise
    if len({str(error) for error in errors}) <= 1:
        raise errors[0] if errors else OSError(f"{host}: no address to connect to")
    raise OSError(f"Multiple exceptions: {', '.join(map(str, errors))}")


def silent_peer(masked_url: str, timeout_s: float, handshake: str = "AMQP") -> str:
    """The error text for a peer that took the TCP connection but completed no
    ``handshake`` (TLS, or AMQP's ``connection.start``) within ``timeout_s``: most
    often a RabbitMQ that cannot answer (frozen, overloaded, out of file descriptors:
    it accepts connections it never serves), less often a port that is not the one
    meant (a peer speaking something else usually answers, and that is reported as
    malformed AMQP data or a TLS error)."""
    port = "5672, or 5671 for amqps" if handshake == "AMQP" else "5671 by default"
    sent = "sent no AMQP handshake" if handshake == "AMQP" else "completed no TLS handshake"
    return (
        f"{masked_url}: took the TCP connection but {sent} within "
        f"{timeout_s:g} s. A RabbitMQ that is frozen, overloaded or out of file "
        "descriptors does this (see its log, `rabbitmqctl status`); otherwise check that "
        f"this is its {handshake} port ({port})"
    )


class Connection(asyncio.BufferedProtocol):
    """One AMQP connection. Use ``connect()`` to open one.

    Attributes:
        frame_max: negotiated largest frame, bytes (RabbitMQ's default is 131,072).
        heartbeat_s: negotiated heartbeat interval, s (0: none).
        server_properties: what the broker said of itself in ``connection.start``.
        blocked: the broker's reason while it blocks publishers (``connection.blocked``,
            e.g. "low on memory"), else None.
        closed: done once the connection is gone; its result is the reason.
    """

    def __init__(self, params: ConnectionParams, *, name: str) -> None:
        self.params = params
        self.name = name
        self.frame_max = 131_072
        self.channel_max = _CHANNEL_MAX
        self.heartbeat_s = 0
        self.server_properties: dict[str, Any] = {}
        self.blocked: str | None = None
        self.on_blocked: list[Callable[[str | None], None]] = []
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[BrokerConnectionLost] = self._loop.create_future()
        self._lost = self._loop.create_future()  # done once the transport's socket is closed
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        # Reads go into this one buffer (``recv_into``): asyncio's plain protocols get a
        # new 256 KiB bytes per read, which glibc maps and unmaps each time (three
        # system calls and page faults per read, seen with strace on a paced relay).
        self._read_view = memoryview(bytearray(_READ_BUFFER_BYTES))
        self._out: list[bytes] = []
        self._flush_scheduled = False  # a flush is due at the end of this loop iteration
        self._lazy_flush: asyncio.TimerHandle | None = None  # only lazy data is waiting
        self._handshake_waiter: asyncio.Future[Frame] | None = None
        # Handshake methods not yet awaited: uvloop may read connection.start before the
        # coroutine that opened the connection is back to wait for it.
        self._handshake_methods: deque[Frame] | None = deque()
        self._channels: dict[int, Channel] = {}
        self._last_received = time.monotonic()
        self._last_sent = time.monotonic()
        self._heartbeat_timer: asyncio.TimerHandle | None = None
        self._close_ok: asyncio.Future[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    # --- asyncio.BufferedProtocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does what asyncio.Transport does without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(PROTOCOL_HEADER)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._read_view[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        self._last_received = time.monotonic()
        try:
            frames = self._reader.feed(data)
        except FrameError as error:
            self._fail(f"received malformed AMQP data ({error})")
            return
        channels = self._channels
        for kind, number, payload in frames:
            if number:
                channel = channels.get(number)
                if channel is not None:
                    channel.frame_received(kind, payload)
            elif kind == FRAME_METHOD:
                self._connection_method(payload)
            elif kind != FRAME_HEARTBEAT:
                self._fail(f"unexpected frame type {kind} on channel 0")
        if self._flush_scheduled:  # what the frames made us send, in this iteration
            self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        if self.closed.done():
            error = self.closed.result()
        else:
            reason = f"connection to {self.params.masked_url} lost"
            if exc is not None:
                reason += f" ({exc or type(exc).__name__})"
            error = BrokerConnectionLost(reason)
            error.__cause__ = exc
            self.closed.set_result(error)
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
        if self._lazy_flush is not None:
            self._lazy_flush.cancel()
        for waiter in (self._handshake_waiter, self._close_ok):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        for channel in list(self._channels.values()):
            channel.connection_lost(error)
        self._channels.clear()
        self._writable.set()  # wake writers: they find the connection closed

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # --- writing ---------------------------------------------------------------------------

    def send(self, data: bytes, *, lazy: bool = False) -> None:
        """Queue ``data`` for the socket; sent at the end of this loop iteration, or with
        ``lazy`` (acks) with whatever is sent next, ``LAZY_SEND_S`` later at the latest.
        Order is kept either way."""
        self._out.append(data)
        if self._flush_scheduled:
            return
        if not lazy:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        elif self._lazy_flush is None:
            self._lazy_flush = self._loop.call_later(LAZY_SEND_S, self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._lazy_flush is not None:
            self._lazy_flush.cancel()
            self._lazy_flush = None
        if not self._out:
            return
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out.clear()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self._last_sent = time.monotonic()

    @property
    def is_open(self) -> bool:
        return not self.closed.done()

    async def writable(self) -> None:
        """Return once the socket's send buffer is below its high-water mark."""
        await self._writable.wait()

    # --- channels --------------------------------------------------------------------------

    async def channel(self) -> Channel:
        """Open a new channel.

        Raises:
            BrokerConnectionLost: the connection is gone.
            BrokerUnavailableError: every channel number is in use.
        """
        if self.closed.done():
            raise self.closed.result().with_traceback(None)  # raised again and again
        number = next((n for n in range(1, self.channel_max + 1) if n not in self._channels), None)
        if number is None:
            raise BrokerUnavailableError(f"all {self.channel_max} channels are in use")
        channel = Channel(self, number)
        self._channels[number] = channel
        try:
            await channel.call(commands.Channel.Open())
        except BaseException:
            self._channels.pop(number, None)
            raise
        return channel

    def channel_released(self, number: int) -> None:
        """Called by a channel once the broker confirmed its close."""
        self._channels.pop(number, None)

    # --- connection methods ----------------------------------------------------------------

    def _connection_method(self, payload: bytes) -> None:
        try:
            method = decode_method(payload)
        except FrameError as error:
            self._fail(str(error))
            return
        if isinstance(method, commands.Connection.Close):
            self.send(method_frame(0, commands.Connection.CloseOk()))
            self._flush()
            text = f"{method.reply_code} {method.reply_text}"
            self._set_closed(
                BrokerConnectionLost(
                    f"the broker closed the connection to {self.params.masked_url}: {text}",
                    method.reply_code or 0,
                    method.reply_text or "",
                )
            )
            if self._transport is not None:
                self._transport.close()
        elif isinstance(method, commands.Connection.CloseOk):
            if self._close_ok is not None and not self._close_ok.done():
                self._close_ok.set_result(None)
        elif isinstance(method, commands.Connection.Blocked):
            self.blocked = method.reason or "blocked"
            log.warning(
                "the broker blocks publishing on %s: %s", self.params.masked_url, self.blocked
            )
            self._blocked_changed()
        elif isinstance(method, commands.Connection.Unblocked):
            self.blocked = None
            log.info("the broker unblocked publishing on %s", self.params.masked_url)
            self._blocked_changed()
        elif self._handshake_waiter is not None and not self._handshake_waiter.done():
            self._handshake_waiter.set_result(method)
        elif self._handshake_methods is not None:
            self._handshake_methods.append(method)
        else:
            self._fail(f"unexpected method {method.name} on channel 0")

    def _blocked_changed(self) -> None:
        """Run the ``on_blocked`` callbacks; one that raises is logged (raised into
        ``data_received`` it would drop the connection)."""
        for callback in self.on_blocked:
            try:
                callback(self.blocked)
            except Exception:
                log.exception("an on_blocked callback failed")

    def _set_closed(self, error: BrokerConnectionLost) -> None:
        if not self.closed.done():
            self.closed.set_result(error)

    def _fail(self, reason: str) -> None:
        """A protocol violation or a dead peer: drop the connection."""
        self._set_closed(BrokerConnectionLost(f"{self.params.masked_url}: {reason}"))
        self.abort()

    def abort(self) -> None:
        """Drop the connection at once, without the closing handshake."""
        if self._transport is not None:
            self._transport.abort()

    async def _next_method(self) -> Frame:
        if self._handshake_methods:
            return self._handshake_methods.popleft()
        if self.closed.done():
            raise self.closed.result()
        self._handshake_waiter = self._loop.create_future()
        try:
            return await self._handshake_waiter
        finally:
            self._handshake_waiter = None

    async def _handshake(self) -> None:
        params = self.params
        try:
            start = await self._next_method()
        except BrokerConnectionLost as error:
            if isinstance(error.__cause__, ssl.SSLError):
                # TLS 1.3: the client's handshake completes before the broker checks its
                # certificate, so a refusal (e.g. certificate required) comes as an alert
                # now; raised as the TLS error it is, like one during the handshake.
                raise error.__cause__ from None
            raise BrokerUnavailableError(
                f"{params.masked_url}: the peer closed the connection before the AMQP "
                "handshake; is this RabbitMQ's AMQP port?"
            ) from None
        if not isinstance(start, commands.Connection.Start):
            raise BrokerUnavailableError(f"{params.masked_url}: not an AMQP 0-9-1 broker")
        self.server_properties = dict(start.server_properties or {})
        offered = (start.mechanisms or "").split()
        if params.mechanism not in offered:
            raise BrokerUnavailableError(
                f"{params.masked_url}: the broker offers authentication {offered}, not "
                f"{params.mechanism} (URL option auth=)"
            )
        response = f"\0{params.username}\0{params.password}" if params.mechanism == "PLAIN" else ""
        self.send(
            method_frame(
                0,
                commands.Connection.StartOk(
                    client_properties=_client_properties(self.name),
                    mechanism=params.mechanism,
                    response=response,
                ),
            )
        )
        tune = await self._expect(commands.Connection.Tune, "login")
        self.channel_max = min(tune.channel_max or _CHANNEL_MAX, _CHANNEL_MAX)
        self.frame_max = tune.frame_max or self.frame_max
        self._reader.frame_max = self.frame_max
        self.heartbeat_s = params.heartbeat_s
        self.send(
            method_frame(
                0,
                commands.Connection.TuneOk(
                    channel_max=self.channel_max,
                    frame_max=self.frame_max,
                    heartbeat=self.heartbeat_s,
                ),
            )
        )
        self.send(method_frame(0, commands.Connection.Open(virtual_host=params.vhost)))
        await self._expect(commands.Connection.OpenOk, "open")
        self._handshake_methods = None  # from now on, an unexpected method fails
        if self.heartbeat_s:
            self._schedule_heartbeat()

    async def _expect(self, kind: type[Any], step: str) -> Any:
        params = self.params
        try:
            method = await self._next_method()
        except BrokerConnectionLost as error:
            said = f"{error.reply_code} {error.reply_text}" if error.reply_code else "no reason"
            if step == "login":
                raise BrokerUnavailableError(
                    f"{params.masked_url}: login refused ({said}); check the user name and "
                    "password in the URL (percent-encode '/', '#', '?', '@' and ':' in them)"
                ) from None
            raise BrokerUnavailableError(
                f"{params.masked_url}: the broker refused the vhost {params.vhost!r} ({said}); "
                "check that it exists and the user may use it "
                "(rabbitmqctl list_permissions -p VHOST)"
            ) from None
        if not isinstance(method, kind):
            raise BrokerUnavailableError(
                f"{params.masked_url}: expected {kind.__name__} while {step}, got {method.name}"
            )
        return method

    # --- heartbeats ------------------------------------------------------------------------

    def _schedule_heartbeat(self) -> None:
        self._heartbeat_timer = self._loop.call_later(self.heartbeat_s / 2, self._heartbeat)

    def _heartbeat(self) -> None:
        """Send a heartbeat if nothing else went out lately; drop a silent broker.

        RabbitMQ considers a peer dead after two missed heartbeats
        (https://www.rabbitmq.com/docs/heartbeats); so does this side.
        """
        now = time.monotonic()
        if now - self._last_received > 2 * self.heartbeat_s:
            self._fail(
                f"no data from the broker for {now - self._last_received:.0f} s "
                f"(heartbeat {self.heartbeat_s} s): it is frozen or the network is down"
            )
            return
        if now - self._last_sent >= self.heartbeat_s / 2 and self._transport is not None:
            self.send(HEARTBEAT_FRAME)
        self._schedule_heartbeat()

    # --- closing ---------------------------------------------------------------------------

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close cleanly (``connection.close``), or drop it after ``timeout_s``.

        A broker that blocks this connection (a resource alarm) reads nothing from it,
        so its ``close-ok`` never comes: the timeout bounds the wait.
        """
        if self.closed.done() or self._transport is None:
            self.abort()
            if self._transport is not None:  # lost already, or being closed: its socket too
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel
                # that comes as the socket's loss completes (a relay session then
                # waited for ever on a task that was to stop)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout_s):
                        await asyncio.shield(self._lost)
            return
        self._close_ok = self._loop.create_future()
        self.send(
            method_frame(
                0,
                commands.Connection.Close(
                    reply_code=_REPLY_SUCCESS,
                    reply_text="closed by hopsched",
                    class_id=0,
                    method_id=0,
                ),
            )
        )
        self._set_closed(BrokerConnectionLost(f"connection to {self.params.masked_url} closed"))
        try:
            async with asyncio.timeout(timeout_s):
                await self._close_ok
                # TLS closes with its own exchange (close_notify) after close-ok: the
                # socket is open until then, and a loop that ended first left it to the
                # garbage collector (seen in CI)
                self._transport.close()
                await asyncio.shield(self._lost)
        except (TimeoutError, BrokerConnectionLost):
            # No close-ok: a blocked broker reads nothing more, so transport.close()
            # would wait for ever to send what is still buffered; drop it instead.
            self.abort()
            with contextlib.suppress(BaseException):
                await asyncio.sleep(0)  # abort() closes the socket in a callback queued now
        except BaseException:
            # Cancelled while waiting (a task stopped in its ``finally``, a test's loop
            # ending): drop it, or its socket is left open to the garbage collector.
            self.abort()
            raise


def _client_properties(name: str) -> dict[str, Any]:
    return {
        "product": "hopsched",
        "connection_name": name,
        "capabilities": {
            "authentication_failure_close": True,
            "basic.nack": True,
            "connection.blocked": True,
            "consumer_cancel_notify": True,
            "publisher_confirms": True,
        },
    }
