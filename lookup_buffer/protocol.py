"""The lookup buffer's wire formats: control messages over ZeroMQ and headers on the data pipe.

Control messages are msgspec msgpack Structs, tagged by a ``type`` field and carrying a protocol
version ``v``. Every received message is validated in full here (types, bounds, cross-field
consistency); nothing is unpickled or evaluated. With ``kv_secret`` set, every control frame
carries an HMAC-SHA256 tag (:class:`ControlSigner`; one key per direction), checked before the
frame is decoded: a peer without the secret can neither select nor learn anything.

Exchange:

* When the producer starts, it sends a session header on the data pipe (:func:`make_session`): a
  random nonce of this producer's lifetime. The data pipe reaches only the authenticated consumer.
* The consumer sends each :class:`SelectRequest` from its DEALER socket, carrying that session and
  a counter that grows with every request. The producer refuses a request of another session (one
  captured from an earlier producer, or forged) or whose counter is not above the last one it
  accepted (a replay), so a captured select can never be used again.
* The producer answers every request it accepts exactly once, on the data pipe, with an outcome
  header (request id, status, whether the select waited): a hit's header (:func:`make_header`) also
  carries the entry's tokens and roi and is followed by the key and, if present, the value and the
  hidden states; a miss, a refusal for lack of room and the producer closing have a header only
  (:func:`make_outcome`). The consumer routes outcomes by request id, so concurrent requests never
  swap data.
* A select may name a part of the entry (``part``: a range along one dimension of its tensors,
  e.g. some KV heads); the producer then splits the entry into equal parts, sends that one and
  keeps the others for the selects that name them (:meth:`lookup_buffer.store.EntryStore.pop_part`).
* A select may name a span of the entry (``span``: a range along one dimension, e.g. the blocks a
  decode instance lacks); the producer then sends only that range of the entry (of the part, if one
  is named) and drops the rest, which nobody else asks for. A producer of another version refuses
  such a select as it refuses every other one ("version"): it never sends the whole entry instead.
* Lent entries (:mod:`lookup_buffer.loans`): a select that may borrow says so. If the producer lends
  it the entry, each lent item of the hit is a loan descriptor (:func:`make_loan_descriptor`): where
  the bytes lie in the producer's exported memory. Once the consumer has copied them it sends a
  release (:func:`make_release`) on the data pipe, which only the authenticated consumer can write
  to, in the one direction the consumer otherwise leaves unused. Nothing answers it: the consumer
  checks the loan's stamp word itself (:mod:`lookup_buffer.loans`).
* What cannot go on the data pipe is a :class:`Refusal` from the ROUTER: a request the producer
  could not parse, authenticate or accept as fresh, or any request once the data pipe is broken.

Connections (a producer serving many consumers, :mod:`lookup_buffer.listener`): a consumer sends a
:class:`ConnectRequest` with a fresh nonce to the producer's listening ROUTER; the producer answers
with a :class:`ConnectReply` echoing the nonce and naming two ports it just bound for this consumer
alone (the data pipe's rendezvous and the control channel), or with a :class:`Refusal`. Everything
after that is the exchange above, on that connection's own pipe and control channel.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
import torch

from kv_pipe import auth
from kv_pipe.errors import KVProtocolError
from kv_pipe.exported_memory import ExportDescriptor
from kv_pipe.protocol import CODE_TO_DTYPE, DTYPE_TO_CODE, MAX_NDIM
from lookup_buffer.matching import MAX_TOKENS, TOKEN_DTYPES, TOKEN_WIRE_DTYPE, MatchKey

PROTOCOL_VERSION = 8
#: Longest a producer holds a select waiting for an insert.
MAX_WAIT_MS = 3_600_000
MAX_MESSAGE_CHARS = 1000
#: Bytes of a session nonce.
SESSION_BYTES = auth.NONCE_BYTES
MAX_COUNTER = (1 << 63) - 1
#: Bounds for ZMQ_MAXMSGSIZE: a peer sending more is disconnected by ZeroMQ before we see it.
MAX_REQUEST_BYTES = MAX_TOKENS * (TOKEN_WIRE_DTYPE.itemsize + 1) + SESSION_BYTES + 1024 + auth.TAG_BYTES
MAX_REFUSAL_BYTES = 4 * MAX_MESSAGE_CHARS + 1024 + auth.TAG_BYTES
#: What drop_select returns, in this order.
ITEM_NAMES = ("input_tokens", "roi", "key", "value", "hidden")
TAG_MAGIC = 0x4B564C4F4F4B  # "KVLOOK"
_HEADER_FIXED = 7
_SESSION_WORDS = SESSION_BYTES // 8
_W_REQUEST_ID, _W_FLAGS = 2, 6
_FLAG_VALUE, _FLAG_HIDDEN, _FLAG_WAITED = 1, 2, 4
_FLAGS_AT_INSERT = _FLAG_VALUE | _FLAG_HIDDEN
#: Per item of a hit (key, value, hidden): it is lent, and a loan descriptor stands in its place.
_FLAGS_LENT = (8, 16, 32)
_FLAGS_HIT = _FLAGS_AT_INSERT | _FLAG_WAITED | sum(_FLAGS_LENT)
LOAN_MAGIC = 0x4B564C4F414E  # "KVLOAN"
RELEASE_MAGIC = 0x4B5652454C53  # "KVRELS"
_NUMPY_TOKEN_DTYPES = tuple(torch.empty(0, dtype=dtype).numpy().dtype for dtype in TOKEN_DTYPES)

RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
#: Why a request was refused: unparseable or inconsistent, another protocol version, no valid
#: kv_secret signature, not fresh (another session, or a counter already used), the producer's
#: data pipe or server failed, too many at once, or a consumer setting the producer cannot serve.
Reason = Literal["malformed", "version", "unauthenticated", "stale", "failed", "busy", "config"]


class OutcomeStatus(enum.IntEnum):
    """The status word of a header on the data pipe."""

    HIT = 0  # the entry's tensors follow
    MISS = 1  # nothing matched within the select's wait
    BUSY = 2  # refused: too many selects were waiting at the producer
    CLOSED = 3  # the producer is shutting down
    SESSION = 4  # no select's: the first header on the pipe, carrying the producer's session


_STATUS_CODES = frozenset(int(status) for status in OutcomeStatus)


class SelectRequest(msgspec.Struct, tag="select", tag_field="type", frozen=True):
    """Consumer -> producer: take the entry matching ``tokens``/``roi``, waiting up to ``wait_ms``.

    ``session``: the nonce of the producer's session header. ``counter``: above that of every
    earlier request of the session. ``tokens``: int64 little-endian; ``roi``: one byte (0 or 1)
    per token.
    """

    v: int
    request_id: RequestId
    session: Annotated[bytes, msgspec.Meta(min_length=SESSION_BYTES, max_length=SESSION_BYTES)]
    counter: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNTER)]
    tokens: Annotated[bytes, msgspec.Meta(max_length=MAX_TOKENS * TOKEN_WIRE_DTYPE.itemsize)]
    roi: Annotated[bytes, msgspec.Meta(max_length=MAX_TOKENS)]
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_WAIT_MS)]
    #: The consumer can borrow lent entries (:mod:`lookup_buffer.loans`).
    borrow: bool = False
    #: Take only this part of the entry (:data:`lookup_buffer.store.Part`): ``[dim, start, stop]``,
    #: every tensor narrowed to ``[start, stop)`` along dimension ``dim``; absent: the whole entry.
    part: tuple[int, int, int] | None = None
    #: Send only this span of the entry (of the part, if ``part`` is given), ``[dim, start, stop]``
    #: as ``part``; the rest of it is dropped. Absent: all of it.
    span: tuple[int, int, int] | None = None


class Refusal(msgspec.Struct, tag="refusal", tag_field="type", frozen=True):
    """Producer -> consumer: a request that was not accepted, or not answered because the data pipe is
    broken. ``request_id`` is the request's if it could be read, else 0; ``message`` says why."""

    v: int
    request_id: RequestId
    reason: Reason
    message: Annotated[str, msgspec.Meta(max_length=MAX_MESSAGE_CHARS)] = ""


Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=auth.NONCE_BYTES, max_length=auth.NONCE_BYTES)]


