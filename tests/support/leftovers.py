"""Nothing left behind (F38), and nothing of anyone else's touched (F40).

A hopsched prefix left declared costs the broker 31 quorum queues (about 90 file handles
on RabbitMQ 3.10); a few such leftovers wedge a broker started with 1,024 descriptors for
everyone. ``snapshot()`` lists, through ``HOPSCHED_TEST_RABBITMQCTL``, the broker's
vhosts and users and, in each vhost, its queues, exchanges, policies and operator
policies. ``conftest.py`` takes one before the first test that uses the broker and one at
the end of the run.

The test broker is often shared (a development broker, CI's, other people's work on it
at the same time), so the check tells the run's objects from everyone else's by name:
every name a test gives a broker object carries the run's marker (``support.RUN_MARKER``).
What carries it and is still there at the end fails the run, is named with how to remove
it, and is removed; anything else that appeared or went meanwhile is only reported, never
removed (F40: a check that removed every new object deleted another user's prefix in the
middle of its ``hopsched upgrade``). Before the first snapshot, ``start()`` proves that
``rabbitmqctl`` reaches the broker of the test URL: it looks for a queue it has just
declared there over AMQP, and refuses the run if it is not listed.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = ["LeftoverCheck", "NotTheTestBroker", "Thing", "advice", "remove", "snapshot"]

#: rabbitmqctl's list command for each kind of object in a vhost, and its name field.
_IN_VHOST = {
    "queue": ("list_queues", "name"),
    "exchange": ("list_exchanges", "name"),
    "policy": ("list_policies",),
    "operator policy": ("list_operator_policies",),
}
#: ... and how to remove one (queues and exchanges of a removed vhost go with it).
_REMOVE = {
    "queue": ("delete_queue",),
    "policy": ("clear_policy",),
    "operator policy": ("clear_operator_policy",),
}
_TIMEOUT_S = 60
#: Names listed per kind in a report of other people's changes, before "and N more".
_REPORTED_NAMES = 10


class NotTheTestBroker(Exception):
    """``rabbitmqctl`` does not reach the broker of the test URL (or does not work)."""


@dataclass(frozen=True, order=True)
class Thing:
    """One object on the broker: ``kind`` is ``vhost``, ``user``, ``queue``,
    ``exchange``, ``policy`` or ``operator policy``; ``vhost`` is None for the first two."""

    kind: str
    name: str
    vhost: str | None = None

    def __str__(self) -> str:
        where = f" in vhost {self.vhost!r}" if self.vhost is not None else ""
        return f"{self.kind} {self.name!r}{where}"


def _rabbitmqctl(command: Sequence[str], *args: str) -> str:
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout


def _listed(command: Sequence[str], *args: str) -> list[dict[str, object]]:
    rows = json.loads(_rabbitmqctl(command, *args, "-q", "--formatter", "json") or "[]")
    assert isinstance(rows, list), rows
    return rows


def snapshot(command: Sequence[str]) -> frozenset[Thing]:
    """Every vhost, user, and per vhost every queue, exchange, policy and operator
    policy of the broker ``command`` (a rabbitmqctl command prefix) reaches.

    Raises:
        RuntimeError: a rabbitmqctl call failed.
    """
    vhosts = [str(row["name"]) for row in _listed(command, "list_vhosts", "name")]
    things = {Thing("vhost", vhost) for vhost in vhosts}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        users = pool.submit(_listed, command, "list_users")
        lists = {
            (kind, vhost): pool.submit(_listed, command, listing, "-p", vhost, *fields)
            for vhost in vhosts
            for kind, (listing, *fields) in _IN_VHOST.items()
        }
        things |= {Thing("user", str(row["user"])) for row in users.result()}
        for (kind, vhost), rows in lists.items():
            things |= {Thing(kind, str(row["name"]), vhost) for row in rows.result()}
    return frozenset(things)


def remove(command: Sequence[str], things: Iterable[Thing]) -> list[str]:
    """Remove ``things`` (vhosts first: what is in them goes with them); return what
    could not be removed, and why. An exchange is removed by ``remove_exchange``."""
    things = sorted(things, key=lambda thing: thing.kind != "vhost")
    gone_vhosts = {thing.name for thing in things if thing.kind == "vhost"}
    problems: list[str] = []
    for thing in things:
        if thing.vhost in gone_vhosts:
            continue
        try:
            if thing.kind == "vhost":
                _rabbitmqctl(command, "delete_vhost", thing.name)
            elif thing.kind == "user":
                _rabbitmqctl(command, "delete_user", thing.name)
            elif thing.kind in _REMOVE:
                _rabbitmqctl(command, *_REMOVE[thing.kind], "-p", str(thing.vhost), thing.name)
            else:
                _rabbitmqctl(command, "eval", _delete_exchange(thing))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            problems.append(f"{thing}: {error}")
    return problems


def _delete_exchange(thing: Thing) -> str:
    """An Erlang expression deleting exchange ``thing`` (rabbitmqctl has no command for
    it; ``rabbit_exchange:delete/3`` is the same on RabbitMQ 3.10 and 4.x)."""
    vhost, name = (json.dumps(value, ensure_ascii=False) for value in (thing.vhost, thing.name))
    return (
        f"rabbit_exchange:delete(rabbit_misc:r(<<{vhost}/utf8>>, exchange, "
        f'<<{name}/utf8>>), false, <<"hopsched-tests">>).'
    )


def advice(things: Iterable[Thing]) -> list[str]:
    """One line per leftover, then the hopsched prefixes among them (names before the
    first dot) with the command that removes each."""
    things = sorted(things)
    new_vhosts = {thing.name for thing in things if thing.kind == "vhost"}
    things = [thing for thing in things if thing.vhost not in new_vhosts]  # go with it
    prefixes = sorted(
        {t.name.split(".", 1)[0] for t in things if t.kind == "queue" and "." in t.name}
    )
    lines = [f"  {thing}" for thing in things]
    lines += [f"  (hopsched teardown --force --prefix {prefix})" for prefix in prefixes]
    return lines


def _changes(things: Iterable[Thing], verb: str) -> list[str]:
    """Report lines for other people's objects: up to ``_REPORTED_NAMES`` per kind."""
    by_kind: dict[str, list[Thing]] = {}
    for thing in sorted(things):
        by_kind.setdefault(thing.kind, []).append(thing)
    lines = []
    for kind, listed in by_kind.items():
        shown = ", ".join(repr(thing.name) for thing in listed[:_REPORTED_NAMES])
        more = f" and {len(listed) - _REPORTED_NAMES} more" if len(listed) > _REPORTED_NAMES else ""
        lines.append(f"  {len(listed)} {kind}(s) {verb}: {shown}{more}")
    return lines


