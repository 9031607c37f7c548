"""ctrps consumers: the Kafka side. The workers (`worker`, a facade over
`pipeline`: windows, decoding, training, offsets; `outage_watch`, `leases`,
`resume`, `reports`, `registration`), their dead-letter queue (`dlq`),
producers (`producer`, `synthetic`), the embedded broker (`broker`) and
Kafka's security settings (`kafka_security`). Imports `ps_core`, never `app`."""

from .broker import BrokerError, EmbeddedBroker, create_topics, free_port, wait_for_metadata

__all__ = ["BrokerError", "EmbeddedBroker", "create_topics", "free_port", "wait_for_metadata"]
