"""hopsched: deliver RabbitMQ messages at an arbitrary future time, never early.

A message carries its due time in a header and cycles through a ladder of
fixed-TTL queues (TTLs are powers of two in ms); a relay re-publishes each expired
message into the largest step that still fits and delivers it to its target once due.
"""

from hopsched.envelope import DeliveryInfo, Envelope
from hopsched.errors import (
    AccessRefusedError,
    BrokerUnavailableError,
    EnvelopeError,
    HopschedError,
    InvalidScheduleError,
    PublishRejectedError,
    TopologyMismatchError,
)
from hopsched.ladder import Hold, Hop, Ladder
from hopsched.relay import Relay, RelayTotals
from hopsched.scheduler import Scheduled, Scheduler
from hopsched.settings import Settings, mask_url
from hopsched.topology import Topology

__all__ = [
    "AccessRefusedError",
    "BrokerUnavailableError",
    "DeliveryInfo",
    "Envelope",
    "EnvelopeError",
    "Hold",
    "Hop",
    "HopschedError",
    "InvalidScheduleError",
    "Ladder",
    "PublishRejectedError",
    "Relay",
    "RelayTotals",
    "Scheduled",
    "Scheduler",
    "Settings",
    "Topology",
    "TopologyMismatchError",
    "mask_url",
]
