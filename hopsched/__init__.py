"""hopsched: deliver RabbitMQ messages at an arbitrary future time, never early.

A message carries its due time in a header and cycles through a ladder of
fixed-TTL queues (TTLs are powers of two in ms); a relay re-publishes each expired
message into the largest step that still fits and delivers it to its target once due.

The package, from the bottom up (a module imports only from its own layer or below):
``errors`` and ``version``; ``amqp`` (the transport); ``core`` (pure: no I/O, no
clock of its own); ``settings``, ``connect`` and ``topology`` (a prefix's names and arguments);
``journal`` (the streams); ``broker`` (operating a prefix: declare, upgrade, teardown,
policies);
``client`` (``Scheduler``) and ``relay`` (the daemon); ``cli``, ``integrations``
(Celery, Dramatiq, Taskiq) and ``testing`` (private nodes) on top.
"""

from hopsched.client.prepare import ScheduleRequest
from hopsched.client.scheduler import Cancelled, Scheduler
from hopsched.client.sending import Scheduled
from hopsched.core.decide import ParkKind
from hopsched.core.envelope import DeliveryInfo
from hopsched.core.ladder import Ladder
from hopsched.core.recurring import Recurrence
from hopsched.core.signing import SigningKey
from hopsched.errors import (
    AccessRefusedError,
    BrokerConnectionLost,
    BrokerUnavailableError,
    EnvelopeError,
    HopschedError,
    InvalidScheduleError,
    InvalidSettingsError,
    LadderMismatchError,
    MessageTooLargeError,
    MetricsEndpointError,
    PrefixNotDeclaredError,
    PublishRejectedError,
    PublishTimeoutError,
    TargetCheckError,
    TargetRefused,
    TopologyMismatchError,
    Unroutable,
    UnroutableTargetError,
)
from hopsched.journal.records import ScheduleInfo
from hopsched.relay.loop import Relay
from hopsched.relay.stats import RelayStats
from hopsched.settings import Settings
from hopsched.topology import Topology
from hopsched.version import __version__

# Producing: schedule, cancel, look up.
__all__ = [
    "Cancelled",
    "DeliveryInfo",
    "Recurrence",
    "ScheduleInfo",
    "ScheduleRequest",
    "Scheduled",
    "Scheduler",
    "SigningKey",
]
# Configuring and running a prefix.
__all__ += [
    "Ladder",
    "ParkKind",
    "Relay",
    "RelayStats",
    "Settings",
    "Topology",
    "__version__",
]
# What hopsched raises (all HopschedError) or returns for a refused target.
__all__ += [
    "AccessRefusedError",
    "BrokerConnectionLost",
    "BrokerUnavailableError",
    "EnvelopeError",
    "HopschedError",
    "InvalidScheduleError",
    "InvalidSettingsError",
    "LadderMismatchError",
    "MessageTooLargeError",
    "MetricsEndpointError",
    "PrefixNotDeclaredError",
    "PublishRejectedError",
    "PublishTimeoutError",
    "TargetCheckError",
    "TargetRefused",
    "TopologyMismatchError",
    "Unroutable",
    "UnroutableTargetError",
]
