"""The policies in force on a prefix's queues: read them, protect the queues, watch them.

* ``read_report`` asks the management API (``hopsched.broker.management``) what it applies to
  each queue of the prefix and turns that into a ``PolicyReport`` (``hopsched.broker.policies``);
  ``hopsched status`` and ``hopsched policies check`` print it.
* ``protect`` sets hopsched's protective policies (``policies.protective_policies``), which
  keep every other user policy off the prefix's queues; ``unprotect`` removes them.
* ``PolicyWatch`` runs inside every relay: it reads the report every ``CHECK_INTERVAL_S``,
  logs each risk as an ERROR (a WARNING for extra hops) when it appears and again every
  log interval while it stands, sets the ``hopsched_policy_*`` metrics, and keeps in use
  every queue an ``expires`` applies to, so that the broker never deletes it while a
  relay runs. Without the management API it says so (a WARNING every hour and
  ``hopsched_policy_unchecked``) and, not knowing the leases, keeps every queue an
  ``expires`` could delete in use every ``UNCHECKED_TOUCH_INTERVAL_S``; the relay's other
  defences do not need it (a deleted queue is declared again, a hop that comes back
  early waits: ``hopsched.core.decide``).

Keeping a queue in use (what resets an ``expires`` lease, measured on RabbitMQ 3.10.8
and 4.0.5): for a classic queue, a passive ``queue.declare``; a quorum queue only counts a
consumer or a ``basic.get`` (``rabbit_fifo``'s ``last_active``). On RabbitMQ 3.x a quorum
queue gets a consumer given no credit (``hopsched.broker.idle_consumers``): it takes no
message, and the queue's messages expire on time under it. On 4.x, which ignores that
credit, a quorum step queue gets a ``basic.get``: an empty one is renewed, a message got
is returned to it (``requeue=true``), where its TTL runs on (4.0.5 expires it on time; a
reject would pull it out of the ladder into the relay every few seconds). 3.10.8 expired
a busy step's returned heads up to 8 s late, which is why 3.x does not get this. The
quorum parking queue on 4.x moves the message it got to its tail (published with a
confirm, then acked: a return counts towards its delivery limit, past which it drops the
message). The relay consumes ``{prefix}.relay`` and ``{prefix}.ingress``, and a stream
ignores ``expires``: none of them is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import aio_pika
import aiormq
from pamqp.commands import Basic

from hopsched.broker.idle_consumers import IdleConsumers
from hopsched.broker.management import ManagementClient
from hopsched.broker.policies import (
    PROTECT_PRIORITY,
    PolicyDefinition,
    PolicyReport,
    QueueView,
    Risk,
    assess,
    protective_policies,
    protective_policy_names,
    set_policy_command,
    touch_interval_ms,
)
from hopsched.connect import connect
from hopsched.core.envelope import BROKER_DELIVERY_COUNT_HEADER
from hopsched.errors import HopschedError, ManagementAPIError
from hopsched.settings import Settings
from hopsched.topology import Topology

__all__ = [
    "CHECK_INTERVAL_S",
    "UNCHECKED_LOG_INTERVAL_S",
    "UNCHECKED_TOUCH_INTERVAL_S",
    "PolicyCheck",
    "PolicyCounters",
    "PolicyWatch",
    "Protection",
    "check_policies",
    "finding_lines",
    "protect",
    "read_report",
    "risk_summary",
    "unprotect",
    "warn_on_risk",
]

log = logging.getLogger("hopsched.policies")

#: How often a relay reads the policies in force, s: well within the shortest ``expires``
#: people set (a policy change restarts the lease), for three small requests.
CHECK_INTERVAL_S = 2.0
#: How often a relay that cannot read them says so again, s.
UNCHECKED_LOG_INTERVAL_S = 3600.0
#: How often a relay that cannot read them uses each queue an ``expires`` could delete,
#: s: a lease it cannot see may be as short as F28's 8 s; this is a third of 6 s (as
#: ``touch_interval_ms`` for a known lease). The cost, always paid without the API:
#: with the default ladder, 30 ``basic.get`` (quorum on 4.x; 3.x: a consumer without
#: credit each, attached once) or passive declares (classic) per 2 s; on 4.x a message
#: at a quorum step's head for 40 s is returned 20 times, its delivery limit, and so
#: dead-lettered early (a wait in the relay, then an extra hop).
UNCHECKED_TOUCH_INTERVAL_S = 2.0
#: How long the watch waits for the broker to close its connection, s.
CLOSE_TIMEOUT_S = 2.0
#: How often a Scheduler reads them, s.
PRODUCER_CHECK_INTERVAL_S = 300.0


async def read_report(settings: Settings, client: ManagementClient | None = None) -> PolicyReport:
    """What the policies in force do to ``settings``' prefix, from the management API:
    its queues (type, arguments) and the vhost's policies, matched to them as the broker
    does (``policies.applying``); if the policies cannot be listed, what the API reports
    for each queue, a few seconds behind.

    Raises:
        ManagementAPIError: the API cannot be reached, or refuses the user.
    """
    client = client or ManagementClient(settings)
    topology = Topology.from_settings(settings)
    vhost = client.vhost
    views: dict[str, QueueView | None] = dict.fromkeys(topology.all_queues())
    name = quote("^" + re.escape(topology.prefix) + r"\.", safe="")
    columns = "name,type,arguments,policy,operator_policy,effective_policy_definition"
    page, pages = 1, 1
    while page <= pages:
        found = await client.get(
            f"queues/{vhost}?page={page}&page_size=500&name={name}&use_regex=true&columns={columns}"
        )
        pages = int(found.get("page_count", 1) or 1)
        for item in found.get("items", []):
            if item.get("name") in views:
                views[item["name"]] = QueueView.from_api(item)
        page += 1
    listed: list[PolicyDefinition] = []
    policies: list[PolicyDefinition] | None = listed
    try:
        for path, operator in (("policies", False), ("operator-policies", True)):
            found = await client.get(f"{path}/{vhost}")
            listed += [PolicyDefinition.from_api(p, operator=operator) for p in found]
    except ManagementAPIError as error:
        log.debug("policies not listed (%s): using what each queue reports", error)
        policies = None
    return assess(
        topology, views, policies, version=await client.broker_version(), vhost=settings.vhost
    )


@dataclass(frozen=True, slots=True)
class PolicyCheck:
    """A report, or why there is none (``check_policies``)."""

    report: PolicyReport | None
    unavailable: str | None = None

    def lines(self) -> list[str]:
        """What ``status`` and ``policies check`` print, a line each."""
        if self.report is None:
            return [f"policies: not checked: {self.unavailable}"]
        return [f"policies: {line}" for line in finding_lines(self.report)]

    def as_json(self) -> dict[str, Any]:
        report = self.report
        if report is None:
            return {"checked": False, "unavailable": self.unavailable}
        return {
            "checked": True,
            "protected": report.protected,
            "at_risk": report.at_risk,
            "findings": [
                {
                    "risk": f.risk.value,
                    "policy": f.policy,
                    "operator": f.operator,
                    "key": f.key,
                    "value": f.value,
                    "queues": list(f.queues),
                    "effect": f.effect,
                    "fix": f.fix,
                }
                for f in report.findings
            ],
            "masked": list(report.masked),
            "pending": list(report.pending),
        }


async def check_policies(settings: Settings) -> PolicyCheck:
    """``read_report``, or why it could not be read; never raises for the API."""
    try:
        return PolicyCheck(await read_report(settings))
    except ManagementAPIError as error:
        return PolicyCheck(None, str(error))


async def warn_on_risk(
    settings: Settings,
    on_report: Callable[[PolicyReport], None] | None = None,
    *,
    interval_s: float = PRODUCER_CHECK_INTERVAL_S,
) -> None:
    """A Scheduler's check, until cancelled: read the report now and every
    ``interval_s``, pass it to ``on_report``, and log a WARNING for each finding that can
    lose or stall messages. Quiet without the management API (the relays say so)."""
    while True:
        try:
            checked = await check_policies(settings)
        except RuntimeError as error:
            # No thread takes the API read: the process is exiting (concurrent.futures
            # refuses new work once its exit hook ran, before atexit), while a
            # SyncScheduler's loop thread lives on; a short-lived Celery producer printed
            # this as "Task exception was never retrieved" one run in five.
            log.debug("policy check ended: %s", error)
            return
        if checked.report is not None:
            if on_report is not None:
                on_report(checked.report)
            for finding in checked.report.findings:
                if finding.risk in (Risk.LOSS, Risk.STALL):
                    log.warning("scheduling on prefix %s: %s", settings.prefix, finding.line())
        else:
            log.debug("policies not checked: %s", checked.unavailable)
        await asyncio.sleep(interval_s)


@dataclass
class Protection:
    """What ``protect`` did.

    Attributes:
        policies: the protective policies, set or to set.
        commands: the ``rabbitmqctl`` commands that set them (for an operator to run
            where the user may not).
        error: why hopsched could not set them itself, or None.
    """

    policies: tuple[PolicyDefinition, ...]
    commands: list[str] = field(default_factory=list)
    error: str | None = None


async def protect(settings: Settings, priority: int = PROTECT_PRIORITY) -> Protection:
    """Set the prefix's protective policies (user tag ``policymaker`` needed).

    Never raises for the management API: ``Protection.error`` says why not, and
    ``commands`` give the way round.
    """
    topology = Topology.from_settings(settings)
    wanted = protective_policies(topology, priority)
    done = Protection(wanted, [set_policy_command(policy, settings.vhost) for policy in wanted])
    client = ManagementClient(settings)
    try:
        for policy in wanted:
            await client.put(
                f"policies/{client.vhost}/{quote(policy.name, safe='')}",
                {
                    "pattern": policy.pattern,
                    "definition": dict(policy.definition),
                    "priority": policy.priority,
                    "apply-to": policy.apply_to,
                },
            )
    except ManagementAPIError as error:
        done.error = str(error)
    return done


async def unprotect(settings: Settings) -> list[str]:
    """Remove the prefix's protective policies; returns the names removed (none if there
    were none).

    Raises:
        ManagementAPIError: the API cannot be reached, or refuses the user.
    """
    client = ManagementClient(settings)
    removed = []
    for name in protective_policy_names(Topology.from_settings(settings)):
        if await client.delete(f"policies/{client.vhost}/{quote(name, safe='')}"):
            removed.append(name)
    return removed


class PolicyCounters(Protocol):
    """Where a watch counts its findings: a relay's ``RelayStats`` (the watch is below
    the relay, so it names only the two counters it writes)."""

    policy_risks: dict[str, int]
    policy_unchecked: int


class PolicyWatch:
    """A relay's watch over the policies in force on its prefix (see the module doc).

    Args:
        settings: the relay's settings (``management_url``, ``log_interval_s``).
        stats: where the findings are counted (``RelayStats.policy_risks``,
            ``policy_unchecked``).
        interval_s: seconds between two reads of the policies.
        clock: ``time.monotonic`` (tests replace it).
    """

    def __init__(
        self,
        settings: Settings,
        stats: PolicyCounters,
        *,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Any = time.monotonic,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.topology = Topology.from_settings(settings)
        self.report: PolicyReport | None = None  #: the last report read, None before
        self._interval_s = interval_s
        self._clock = clock
        self._client = ManagementClient(settings)
        self._said: dict[str, float] = {}  # finding line -> when last logged
        self._unchecked_said: float | None = None
        self._touched: dict[str, float] = {}  # queue -> when last kept in use
        self._cannot_touch_said = -math.inf
        # What an expires can delete: no stream (it ignores expires), and not the relay
        # and ingress queues, which the relay consumes (a consumer keeps a queue in use).
        consumed = {self.topology.relay_queue, self.topology.ingress_queue}
        self._expirable = [
            name
            for name in self.topology.all_queues()
            if name not in consumed and name not in self.topology.records
        ]
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._idle_consumers = IdleConsumers(settings)
        self._told_unprotected = False

    async def run(self) -> None:
        """Watch until cancelled; never raises otherwise (a failed round is logged and
        the next one comes after the interval). The queues are kept in use by a task of
        their own: a management API that takes its timeout to answer delays no touch."""
        keeping = asyncio.create_task(self._keep_queues_in_use())
        try:
            while True:
                try:
                    await self.check()
                except Exception:  # a bug must not end the watch unseen
                    log.exception("the policy watch failed; trying again")
                await asyncio.sleep(self._interval_s)
        finally:
            keeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeping
            await self._close()

    async def check(self) -> PolicyReport | None:
        """Read the report once, log what changed and count it; None if unreadable."""
        try:
            report = await read_report(self.settings, self._client)
        except ManagementAPIError as error:
            self._unchecked(error)
            return None
        self.report = report
        self.stats.policy_unchecked = 0
        self._unchecked_said = None
        self.stats.policy_risks = {risk.value: count for risk, count in report.risks().items()}
        self._say(report)
        return report

    def _unchecked(self, error: ManagementAPIError) -> None:
        self.stats.policy_unchecked = 1
        now = self._clock()
        if self._unchecked_said is None or now - self._unchecked_said >= UNCHECKED_LOG_INTERVAL_S:
            self._unchecked_said = now
            log.warning(
                "cannot read the policies in force on prefix %s's queues (%s): a policy "
                "could limit them unnoticed, or delete them once no relay runs (meanwhile "
                "the relay keeps every queue in use, against an expires). Enable the "
                "management plugin, give user %r the tag management, or set "
                "HOPSCHED_MANAGEMENT_URL",
                self.topology.prefix,
                error,
                self.settings.login,
            )

    def _say(self, report: PolicyReport) -> None:
        now = self._clock()
        lines = {finding.line(): finding for finding in report.findings}
        for line, finding in lines.items():
            said = self._said.get(line)
            if said is None or now - said >= self.settings.log_interval_s:
                self._said[line] = now
                level = logging.WARNING if finding.risk is Risk.HOPS else logging.ERROR
                log.log(level, "%s", line)
        for line in [line for line in self._said if line not in lines]:
            del self._said[line]
            log.info("no longer in force: %s", line.split(". Fix:", 1)[0])
        if not report.protected and not report.findings and not self._told_unprotected:
            self._told_unprotected = True
            log.info(
                "prefix %s's queues are not protected from user policies: one set later "
                "(e.g. a blanket expires or max-length) would apply to them; `hopsched "
                "policies protect` keeps them off",
                self.topology.prefix,
            )

    async def _keep_queues_in_use(self) -> None:
        while True:
            try:
                await asyncio.sleep(await self.keep_in_use())
            except Exception:  # a bug must not end the touches unseen
                log.exception("keeping the queues in use failed; trying again")
                await asyncio.sleep(self._interval_s)

    async def keep_in_use(self) -> float:
        """Use every queue that is due to be renewed; returns the seconds until the next
        one is (at most the check interval). Due: a third of its ``expires`` lease at a
        time; while the policies cannot be read, every queue a lease could delete, every
        ``UNCHECKED_TOUCH_INTERVAL_S``."""
        if self.stats.policy_unchecked:
            every_s = dict.fromkeys(self._expirable, UNCHECKED_TOUCH_INTERVAL_S)
        elif self.report is not None:
            every_s = {
                name: touch_interval_ms(expires_ms) / 1000
                for name, expires_ms in self.report.expires_ms.items()
                if name in self._expirable
            }
        else:
            every_s = {}
        if not every_s:
            await self._close()
            return self._interval_s
        for name in self._idle_consumers.kept - every_s.keys():
            await self._idle_consumers.release(name)
        now = self._clock()
        soonest = self._interval_s
        for name, every in every_s.items():
            last = self._touched.get(name)
            if last is None or now - last >= every:
                if not await self._touch(name):
                    return self._interval_s  # no broker: try them all then, not each now
                self._touched[name] = now
                last = now
            soonest = min(soonest, last + every - now)
        took: float = self._clock() - now  # a round of touches takes time too
        return max(soonest - took, 0.01)

    async def _touch(self, name: str) -> bool:
        """Use queue ``name`` once; False if the broker cannot be reached."""
        try:
            channel = await self._open_channel()
        except _TOUCH_ERRORS as error:
            self._cannot_touch(name, error)
            return False
        try:
            if self.settings.queue_type == "classic":
                await channel.declare_queue(name, passive=True)
            elif await self._idle_consumers.keep(name):
                pass  # RabbitMQ 3.x: a consumer without credit, on it until released
            elif name == self.topology.parked_queue:
                await _rotate_head(channel, name)
            else:
                await _return_head(channel, name)
        except _TOUCH_ERRORS as error:
            self._cannot_touch(name, error)
            await self._close()
        return True

    def _cannot_touch(self, name: str, error: Exception) -> None:
        # Tried again every few seconds (a broker away, a queue deleted): said once per
        # log interval, not at each try.
        now = self._clock()
        if now - self._cannot_touch_said >= self.settings.log_interval_s:
            self._cannot_touch_said = now
            log.warning("could not keep queue %s in use (%s); trying again", name, error)

    async def _open_channel(self) -> aio_pika.abc.AbstractChannel:
        # A connection the broker dropped is not ``is_closed`` to aio-pika (only one it
        # closed itself is): its ``connected`` is cleared, and a channel() on it raises
        # RuntimeError (a relay whose node was stopped logged that every 2 s).
        if (
            self._connection is None
            or self._connection.is_closed
            or not self._connection.connected.is_set()
        ):
            lost, self._connection, self._channel = self._connection, None, None
            if lost is not None and not lost.is_closed:  # its reader and callbacks too
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):  # wait_for may lose a cancel
                        await lost.close()
            self._connection = await connect(self.settings, name="hopsched-policy-watch")
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._connection.channel()
        return self._channel

    async def _close(self) -> None:
        """Close the touches' connection and, at the same time, the consumers without
        credit (``IdleConsumers.close``), each within ``CLOSE_TIMEOUT_S``: a broker that
        never answers must not hold up a relay's stop."""
        connection, self._connection, self._channel = self._connection, None, None

        async def close_touches() -> None:
            if connection is not None and not connection.is_closed:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):  # wait_for may lose a cancel
                        await connection.close()

        await asyncio.gather(self._idle_consumers.close(), close_touches())


