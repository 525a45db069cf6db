"""What every ``hopsched`` command shares: exit statuses, one-line failures, the
connection options, settings from the environment, and running a coroutine."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

import click

from hopsched.cli.durations import parse_duration
from hopsched.cli.logs import configure_logging
from hopsched.errors import (
    HopschedError,
    InvalidScheduleError,
    InvalidSettingsError,
    PrefixNotDeclaredError,
)
from hopsched.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

#: Bad input: a usage error, a setting or a message hopsched cannot use; nothing was done.
EXIT_BAD_INPUT = 2
#: ``parked replay``: some messages asked for were not replayed (not parked, or left parked).
EXIT_NOT_REPLAYED = 3
#: ``get``, ``reschedule``: the journal knows no (pending) schedule of that id; also
#: ``cancel``, ``reschedule``: one that is not this login's to change.
EXIT_UNKNOWN = 3
#: Nothing of the prefix exists where the command needs it (a mistyped --prefix?):
#: nothing was done (scheduled, cancelled, upgraded, removed).
EXIT_NO_PREFIX = 4
#: ``schedule`` interrupted (Ctrl-C) before the broker confirmed: it may or may not be
#: scheduled (128 + SIGINT, as a shell reports a process Ctrl-C ended).
EXIT_INTERRUPTED = 130
#: ``schedule --at`` further in the past than this (µs) gets a warning.
PAST_WARNING_US = 60_000_000
#: ``Context.meta`` key: ``main()`` has configured logging.
LOGGING_SET = "hopsched.logging"
#: ``upgrade`` prints a progress line every this many messages moved.
PROGRESS_EVERY = 1000
#: ``pending`` writes its lines this many at a time: ``click.echo`` writes and flushes
#: each call, a quarter of the listing's time when it was called per line.
LINES_PER_WRITE = 1000


class Failure(click.ClickException):
    """A one-line ``Error:``, exit status 1."""


class BadInput(Failure):
    exit_code = EXIT_BAD_INPUT


class NoPrefix(Failure):
    exit_code = EXIT_NO_PREFIX


class Unknown(Failure):
    exit_code = EXIT_UNKNOWN


class Interrupted(Failure):
    exit_code = EXIT_INTERRUPTED


class JsonFailure(click.ClickException):
    """A command's error, shown as a JSON log line (``--log-format json``)."""

    def __init__(self, error: click.ClickException) -> None:
        super().__init__(error.format_message())
        self.exit_code = error.exit_code  # type: ignore[misc]  # click's is a ClassVar

    def show(self, file: Any = None) -> None:
        logging.getLogger("hopsched.cli").error("%s", self.message)


class CommandGroup(click.Group):
    """The ``hopsched`` group: with ``--log-format json`` a command's error (usage errors
    included) is a JSON line like every other, not click's text."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as error:
            if ctx.params.get("log_format") == "json":
                if not ctx.meta.get(LOGGING_SET):  # an unknown command: main() did not run
                    configure_logging(0, "json")
                raise JsonFailure(error) from None
            raise


def connection_options(command: F) -> F:
    """--url, --prefix, --queue-type; each defaults to its HOPSCHED_* variable."""
    for option in reversed(
        [
            click.option(
                "--url",
                help="AMQP URL, or the URLs of a cluster's nodes comma-separated "
                "[env HOPSCHED_URL; default local guest].",
            ),
            click.option(
                "--prefix",
                help="Namespace of the broker objects [env HOPSCHED_PREFIX; default hopsched].",
            ),
            click.option(
                "--queue-type",
                type=click.Choice(["quorum", "classic"]),
                help="Queue type of the ladder [HOPSCHED_QUEUE_TYPE; default quorum].",
            ),
        ]
    ):
        command = option(command)
    return command


def settings_from_env(**overrides: Any) -> Settings:
    try:
        return Settings.from_env(**overrides)
    except HopschedError as error:
        raise BadInput(str(error)) from None


def run(
    coroutine: Coroutine[Any, Any, Any],
    settings: Settings | None = None,
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> Any:
    """Run ``coroutine`` (on ``loop_factory``'s loop if given); a HopschedError becomes a
    one-line error: exit status 2 for bad input, 4 for a prefix that is not there
    (``settings`` name its URL), 1 for anything else (broker unreachable, topology
    mismatch)."""
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(coroutine)
    except (InvalidScheduleError, InvalidSettingsError) as error:
        raise BadInput(str(error)) from None
    except PrefixNotDeclaredError as error:
        where = f"{settings.masked_url}: " if settings is not None else ""
        raise NoPrefix(f"{where}{error}") from None
    except HopschedError as error:
        raise Failure(str(error)) from None


async def cancelled_by_sigterm(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Await ``coroutine``; SIGTERM cancels it as Ctrl-C does, so that its clean-up runs
    (a demo's throwaway node outlived a ``kill`` or ``timeout``). None if it did."""
    task = asyncio.ensure_future(coroutine)
    loop = asyncio.get_running_loop()
    terminated = asyncio.Event()

    def on_sigterm() -> None:
        terminated.set()
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await task
    except asyncio.CancelledError:
        if terminated.is_set():
            return None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def parse_at(_: click.Context, __: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: use ISO 8601, e.g. 2030-01-01T09:00:00Z") from None
    if at.tzinfo is None:
        example = at.isoformat()
        raise click.BadParameter(
            f"{value!r} has no UTC offset; add one, e.g. {example}Z or {example}+01:00"
        )
    return at


def parse_in(_: click.Context, __: click.Parameter, value: str | None) -> Any:
    try:
        return None if value is None else parse_duration(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
