"""Exceptions raised by kvbridge.

Every error kvbridge raises derives from :class:`KVTransferError`, so callers can catch one class.
The subclasses say *why* a transfer failed; a plain miss (no data) is never an exception.
"""


class KVTransferError(RuntimeError):
    """Base class of every error raised by kvbridge."""


class KVConfigError(KVTransferError, ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


class KVTimeoutError(KVTransferError, TimeoutError):
    """A wait with a caller-supplied timeout expired. The pipe or buffer stays usable."""


class KVPeerLostError(KVTransferError, ConnectionError):
    """The peer exited, was killed, or stopped answering within ``kv_timeout``. The pipe is dead."""


class KVPipeClosedError(KVTransferError, ConnectionError):
    """The pipe was closed, by this side or (orderly) by the peer."""


class KVProtocolError(KVTransferError):
    """The peer sent something this side does not accept: another protocol version, a malformed
    header, an unknown dtype, or an item larger than the agreed limit. The connection is dropped."""


class KVBufferFullError(KVTransferError):
    """An item could not be accepted because the byte budget (``kv_buffer_size``) stayed full for
    the whole timeout, or the item alone is larger than the budget."""
