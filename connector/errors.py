"""The exceptions lastagent raises. Every message stands alone and names what to change."""

from __future__ import annotations


class LastAgentError(Exception):
    """Base of every error lastagent raises on purpose."""


class OptionError(LastAgentError, ValueError):
    """A reader or writer option is missing, unknown, or has a bad value.

    The message names the option and the values that would be right.
    """

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"option '{option}': {message}")
        self.option = option


class KafkaProtocolError(LastAgentError):
    """A Kafka request failed or the broker could not be reached.

    Attributes:
        retriable: True when the same request may succeed later (coordinator moving, broker
            starting); False when retrying cannot help.
        error: Kafka's name for the failure (``TRANSACTIONAL_ID_NOT_FOUND``), when the broker gave one.
    """

    def __init__(self, message: str, retriable: bool = False, error: str = "") -> None:
        super().__init__(message)
        self.retriable = retriable
        self.error = error


class DataLossError(LastAgentError):
    """Records the query should read are gone (retention, deleted partition).

    Raised only when ``failOnDataLoss`` is true; the message names topic, partition and offsets.
    """


class UnsupportedSparkError(LastAgentError):
    """The pyspark in this Python is one lastagent does not run on (older than 4.0) or was never tested on.

    The message names the version found and the versions lastagent runs on.
    """
