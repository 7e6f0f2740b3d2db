"""lastagent: exactly-once Spark Structured Streaming between Apache Kafka and Delta Lake.

Formats ``lastagent-kafka`` and ``lastagent-delta`` are discovered by Spark from the installed
``pyspark_lastagent_*`` modules; no registration call is needed.
"""

from lastagent.errors import DataLossError, KafkaProtocolError, LastAgentError, OptionError

__all__ = ["DataLossError", "KafkaProtocolError", "LastAgentError", "OptionError"]
__version__ = "0.1.0"