class LeftoverCheck:
    """The run's check: ``start(probe)`` before the first test that uses the broker,
    ``finish()`` at the end. Only objects whose names contain ``marker`` are the run's.
    Without a rabbitmqctl (``command`` None) nothing is checked, and ``finish()`` says so."""

    def __init__(self, command: Sequence[str] | None, marker: str) -> None:
        self.command = command
        self.marker = marker
        self.before: frozenset[Thing] | None = None

    def start(self, probe: Callable[[Callable[[], frozenset[Thing]]], Thing]) -> None:
        """Take the first snapshot. ``probe(take)`` declares a queue carrying the marker
        on the broker of the test URL, calls ``take()`` (the snapshot) while the queue
        exists, and returns that queue as a ``Thing``.

        Raises:
            NotTheTestBroker: the snapshot does not list the probe's queue (``rabbitmqctl``
                reaches another node), or a rabbitmqctl call failed.
        """
        if self.command is None or self.before is not None:
            return
        command = self.command
        taken: list[frozenset[Thing]] = []

        def take() -> frozenset[Thing]:
            taken.append(snapshot(command))
            return taken[-1]

        try:
            queue = probe(take)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            raise NotTheTestBroker(
                f"rabbitmqctl ({' '.join(command)}) failed: {error}. Set "
                "HOPSCHED_TEST_RABBITMQCTL to a command that runs rabbitmqctl against the "
                "broker of HOPSCHED_TEST_URL."
            ) from error
        if queue not in taken[-1]:
            raise NotTheTestBroker(
                f"rabbitmqctl ({' '.join(command)}) reaches another broker than the test "
                f"URL: the {queue} just declared there is not in its listing. The tests "
                "would list, and report on, the wrong broker. Set HOPSCHED_TEST_RABBITMQCTL "
                "to a command that reaches the broker of HOPSCHED_TEST_URL (e.g. "
                "'rabbitmqctl -n NODE@HOST' of that node)."
            )
        self.before = taken[-1] - {queue}

    def finish(self) -> tuple[bool, list[str]]:
        """(passed, report lines): what this run left on the broker (now removed), and
        what others changed meanwhile (reported, never removed)."""
        if self.command is None:  # conftest.py fails the run under CI=true
            return True, ["not checked: no rabbitmqctl (set HOPSCHED_TEST_RABBITMQCTL)"]
        if self.before is None:
            return True, []  # no test used the broker
        after = snapshot(self.command)
        new = after - self.before
        mine = {thing for thing in new if self.marker in f"{thing.name} {thing.vhost or ''}"}
        lines = []
        theirs_new = new - mine
        theirs_gone = self.before - after
        if theirs_new or theirs_gone:
            lines.append(
                f"others changed the broker during the run (not this run's marker "
                f"{self.marker!r}; reported only, never removed):"
            )
            lines += _changes(theirs_new, "appeared") + _changes(theirs_gone, "went")
        if not mine:
            lines.append(f"nothing of this run ({self.marker}) left on the broker")
            return True, lines
        problems = remove(self.command, mine)
        lines += [f"FAILED: this run ({self.marker}) left these on the broker:", *advice(mine)]
        if problems:
            lines += ["and could not remove:", *(f"  {problem}" for problem in problems)]
        else:
            lines.append("(removed now; fix the test that made them)")
        return False, lines
