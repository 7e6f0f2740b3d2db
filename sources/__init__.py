"""Sources: the ``lastagent-kafka`` streaming reader."""
