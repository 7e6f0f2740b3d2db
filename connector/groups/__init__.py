"""The reliable-groups step ``lastagent.reliable_groups``: WS-Reliability's group rules, pure
(:mod:`.rules`), the Spark step that runs them (:mod:`.step`), and the two refusal columns a sink
splits off (:mod:`.refusals`, which imports neither the step nor pyspark)."""
