"""The lookup buffer's own error classes."""

from __future__ import annotations

from kv_pipe.errors import KVTransferError


class KVInvalidRequestError(KVTransferError, ValueError):
    """An argument breaks the contract (wrong type, dtype, shape, or a roi that selects nothing)."""


class KVEntryTakenBackError(KVTransferError):
    """A borrowed entry was taken back by its producer before it was released: what was copied from it
    must not be used. The connection stays usable; only this entry is lost."""
