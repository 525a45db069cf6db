"""The producer's side: ``Scheduler`` (``scheduler``), the preparation of one request
into an envelope (``prepare``) and the target check without publishing (``routes``).
"""
