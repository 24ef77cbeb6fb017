"""One rule for every pipe and lookup buffer: one that lost its peer stays dead, and close raises the
first failure nobody reported.

:class:`FailureLatch` keeps the first failure (later ones are consequences of it) and whether any
caller has been told; callers are told with a copy (:func:`fresh_error`). It takes no lock of its
own: its owner guards it with the lock that guards the state a failure changes along with it.
"""

from __future__ import annotations

import copy

from kv_pipe.errors import KVPipeClosedError


def fresh_error(error: BaseException) -> BaseException:
    """A copy of ``error`` (same class and message) to raise in one more caller.

    Raising one stored exception object again and again from several threads would make them
    share, and keep growing, one traceback; the copy has its own and points at the original.
    """
    try:
        clone = copy.copy(error)
    except TypeError:  # an exception whose constructor cannot be called again from its args
        return error
    clone.__cause__ = error
    return clone


class FailureLatch:
    """The first failure of a pipe or buffer, whether a caller was told of it, and whether it was
    closed. Not thread-safe by itself: hold the owner's lock."""

    __slots__ = ("error", "closed", "_reported")

    def __init__(self) -> None:
        self.error: BaseException | None = None  #: the first failure; the owner is dead after it
        self.closed = False  #: close() was called
        self._reported = False

    def fail(self, error: BaseException, after_close: bool = False) -> bool:
        """Keep ``error`` if it is the first failure; True if it was. A failure once the owner is
        closed is none (the closing ends the peer's side too), unless ``after_close``: the owner
        still had work to finish with its peer."""
        if self.error is not None or (self.closed and not after_close):
            return False
        self.error = error
        return True

    def close(self) -> bool:
        """Mark the owner closed; False if it already was."""
        if self.closed:
            return False
        self.closed = True
        return True

    def raise_if_failed(self) -> None:
        """Raise the failure (a copy), which counts as reported."""
        if self.error is not None:
            self._reported = True
            raise fresh_error(self.error)

    def raise_if_unusable(self, closed_message: str) -> None:
        """Raise the failure, or KVPipeClosedError(``closed_message``) once closed."""
        self.raise_if_failed()
        if self.closed:
            raise KVPipeClosedError(closed_message)

    def reason(self, closed_message: str) -> BaseException | None:
        """Why the owner stopped: the failure, KVPipeClosedError(``closed_message``) once closed, or
        None while it works."""
        if self.error is None and self.closed:
            return KVPipeClosedError(closed_message)
        return self.error

    def unreported(self) -> BaseException | None:
        """The failure if no caller was told of it yet (for close to raise), which then counts as
        reported; else None."""
        if self._reported:
            return None
        self._reported = True
        return self.error
