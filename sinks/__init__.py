"""Sinks: the exactly-once ``lastagent-kafka`` writer and the ``lastagent-delta`` last agent."""
