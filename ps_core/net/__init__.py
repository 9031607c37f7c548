"""The network: one shard's server side and the clients that reach it.

Holds the binary frame codec and the other wire formats (`codec`), a shard's
pure handlers (`shard.Shard`), its aiohttp app (`server`) and OpenAPI
document, the TCP RPC (`rpc`, `pipelined`), credentials (`auth`), TLS
(`tls`), port limits (`limits`), key routing (`routing`) and the data-plane
client (`client.PSClient` over its transports).

May import: aiohttp, numpy, orjson, `ps_core.errors`, `ps_core.hashing`,
`ps_core.parsing`, `ps_core.schema` and `ps_core.store`. Nothing of the model
side or checkpoints. A new frame op, value encoding or transport goes here.
"""
