"""The network: one shard's server side and the clients that reach it.

Holds the binary frame codec and the other wire formats (`codec`), the
decoded frame (`frame`), each op's frame encoder (`op_encoders`), export
cuts in transit (`snapshot_transfer`), a shard's frames served
(`frame_handler`), its aiohttp app (`server`), OpenAPI
document (`shard_openapi`) and bodies (`shard_bodies`), the control plane's
messages (`control_messages`) and calls, each declared once
(`control_calls`: routes, scopes, request and reply models), the TCP RPC
(`rpc`, `pipelined`), credentials (`auth`), TLS (`tls`), port limits
(`limits`), key routing (`routing`) and the data-plane client
(`client.PSReader`, `client.PSClient` over the transports of `transports`,
through the shard endpoints of `endpoint`).

May import: aiohttp, numpy, orjson, msgspec, `ps_core.errors`, `ps_core.hashing`,
`ps_core.parsing`, `ps_core.bodies`, `ps_core.store` and `ps_core.shard` (the
shard it serves). Nothing of the model
side or checkpoints. A new frame op, value encoding or transport goes here.
The names below are imported on first use (`ps_core.lazy`): aiohttp is
loaded by what uses the server or the clients, not by the codec.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .client import PSClient, PSReader, Routed
    from .endpoint import RetryPolicy, ShardEndpoint
    from .server import create_shard_app
    from .transports import HttpTransport, LocalTransport, Pulled, ShardReader, ShardTransport, TcpTransport
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".client": ("PSClient", "PSReader", "Routed"),
            ".endpoint": ("RetryPolicy", "ShardEndpoint"),
            ".server": ("create_shard_app",),
            ".transports": (
                "HttpTransport",
                "LocalTransport",
                "Pulled",
                "ShardReader",
                "ShardTransport",
                "TcpTransport",
            ),
        },
    )

__all__ = [
    "HttpTransport",
    "LocalTransport",
    "PSClient",
    "PSReader",
    "Pulled",
    "RetryPolicy",
    "Routed",
    "ShardEndpoint",
    "ShardReader",
    "ShardTransport",
    "TcpTransport",
    "create_shard_app",
]
