"""The stored object format: every dtype comes back bit for bit, and every damaged, foreign or
unauthenticated object is refused with the reason."""

from __future__ import annotations

import struct

import numpy
import pytest
import torch
from blake3 import blake3

from harness.tensors import random_tensor, same_bits
from kv_pipe.protocol import DTYPE_TO_CODE
from kv_store import (
    KVStoreError,
    KVStoreObjectError,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    mac_key_from_secret,
    namespace,
)
from kv_store import objects as objects_module
from kv_store.objects import ChunkBuilder

pytestmark = pytest.mark.timeout(120)

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 1, 3), (33, 17, 9)]
TOKENS = [31, 7, 2**40, 5, 0, 11, 13]
KEY = chunk_keys(namespace({"model": "m"}), TOKENS, 16)[0].key
MAC = mac_key_from_secret("store secret")


def chunk_tensors(seed: int) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    tensors: list[torch.Tensor | None] = [
        random_tensor(generator, dtype, shape) for dtype in DTYPE_TO_CODE for shape in SHAPES
    ]
    tensors.insert(3, None)
    tensors.append(None)
    return tensors


@pytest.mark.parametrize("mac_key", [None, MAC], ids=["checksum", "hmac"])
def test_every_dtype_and_shape_comes_back_bit_for_bit(mac_key):
    tensors = chunk_tensors(1)
    got = decode_chunk(encode_chunk(KEY, TOKENS, tensors, mac_key), KEY, TOKENS, mac_key)
    assert len(got) == len(tensors)
    assert all(same_bits(a, b) for a, b in zip(got, tensors, strict=True))


def test_views_and_conjugates_are_stored_as_their_values():
    generator = torch.Generator().manual_seed(2)
    base = random_tensor(generator, torch.float32, (6, 10))
    complex_base = random_tensor(generator, torch.complex64, (4, 3))
    tensors = [base[::2, 1::3], base.t(), complex_base.conj(), (-base.to(torch.float64))]
    got = decode_chunk(encode_chunk(KEY, TOKENS, tensors, None), KEY, TOKENS, None)
    want = [t.resolve_conj().resolve_neg().contiguous() for t in tensors]
    assert all(same_bits(a, b) for a, b in zip(got, want, strict=True))


def refused(blob: bytes, key: bytes = KEY, tokens: list[int] = TOKENS, mac_key: bytes | None = None) -> str:
    with pytest.raises(KVStoreObjectError) as caught:
        decode_chunk(blob, key, tokens, mac_key)
    assert caught.value.reason in str(caught.value)
    return caught.value.reason