class ConnectRequest(msgspec.Struct, tag="connect", tag_field="type", frozen=True):
    """Consumer -> producer's listener: open a connection of this consumer's own. ``nonce``: fresh,
    echoed by the reply, so that a reply is never taken for another request's. ``buffer_bytes``: the
    consumer's ``kv_buffer_size``, which bounds what its pipe can receive."""

    v: int
    nonce: Nonce
    buffer_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 62)]


class ConnectReply(msgspec.Struct, tag="accept", tag_field="type", frozen=True):
    """Producer's listener -> consumer: the ports bound for this connection on the producer's kv_ip."""

    v: int
    nonce: Nonce
    store_port: Port
    control_port: Port


class _Envelope(msgspec.Struct):
    """The fields read before the schema, so that another version's message gets a clear answer."""

    v: int
    request_id: Any = 0


class MessageError(KVProtocolError):
    """A control message was refused; ``request_id`` is the sender's id if it could be read, else 0."""

    def __init__(self, message: str, reason: Reason, request_id: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.request_id = request_id


def only_frame(frames: list[bytes]) -> bytes:
    """The one frame a control message has after its sender's identity; MessageError otherwise."""
    if len(frames) != 1:
        raise MessageError(f"expected one message frame after the identity, got {len(frames)}", "malformed")
    return frames[0]


class ControlSigner:
    """Seals and opens control frames: ``body + HMAC tag`` with a secret, the bare body without.

    Requests and refusals use different keys, so a captured refusal can never pass as a request.
    """

    def __init__(self, secret: str | None) -> None:
        self.enabled = secret is not None
        self._keys = {
            what: auth.derive_key(secret, f"lookup-buffer/{what}") if secret else b""
            for what in ("select request", "refusal", "connect request", "connect reply")
        }

    def seal(self, body: bytes, what: str) -> bytes:
        return body + auth.sign(self._keys[what], body) if self.enabled else body

    def open(self, frame: bytes, what: str) -> bytes:
        """The authenticated body of ``frame``; MessageError if its tag is missing or wrong."""
        if not self.enabled:
            return frame
        body, tag = frame[: -auth.TAG_BYTES], frame[-auth.TAG_BYTES :]
        if len(frame) <= auth.TAG_BYTES or not auth.verify(self._keys[what], tag, body):
            raise MessageError(
                f"authentication failed: a {what} without a valid kv_secret signature was refused "
                f"(the sender has another kv_secret, none, or is a stranger)",
                "unauthenticated",
            )
        return body


#: Every control message. Decoding the union (not one Struct) makes the ``type`` tag mandatory.
Message = SelectRequest | Refusal | ConnectRequest | ConnectReply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


def _decode(frame: bytes, expected: type, what: str) -> Any:
    """Decode the envelope, check the version, then decode and validate the full message."""
    try:
        envelope = _envelope_decoder.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # msgspec lets bad UTF-8 through as is
        raise MessageError(
            f"malformed {what} ({len(frame)} bytes): {exc} (if the other side sets kv_secret, so must this one)",
            "malformed",
        ) from None
    request_id = envelope.request_id
    if not (isinstance(request_id, int) and not isinstance(request_id, bool) and 0 <= request_id < 1 << 63):
        request_id = 0
    if envelope.v != PROTOCOL_VERSION:
        raise MessageError(
            f"{what} uses lookup-buffer protocol version {envelope.v}, this side speaks version "
            f"{PROTOCOL_VERSION}: install the same kvbridge version on both sides",
            "version",
            request_id,
        )
    try:
        message = _decoder.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:  # msgspec lets bad UTF-8 through as is
        raise MessageError(f"invalid {what}: {exc}", "malformed", request_id) from None
    if not isinstance(message, expected):
        raise MessageError(f"expected a {what}, got a {type(message).__name__}", "malformed", request_id)
    return message


def select_request(
    request_id: int,
    tokens: np.ndarray,
    roi: np.ndarray,
    wait_ms: int,
    session: bytes = b"",
    counter: int = 0,
    borrow: bool = False,
    part: tuple[int, int, int] | None = None,
    span: tuple[int, int, int] | None = None,
) -> SelectRequest:
    """A select of ``tokens``/``roi`` (as returned by :func:`lookup_buffer.matching.token_arrays`; copied),
    of the whole entry or only ``part`` of it, all of that or only ``span`` of it (both checked as
    :func:`decode_request` does: ValueError).

    The consumer fills in ``session`` and ``counter`` just before sending
    (``msgspec.structs.replace``): until then the request is not valid on the wire.
    """
    return SelectRequest(
        v=PROTOCOL_VERSION,
        request_id=request_id,
        session=session,
        counter=counter,
        tokens=tokens.astype(TOKEN_WIRE_DTYPE, copy=False).tobytes(),
        roi=roi.astype(np.uint8).tobytes(),
        wait_ms=wait_ms,
        borrow=borrow,
        part=_checked_part(part),
        span=_checked_part(span, "span"),
    )


#: Bounds of a part's fields: a dimension of a tensor on the pipe, indices within 2**31.
MAX_PART_INDEX = 1 << 31


def _checked_part(part: Sequence[int] | None, name: str = "part") -> tuple[int, int, int] | None:
    """``part`` (a part or a span) as a tuple; ValueError unless it is None or ``(dim, start, stop)`` with
    ``0 <= dim <= MAX_NDIM`` (tensors of an entry carry at most MAX_NDIM dimensions, a paged key
    one more) and ``0 <= start < stop <= MAX_PART_INDEX``."""
    if part is None:
        return None
    values = tuple(part)
    if (
        len(values) != 3
        or any(isinstance(v, bool) or not isinstance(v, int) for v in values)
        or not 0 <= values[0] <= MAX_NDIM
        or not 0 <= values[1] < values[2] <= MAX_PART_INDEX
    ):
        raise ValueError(
            f"a {name} must be [dim, start, stop] with 0 <= dim <= {MAX_NDIM} and "
            f"0 <= start < stop <= {MAX_PART_INDEX}, got {list(values)[:3]}"
        )
    return values


def encode_request(signer: ControlSigner, request: SelectRequest) -> bytes:
    return signer.seal(_encoder.encode(request), "select request")


def decode_request(signer: ControlSigner, frame: bytes) -> tuple[SelectRequest, np.ndarray, np.ndarray]:
    """Return the request and its tokens (int64) and roi (bool) as read-only arrays.

    Freshness (session and counter) is the producer's to check: it alone knows both.

    Raises:
        MessageError: anything unauthenticated, malformed, inconsistent or of another version.
    """
    request = _decode(signer.open(frame, "select request"), SelectRequest, "select request")
    count, remainder = divmod(len(request.tokens), TOKEN_WIRE_DTYPE.itemsize)
    if remainder or count != len(request.roi) or count == 0:
        raise MessageError(
            f"select request with {len(request.tokens)} token bytes and {len(request.roi)} roi bytes: "
            f"expected 8 bytes per token, one roi byte per token, at least one token",
            "malformed",
            request.request_id,
        )
    roi = np.frombuffer(request.roi, dtype=np.uint8)
    if roi.max() > 1 or not roi.any():
        raise MessageError(
            "select request roi must be 0/1 bytes selecting at least one token", "malformed", request.request_id
        )
    try:
        _checked_part(request.part)
        _checked_part(request.span, "span")
    except ValueError as exc:
        raise MessageError(f"select request: {exc}", "malformed", request.request_id) from None
    return request, np.frombuffer(request.tokens, dtype=TOKEN_WIRE_DTYPE), roi.view(np.bool_)


def encode_refusal(signer: ControlSigner, request_id: int, reason: Reason, message: str) -> bytes:
    body = _encoder.encode(
        Refusal(v=PROTOCOL_VERSION, request_id=request_id, reason=reason, message=message[:MAX_MESSAGE_CHARS])
    )
    return signer.seal(body, "refusal")


def decode_refusal(signer: ControlSigner, frame: bytes) -> Refusal:
    """Raises MessageError for anything unauthenticated, malformed or of another version."""
    return _decode(signer.open(frame, "refusal"), Refusal, "refusal")


def encode_connect_request(signer: ControlSigner, nonce: bytes, buffer_bytes: int) -> bytes:
    request = ConnectRequest(v=PROTOCOL_VERSION, nonce=nonce, buffer_bytes=buffer_bytes)
    return signer.seal(_encoder.encode(request), "connect request")


def decode_connect_request(signer: ControlSigner, frame: bytes) -> ConnectRequest:
    """Raises MessageError for anything unauthenticated, malformed or of another version."""
    return _decode(signer.open(frame, "connect request"), ConnectRequest, "connect request")


def encode_connect_reply(signer: ControlSigner, nonce: bytes, store_port: int, control_port: int) -> bytes:
    reply = ConnectReply(v=PROTOCOL_VERSION, nonce=nonce, store_port=store_port, control_port=control_port)
    return signer.seal(_encoder.encode(reply), "connect reply")


def decode_connect_answer(signer: ControlSigner, frame: bytes) -> ConnectReply | Refusal:
    """The listener's answer to a connect request: a reply (signed as such) or a refusal.

    Raises:
        MessageError: anything unauthenticated, malformed or of another version.
    """
    try:
        return _decode(signer.open(frame, "connect reply"), ConnectReply, "connect reply")
    except MessageError as as_reply:
        try:
            return decode_refusal(signer, frame)
        except MessageError:
            raise as_reply from None


class Outcome(NamedTuple):
    """What a header on the data pipe carries; for a hit, besides the KV tensors that follow it."""

    request_id: int
    status: OutcomeStatus
    #: The select found nothing at first and waited (for the insert, or until it missed).
    waited: bool
    # The rest is a hit's; None / False otherwise.
    input_tokens: torch.Tensor | None = None
    roi: torch.Tensor | None = None
    has_value: bool = False
    has_hidden: bool = False
    #: The match key of the entry, to check it against the query.
    match_key: MatchKey | None = None
    #: A session header's nonce.
    session: bytes | None = None
    #: Which of key, value and hidden are lent: a loan descriptor stands in their place.
    lent: tuple[bool, bool, bool] = (False, False, False)


def _roi_words(count: int) -> int:
    return (count + 7) // 8


def make_header(
    tokens: np.ndarray, roi: np.ndarray, token_dtype: torch.dtype, has_value: bool, has_hidden: bool
) -> np.ndarray:
    """The outcome header of an entry's hit, built once at insert; :func:`stamp_header` adds the select.

    Layout (int64 words, in the pipe's native byte order like every tensor on it): magic, version,
    request id, status (:class:`OutcomeStatus`), token count n, token dtype code, flags (1: a value
    follows, 2: a hidden follows, 4: the select waited, 8/16/32: the key/value/hidden that follows
    is a loan descriptor), the n tokens, then the roi as n bytes (0/1)
    padded to whole words. Any other outcome has n = 0, dtype code 0 and at most the waited flag
    (:func:`make_outcome`); the session header has n = 0, dtype code 0, no flag and the nonce
    after the fixed words (:func:`make_session`). Tokens and roi travel inside the header: a
    message of their own would cost a rendezvous each on gloo.
    ``tokens``/``roi`` are what ``matching.token_arrays`` returned for a token tensor of ``token_dtype``.
    """
    count = tokens.shape[0]
    header = np.zeros(_HEADER_FIXED + count + _roi_words(count), dtype=np.int64)
    flags = (_FLAG_VALUE if has_value else 0) | (_FLAG_HIDDEN if has_hidden else 0)
    header[:_HEADER_FIXED] = (
        TAG_MAGIC,
        PROTOCOL_VERSION,
        0,
        OutcomeStatus.HIT,
        count,
        TOKEN_DTYPES.index(token_dtype),
        flags,
    )
    header[_HEADER_FIXED : _HEADER_FIXED + count] = tokens
    header[_HEADER_FIXED + count :].view(np.uint8)[:count] = roi
    return header


def make_outcome(request_id: int, status: OutcomeStatus, waited: bool) -> np.ndarray:
    """The outcome header of a select that did not hit (``status`` is MISS, BUSY or CLOSED)."""
    return np.array(
        (TAG_MAGIC, PROTOCOL_VERSION, request_id, status, 0, 0, _FLAG_WAITED if waited else 0), dtype=np.int64
    )


def make_session(session: bytes) -> np.ndarray:
    """The session header: the first tensor the producer sends on the data pipe."""
    header = np.zeros(_HEADER_FIXED + _SESSION_WORDS, dtype=np.int64)
    header[:_HEADER_FIXED] = (TAG_MAGIC, PROTOCOL_VERSION, 0, OutcomeStatus.SESSION, 0, 0, 0)
    header[_HEADER_FIXED:].view(np.uint8)[:] = np.frombuffer(session, dtype=np.uint8)
    return header


def stamp_header(
    header: np.ndarray, request_id: int, waited: bool, lent: tuple[bool, bool, bool] = (False, False, False)
) -> None:
    """Address an entry's header to a select; ``lent``: which of key, value and hidden go as loans."""
    header[_W_REQUEST_ID] = request_id
    header[_W_FLAGS] = (
        header[_W_FLAGS] & _FLAGS_AT_INSERT
        | (_FLAG_WAITED if waited else 0)
        | sum(flag for flag, is_lent in zip(_FLAGS_LENT, lent, strict=True) if is_lent)
    )


def parse_header(header: torch.Tensor | None) -> Outcome:
    """Validate a header received on the data pipe and unpack it (a hit's tokens and roi on the
    header's device).

    Raises:
        KVProtocolError: not a header of this protocol version, or inconsistent; the data stream is
            out of step.
    """
    if header is None or header.dtype != torch.int64 or header.dim() != 1 or header.shape[0] < _HEADER_FIXED:
        described = "None" if header is None else f"a {header.dtype} tensor of shape {tuple(header.shape)}"
        raise KVProtocolError(f"expected a lookup-buffer header on the data pipe, got {described}")
    words = (header if header.device.type == "cpu" else header.cpu()).numpy()
    magic, version, request_id, status_code, count, dtype_code, flags = words[:_HEADER_FIXED].tolist()
    if magic != TAG_MAGIC or version != PROTOCOL_VERSION:
        raise KVProtocolError(
            f"bad lookup-buffer header: magic {magic:#x}, version {version} (expected {TAG_MAGIC:#x}, "
            f"version {PROTOCOL_VERSION})"
        )
    fields = [request_id, status_code, count, dtype_code, flags]
    if request_id < 0 or status_code not in _STATUS_CODES:
        raise KVProtocolError(f"inconsistent lookup-buffer header {fields} of {words.shape[0]} words")
    status = OutcomeStatus(status_code)
    if status is OutcomeStatus.SESSION:
        if request_id or count or dtype_code or flags or words.shape[0] != _HEADER_FIXED + _SESSION_WORDS:
            raise KVProtocolError(f"inconsistent lookup-buffer session header {fields} of {words.shape[0]} words")
        return Outcome(0, status, False, session=words[_HEADER_FIXED:].tobytes())
    if status is not OutcomeStatus.HIT:
        if count or dtype_code or flags & ~_FLAG_WAITED or words.shape[0] != _HEADER_FIXED:
            raise KVProtocolError(f"inconsistent lookup-buffer {status.name} header {fields} of {words.shape[0]} words")
        return Outcome(request_id, status, bool(flags))
    if (
        not 1 <= count <= MAX_TOKENS
        or not 0 <= dtype_code < len(TOKEN_DTYPES)
        or flags & ~_FLAGS_HIT
        or flags & _FLAGS_LENT[1]
        and not flags & _FLAG_VALUE  # a lent item that does not follow
        or flags & _FLAGS_LENT[2]
        and not flags & _FLAG_HIDDEN
        or words.shape[0] != _HEADER_FIXED + count + _roi_words(count)
    ):
        raise KVProtocolError(f"inconsistent lookup-buffer hit header {fields} of {words.shape[0]} words")
    wide = words[_HEADER_FIXED : _HEADER_FIXED + count]
    tokens = wide.astype(_NUMPY_TOKEN_DTYPES[dtype_code])
    roi_bytes = words[_HEADER_FIXED + count :].view(np.uint8)[:count]
    if not np.array_equal(tokens, wide) or roi_bytes.max() > 1:
        raise KVProtocolError("lookup-buffer hit header: tokens out of their dtype's range or roi bytes not 0/1")
    roi = roi_bytes.astype(np.bool_)
    return Outcome(
        request_id,
        status,
        bool(flags & _FLAG_WAITED),
        _to_device(torch.from_numpy(tokens), header.device),
        _to_device(torch.from_numpy(roi), header.device),
        bool(flags & _FLAG_VALUE),
        bool(flags & _FLAG_HIDDEN),
        MatchKey(wide, roi),
        lent=tuple(bool(flags & flag) for flag in _FLAGS_LENT),
    )


def make_release(request_id: int) -> np.ndarray:
    """The consumer's release of the entry lent to select ``request_id``: magic, version, request id."""
    return np.array((RELEASE_MAGIC, PROTOCOL_VERSION, request_id), dtype=np.int64)


def parse_release(tensor: torch.Tensor | None) -> int:
    """The request id of a release received on the data pipe; KVProtocolError for anything else."""
    if tensor is not None and tensor.dtype == torch.int64 and tensor.shape == (3,) and tensor.device.type == "cpu":
        magic, version, request_id = tensor.numpy().tolist()
        if magic == RELEASE_MAGIC and version == PROTOCOL_VERSION and request_id >= 0:
            return request_id
    got = "None" if tensor is None else f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
    raise KVProtocolError(f"the consumer sent {got} on the data pipe; a lookup-buffer consumer sends only releases")


class LoanDescriptor(NamedTuple):
    """Where a lent tensor's bytes lie: ``pieces`` (``[n, 3]`` int64: export index, offset, bytes) in
    ``exports``; and ``stamp``: ``(export index, offset, value)`` of the loan's stamp word."""

    exports: list[ExportDescriptor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: np.ndarray
    stamp: tuple[int, int, int]


def make_loan_descriptor(
    exports: Sequence[ExportDescriptor],
    shape: Sequence[int],
    dtype: torch.dtype,
    places: np.ndarray,
    sizes: np.ndarray,
    stamp: tuple[int, int, int],
) -> np.ndarray:
    """A lent tensor's loan descriptor, int64 words: magic, dtype code, ndim, the shape, the export
    count, each export's descriptor number, inode and size, the stamp word's export index, offset
    and value, the piece count, then each piece's export index, offset in that export and size
    (``places`` and the sizes of the ``pieces`` of a :class:`~lookup_buffer.loans.LentTensor`)."""
    header = [LOAN_MAGIC, DTYPE_TO_CODE[dtype], len(shape), *shape, len(exports)]
    for export in exports:
        header += [export.fd, export.inode, export.nbytes]
    header += [*stamp, len(sizes)]
    words = np.empty(len(header) + 3 * len(sizes), dtype=np.int64)
    words[: len(header)] = header
    triples = words[len(header) :].reshape(-1, 3)
    triples[:, :2] = places
    triples[:, 2] = sizes
    return words


def parse_loan_descriptor(tensor: torch.Tensor) -> LoanDescriptor:
    """Validate a loan descriptor received on the data pipe: every field, and every piece against its
    export's announced size (which is checked against the file where the export is mapped);
    KVProtocolError if it is not one or is inconsistent."""
    if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.device.type != "cpu":
        raise KVProtocolError(f"expected a loan descriptor, got a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    words = tensor.numpy()
    try:
        magic, dtype_code, ndim = words[:3].tolist()
        dtype = CODE_TO_DTYPE.get(dtype_code)
        if magic != LOAN_MAGIC or dtype is None or not 0 <= ndim <= MAX_NDIM:
            raise ValueError(f"magic {magic:#x}, dtype code {dtype_code}, {ndim} dimensions")
        shape = tuple(words[3 : 3 + ndim].tolist())
        at = 3 + ndim
        export_count = int(words[at])
        if not 0 <= export_count <= len(words):
            raise ValueError(f"{export_count} exports")
        listed = words[at + 1 : at + 1 + 3 * export_count].tolist()
        exports = [ExportDescriptor(*listed[index : index + 3]) for index in range(0, len(listed), 3)]
        if len(exports) != export_count:
            raise ValueError(f"{export_count} exports in {len(listed)} words")
        at += 1 + 3 * export_count
        stamp = tuple(words[at : at + 3].tolist())
        piece_count = int(words[at + 3])
        triples = words[at + 4 :]
        if (
            min(shape, default=0) < 0
            or piece_count < 0
            or len(triples) != 3 * piece_count
            or len(stamp) != 3
            or any(min(export.fd, export.inode) < 0 or export.nbytes <= 0 for export in exports)
        ):
            raise ValueError(f"shape {shape}, {export_count} exports, {piece_count} pieces in {len(triples)} words")
        pieces = triples.reshape(-1, 3)
        index, offset, nbytes = (np.append(pieces[:, column], value) for column, value in enumerate((*stamp[:2], 8)))
        if len(index) and (index.min() < 0 or index.max() >= export_count or offset.min() < 0 or nbytes.min() < 0):
            raise ValueError("a piece or the stamp names no export, or has a negative offset or length")
        sizes = np.array([export.nbytes for export in exports], dtype=np.int64)
        if np.any(offset > sizes[index] - nbytes):  # subtracting: no sum can overflow
            raise ValueError("a piece or the stamp leaves its export")
    except (ValueError, TypeError, IndexError) as exc:  # a short descriptor unpacks badly, too
        raise KVProtocolError(f"inconsistent loan descriptor of {len(words)} words: {exc}") from None
    expected = math.prod(shape) * dtype.itemsize
    # Summed as floats first: the int64 sum of many hostile sizes could wrap around.
    total = int(pieces[:, 2].sum()) if float(pieces[:, 2].sum(dtype=np.float64)) < 2.0**62 else -1
    if total != expected:
        raise KVProtocolError(
            f"loan descriptor: pieces of {total} bytes (-1: far too many) for a {shape} {dtype} "
            f"tensor of {expected} bytes"
        )
    return LoanDescriptor(exports, shape, dtype, pieces, stamp)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.to(device)