_TOUCH_ERRORS = (HopschedError, aiormq.exceptions.AMQPError, ConnectionError)


async def _return_head(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    """``basic.get`` on a quorum step queue (RabbitMQ 4.x): renews its lease; a message
    got is returned (``requeue=true``) and keeps its TTL (on time on 4.0.5; busy steps'
    heads on 3.10.8 came back up to 8 s late: 3.x gets ``IdleConsumers``). Each return
    counts: past the queue's delivery limit (20 by default on 4.x, none on 3.10) the
    broker dead-letters it into ``{prefix}.relay``, which waits it out as any early
    return."""
    underlay = await channel.get_underlay_channel()
    got = await underlay.basic_get(queue, no_ack=False)
    if isinstance(got.delivery, Basic.GetOk) and got.delivery_tag is not None:
        await underlay.basic_nack(got.delivery_tag, requeue=True)


async def _rotate_head(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    """``basic.get`` on a quorum parking queue: renews its lease; a message got moves to
    its tail (published with a confirm, then acked: a crash duplicates, never loses; a
    new message, so its delivery count starts again)."""
    underlay = await channel.get_underlay_channel()
    got = await underlay.basic_get(queue, no_ack=False)
    if not isinstance(got.delivery, Basic.GetOk) or got.delivery_tag is None:
        return
    properties = got.header.properties
    if properties.headers:
        properties.headers.pop(BROKER_DELIVERY_COUNT_HEADER, None)
    confirm = await underlay.basic_publish(
        got.body, exchange="", routing_key=queue, properties=properties, mandatory=True
    )
    if isinstance(confirm, Basic.Ack):
        await underlay.basic_ack(got.delivery_tag)
    else:
        await underlay.basic_nack(got.delivery_tag, requeue=True)


def finding_lines(report: PolicyReport) -> list[str]:
    """``report`` as the lines ``status`` and ``policies check`` print."""
    lines = [finding.line() for finding in report.findings]
    if report.masked:
        lines.append("masked by hopsched's protective policies: " + ", ".join(report.masked))
    if report.pending:
        lines.append(
            f"not reported yet for {len(report.pending)} queue(s) (the management API "
            "takes a few seconds after a queue is declared or a policy set)"
        )
    if not report.findings:
        lines.append(
            "no policy in force can lose or stall messages"
            + (
                ""
                if report.protected
                else "; the queues are not protected from user "
                "policies set later (hopsched policies protect)"
            )
        )
    return lines


def risk_summary(findings: Mapping[Risk, int]) -> str:
    """``2 loss, 1 stall`` for the risks present."""
    return ", ".join(f"{count} {risk.value}" for risk, count in findings.items() if count)
