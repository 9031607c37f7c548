"""ctrps consumers: the Kafka side. The workers (`worker`, a facade over
`pipeline`: windows, decoding, training, offsets; `outage_watch`, `leases`,
`resume`, `reports`, `registration`), their dead-letter queue (`dlq`),
producers (`producer`), the embedded broker (`broker`) and
Kafka's security settings (`kafka_security`). Imports `ps_core`, never `app`.
The broker's names below are imported on first use (`ps_core.lazy`): a
decoding process imports `consumers.decode` and no broker, aiokafka or
aiohttp."""

from typing import TYPE_CHECKING

from ps_core.lazy import lazy_exports

if TYPE_CHECKING:
    from .broker import BrokerError, EmbeddedBroker, create_topics, free_port, wait_for_metadata
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".broker": ("BrokerError", "EmbeddedBroker", "create_topics", "free_port", "wait_for_metadata"),
        },
    )

__all__ = ["BrokerError", "EmbeddedBroker", "create_topics", "free_port", "wait_for_metadata"]
