"""hopsched: deliver RabbitMQ messages at an arbitrary future time, never early.

A message carries its due time in a header and cycles through a ladder of
fixed-TTL queues (TTLs are powers of two in ms); a relay re-publishes each expired
message into the largest step that still fits and delivers it to its target once due.
"""

from hopsched.decide import ParkKind
from hopsched.envelope import DeliveryInfo, Envelope
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
from hopsched.journal import ScheduleInfo
from hopsched.ladder import Hold, Hop, Ladder
from hopsched.prepare import ScheduleRequest
from hopsched.relay import Relay
from hopsched.scheduler import Cancelled, Scheduled, Scheduler
from hopsched.settings import Settings, mask_url
from hopsched.signing import SigningKey
from hopsched.stats import RelayStats
from hopsched.topology import Topology
from hopsched.version import __version__

__all__ = [
    "AccessRefusedError",
    "BrokerConnectionLost",
    "BrokerUnavailableError",
    "Cancelled",
    "DeliveryInfo",
    "Envelope",
    "EnvelopeError",
    "Hold",
    "Hop",
    "HopschedError",
    "InvalidScheduleError",
    "InvalidSettingsError",
    "Ladder",
    "LadderMismatchError",
    "MessageTooLargeError",
    "MetricsEndpointError",
    "ParkKind",
    "PrefixNotDeclaredError",
    "PublishRejectedError",
    "PublishTimeoutError",
    "Relay",
    "RelayStats",
    "ScheduleInfo",
    "ScheduleRequest",
    "Scheduled",
    "Scheduler",
    "Settings",
    "SigningKey",
    "TargetCheckError",
    "TargetRefused",
    "Topology",
    "TopologyMismatchError",
    "Unroutable",
    "UnroutableTargetError",
    "__version__",
    "mask_url",
]
