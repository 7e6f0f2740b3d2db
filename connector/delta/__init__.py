"""The Delta side of lastagent: every table it reads and every commit it makes.

The driver's modules decide an epoch in a Delta table and read decisions back (:mod:`.target_table` for a
``lastagent-delta`` link, :mod:`.arbitration_table` for a ``lastagent-kafka`` link, :mod:`.batch_table` for a
``lastagent.epoch`` block; :mod:`.table_properties` for ownership claims; :mod:`.kernel` for the commits that go
through Delta Kernel); the executors' write the epoch's data files (:mod:`.files`) under the table's rules
(:mod:`.features`, :mod:`.expressions`). :mod:`lastagent.core` holds the protocol and the record and imports
nothing from here.
"""
