"""The relay daemon: its consume -> decide -> publish -> ack loop (``loop``), the
deliveries that cannot go that way (``detours``), messages held until due (``holds``,
``timer``), the hop margin and clock offsets it measures (``hop_timing``,
``broker_clock``), its counters and Prometheus endpoint (``stats``, ``metrics``), and
what it says of a prefix it had to declare anew (``new_prefix``).
"""
