"""The lookup buffer's own error class and a helper to report one failure to many callers."""

from __future__ import annotations

import copy

from kv_pipe.errors import KVTransferError


class KVInvalidRequestError(KVTransferError, ValueError):
    """An argument breaks the contract (wrong type, dtype, shape, or a roi that selects nothing)."""


class KVEntryTakenBackError(KVTransferError):
    """A borrowed entry was taken back by its producer before it was released: what was copied from it
    must not be used. The connection stays usable; only this entry is lost."""


def fresh_error(error: KVTransferError) -> KVTransferError:
    """A copy of ``error`` (same class and message) to raise in one more caller.

    Raising one stored exception object again and again from several threads would make them
    share, and keep growing, one traceback; the copy has its own and points at the original.
    """
    clone = copy.copy(error)
    clone.__cause__ = error
    return clone
