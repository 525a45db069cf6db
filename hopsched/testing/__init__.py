"""Tooling for tests that must crash, freeze, alarm or reconfigure a broker: private
RabbitMQ nodes and clusters (``localbroker``), never the broker others use.
"""
