"""The Kafka side: the user's ``kafka.*`` settings (:mod:`.config`, :mod:`.oauth`), a task's branch and
the driver's ends of transactions (:mod:`.xa`, :mod:`.wire`, through kafka-python's private names only in
:mod:`.internals`), and riding through broker loss (:mod:`.retry`). The compiled data path is
``lastagent._native``."""
