"""lookup_buffer: fetch a request's KV from the producer by its tokens, in any order, over a kv_pipe
(or over a kv_store, where a query finds its longest stored prefix)."""

from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.connections import ProducerConnections
from lookup_buffer.dialer import dial
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.listener import BufferListener
from lookup_buffer.simple_buffer import SimpleBuffer
from lookup_buffer.store_buffer import StoreBuffer

__all__ = [
    "BufferListener",
    "BufferStats",
    "KVInvalidRequestError",
    "KVLookupBufferBase",
    "ProducerConnections",
    "SelectResult",
    "SimpleBuffer",
    "StoreBuffer",
    "dial",
]
