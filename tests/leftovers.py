"""Nothing left behind (F38): what a test run made on the test broker and did not remove.

A hopsched prefix left declared costs the broker 31 quorum queues (about 90 file handles
on RabbitMQ 3.10); a few such leftovers wedge a broker started with 1,024 descriptors for
everyone. ``snapshot()`` lists, through ``HOPSCHED_TEST_RABBITMQCTL``, the broker's
vhosts and users and, in each vhost, its queues, exchanges, policies and operator
policies. ``conftest.py`` takes one before the first test that uses the broker and one at
the end of the run: anything made in between and still there fails the run, is named
with how to remove it, and is removed (so the next run starts clean).
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["LeftoverCheck", "Thing", "advice", "remove", "snapshot"]

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


class LeftoverCheck:
    """The run's check: ``start()`` before the first test that uses the broker,
    ``finish()`` at the end. Without a rabbitmqctl (``command`` None) nothing is checked,
    and ``finish()`` says so."""

    def __init__(self, command: Sequence[str] | None) -> None:
        self.command = command
        self.before: frozenset[Thing] | None = None

    def start(self) -> None:
        if self.command is not None and self.before is None:
            self.before = snapshot(self.command)

    def finish(self) -> tuple[bool, list[str]]:
        """(passed, report lines): what this run left on the broker, now removed."""
        if self.command is None:  # conftest.py fails the run under CI=true
            return True, ["not checked: no rabbitmqctl (set HOPSCHED_TEST_RABBITMQCTL)"]
        if self.before is None:
            return True, []  # no test used the broker
        left = snapshot(self.command) - self.before
        if not left:
            return True, [f"nothing left on the broker ({len(self.before)} objects as before)"]
        problems = remove(self.command, left)
        lines = ["FAILED: this run left these on the broker:", *advice(left)]
        if problems:
            lines += ["and could not remove:", *(f"  {problem}" for problem in problems)]
        else:
            lines.append("(removed now; fix the test that made them)")
        return False, lines
