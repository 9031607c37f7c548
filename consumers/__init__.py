"""ctrps consumers: the Kafka side (embedded broker; workers, DLQ and producers to come)."""

from .broker import BrokerError, EmbeddedBroker, create_topics, free_port, wait_for_metadata

__all__ = ["BrokerError", "EmbeddedBroker", "create_topics", "free_port", "wait_for_metadata"]