def test_a_truncated_object_is_refused():
    blob = encode_chunk(KEY, TOKENS, chunk_tensors(3), None)
    for length in (0, 5, 16, 50, len(blob) // 2, len(blob) - 1):
        assert refused(blob[:length]) == "truncated"


def test_a_flipped_bit_is_refused():
    blob = encode_chunk(KEY, TOKENS, chunk_tensors(4), MAC)
    body_start = 16 + 2 * 32
    generator = torch.Generator().manual_seed(4)
    # The checksum itself, the body's header, the tensor bytes.
    for position in [
        16,
        47,
        body_start,
        body_start + 40,
        len(blob) - 1,
        *torch.randint(body_start, len(blob), (20,), generator=generator).tolist(),
    ]:
        damaged = bytearray(blob)
        damaged[position] ^= 1 << position % 8
        assert refused(bytes(damaged)) == "checksum"
        assert refused(bytes(damaged), mac_key=MAC) == "checksum"
    damaged = bytearray(blob)
    damaged[60] ^= 4  # inside the HMAC: only a reader with the secret checks it
    assert refused(bytes(damaged), mac_key=MAC) == "not authenticated"


def test_another_key_or_other_tokens_are_refused():
    blob = encode_chunk(KEY, TOKENS, chunk_tensors(5), None)
    other = chunk_keys(namespace({"model": "other"}), TOKENS, 16)[0].key
    assert refused(blob, key=other) == "other key"
    assert refused(blob, tokens=[*TOKENS[:-1], TOKENS[-1] + 1]) == "tokens differ"
    assert refused(blob, tokens=TOKENS[:-1]) == "tokens differ"


def test_another_format_version_is_refused():
    blob = bytearray(encode_chunk(KEY, TOKENS, chunk_tensors(6), None))
    struct.pack_into("<H", blob, 4, objects_module.FORMAT_VERSION + 1)
    assert refused(bytes(blob)) == "format version"


def test_something_else_is_malformed():
    assert refused(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == "malformed"
    blob = encode_chunk(KEY, TOKENS, chunk_tensors(7), None)
    assert refused(bytes(blob) + b"\0") == "malformed"


def test_an_object_written_without_the_secret_is_refused():
    tensors = chunk_tensors(8)
    poisoned = encode_chunk(KEY, TOKENS, tensors, None)
    assert refused(poisoned, mac_key=MAC) == "not authenticated"
    other_secret = encode_chunk(KEY, TOKENS, tensors, mac_key_from_secret("another secret"))
    assert refused(other_secret, mac_key=MAC) == "not authenticated"
    assert "another secret" in str(pytest.raises(KVStoreObjectError, decode_chunk, other_secret, KEY, TOKENS, MAC))


def test_a_forged_header_with_a_valid_checksum_is_refused_field_by_field():
    """An attacker can compute the checksum: the body's fields are checked one by one."""
    blob = bytearray(encode_chunk(KEY, TOKENS, [torch.arange(6, dtype=torch.int32)], None))
    preamble_end = struct.calcsize("<4sHHQ")
    body_start = preamble_end + 32

    def forged(body: bytes) -> bytes:
        preamble = struct.pack("<4sHHQ", b"KVBS", objects_module.FORMAT_VERSION, 0, len(body))
        return preamble + objects_module._checksum(preamble, [body]) + body

    body = bytes(blob[body_start:])
    dtype_at = struct.calcsize("<HII") + len(KEY) + 8 * len(TOKENS)
    unknown_dtype = body[:dtype_at] + bytes([250]) + body[dtype_at + 1 :]
    bigger_shape = body[: dtype_at + 2] + struct.pack("<q", 7) + body[dtype_at + 10 :]
    negative_shape = body[: dtype_at + 2] + struct.pack("<q", -6) + body[dtype_at + 10 :]
    for case in (unknown_dtype, bigger_shape, negative_shape, body[:-1], body + b"\0"):
        assert refused(forged(case)) == "malformed"
    assert same_bits(decode_chunk(forged(body), KEY, TOKENS, None)[0], torch.arange(6, dtype=torch.int32))


def test_an_authenticated_object_with_a_new_body_and_its_checksum_is_refused():
    """Anyone can recompute the checksum of a changed body; only the key makes the tag that signs it."""
    blob = encode_chunk(KEY, TOKENS, [torch.arange(6, dtype=torch.int32)], MAC)
    preamble_end = struct.calcsize("<4sHHQ")
    body_start = preamble_end + 2 * 32
    body = bytearray(blob[body_start:])
    body[-1] ^= 1  # another value, same length
    preamble = bytes(blob[:preamble_end])
    checksum = objects_module._checksum(preamble, [bytes(body)])
    forged = preamble + checksum + bytes(blob[preamble_end + 32 : body_start]) + bytes(body)
    assert refused(forged, mac_key=MAC) == "not authenticated"
    assert decode_chunk(forged, KEY, TOKENS, None)[0][-1] == 5 ^ (1 << 24)  # the checksum alone passes it


def test_without_copies_the_tensors_view_the_blob_bit_exact_and_keep_it_alive():
    tensors = chunk_tensors(9)
    blob = encode_chunk(KEY, TOKENS, tensors, MAC)
    views = decode_chunk(blob, KEY, TOKENS, MAC, copy=False)
    assert all(same_bits(a, b) for a, b in zip(views, tensors, strict=True))
    start = numpy.frombuffer(blob, dtype=numpy.uint8).ctypes.data
    end = start + len(blob)
    payloads = [view for view in views if view is not None and view.numel()]
    assert payloads and all(start <= view.data_ptr() < end for view in payloads)
    del blob
    assert all(same_bits(a, b) for a, b in zip(views, tensors, strict=True))
    copies = decode_chunk(encode_chunk(KEY, TOKENS, tensors, None), KEY, TOKENS, None)
    assert all(
        copy.data_ptr() != view.data_ptr()
        for copy, view in zip(copies, views, strict=True)
        if view is not None and view.numel()
    )


@pytest.mark.parametrize("mac_key", [None, MAC], ids=["checksum", "hmac"])
def test_the_object_is_laid_out_byte_for_byte_as_documented(mac_key):
    generator = torch.Generator().manual_seed(10)
    floats, halves = random_tensor(generator, torch.float32, (3, 5)), random_tensor(generator, torch.float16, (7,))
    body = b"".join(
        [
            struct.pack("<HII", len(KEY), len(TOKENS), 3),
            KEY,
            struct.pack(f"<{len(TOKENS)}q", *TOKENS),
            struct.pack("<BBqq", DTYPE_TO_CODE[torch.float32], 2, 3, 5),
            struct.pack("<BB", 0, 0),
            struct.pack("<BBq", DTYPE_TO_CODE[torch.float16], 1, 7),
            floats.numpy().tobytes(),
            halves.numpy().tobytes(),
        ]
    )
    preamble = struct.pack("<4sHHQ", b"KVBS", objects_module.FORMAT_VERSION, 0 if mac_key is None else 1, len(body))
    digests = blake3(preamble + body).digest()
    if mac_key is not None:
        digests += blake3(preamble + digests, key=mac_key).digest()
    assert bytes(encode_chunk(KEY, TOKENS, [floats, None, halves], mac_key)) == preamble + digests + body


def test_an_object_is_read_only_memory_of_its_own_that_later_writes_to_its_sources_leave_alone():
    generator = torch.Generator().manual_seed(11)
    staging = random_tensor(generator, torch.float32, (4, 33, 9))
    before = staging.clone()
    strided = random_tensor(generator, torch.int64, (6, 10))[:, ::3]  # not contiguous
    blob = encode_chunk(KEY, TOKENS, [staging, strided], MAC)
    assert blob.readonly
    with pytest.raises(TypeError):
        blob[0] = 0
    staging.copy_(random_tensor(generator, torch.float32, (4, 33, 9)))  # the buffer reused for the next object
    got = decode_chunk(blob, KEY, TOKENS, MAC, copy=False)
    assert same_bits(got[0], before) and not same_bits(got[0], staging)
    assert same_bits(got[1], strided.contiguous())
    assert not numpy.frombuffer(blob, dtype=numpy.uint8).flags.writeable


def test_a_builder_written_in_place_makes_the_same_object_and_is_sealed_once():
    generator = torch.Generator().manual_seed(12)
    tensors = [random_tensor(generator, torch.float32, (5, 3, 7)), None, random_tensor(generator, torch.uint8, (32,))]
    specs = [None if tensor is None else (tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    builder = ChunkBuilder(KEY, TOKENS, specs, MAC)
    assert builder.tensors is not None and builder.tensors[1] is None
    assert builder.tensors[0] is not None and builder.tensors[0].data_ptr() % 64 == 0  # the payload is aligned
    for target, tensor in zip(builder.tensors, tensors, strict=True):
        if target is not None:
            target.copy_(tensor)
    blob = builder.seal()
    assert bytes(blob) == bytes(encode_chunk(KEY, TOKENS, tensors, MAC))
    assert builder.tensors is None
    with pytest.raises(KVStoreError, match="sealed already"):
        builder.seal()


def test_a_tensor_that_cannot_be_stored_is_refused_before_any_memory_is_taken():
    with pytest.raises(KVStoreError, match="cannot be stored"):
        ChunkBuilder(KEY, TOKENS, [(torch.qint8, (3,))], None)
    with pytest.raises(KVStoreError, match="at most"):
        ChunkBuilder(KEY, TOKENS, [(torch.float32, (1,) * (objects_module.MAX_NDIM + 1))], None)
    with pytest.raises(KVStoreError, match="negative"):
        ChunkBuilder(KEY, TOKENS, [(torch.float32, (2, -1))], None)
