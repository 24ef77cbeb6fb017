"""lookup_buffer: fetch a request's KV from the producer by its tokens, in any order, over a kv_pipe."""

from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.simple_buffer import SimpleBuffer

__all__ = ["BufferStats", "KVInvalidRequestError", "KVLookupBufferBase", "SelectResult", "SimpleBuffer"]
