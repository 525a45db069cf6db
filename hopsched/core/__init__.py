"""The pure core: what a schedule is and what the relay decides, with no I/O and no clock
of its own (the instant comes in as a parameter).

The ladder of steps (``ladder``), the envelope a message carries (``envelope``), the
relay's decision for one delivery (``decide``), cancellations (``cancel``), recurrence
(``recurring``), signing (``signing``), targets and validation (``targets``,
``validate``, ``plausible``), the ``x-delay`` ingress's translation (``ingress``),
the hop margin (``overshoot``), microsecond time (``clock``) and the id table
(``id_table``). Imports only ``hopsched.errors``, ``hopsched.version`` and the AMQP
codec's value types (``hopsched.amqp.wire``).
"""
