"""The protocol core: the epoch 2PC's pure rules (:mod:`.protocol`), their one interpreter
(:mod:`.committer`), the names of transactions (:mod:`.xid`), and the two ports the interpreter reads
besides the broker: the arbitration store (:mod:`.arbitration`) and Spark's checkpoint
(:mod:`.checkpoint`). Driver side."""
