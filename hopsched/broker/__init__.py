"""Operating a prefix on the broker: the management API client (``management``), the
policies in force and their watch (``policies``, ``policy_watch``), which node each
relay is on (``nodes``), parked messages (``parked``) and ``x-delay`` ingresses
(``ingress``). Declaring, upgrading and tearing down a prefix is ``hopsched.topology``.
"""
