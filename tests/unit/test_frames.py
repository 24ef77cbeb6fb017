"""Frames without a second process: how a unit's records are laid out in frames, and how a received
frame is parsed and checked (:func:`kv_pipe.protocol.lay_out_records`, :func:`decode_frame`)."""

from __future__ import annotations

import pytest
import torch

from kv_pipe.errors import KVProtocolError
from kv_pipe.protocol import (
    HEADER_BYTES,
    RECORD_ALIGN,
    SHARED_DATA_START,
    SHARED_REGION_ALIGN,
    FrameKind,
    Record,
    decode_frame,
    frame_length,
    lay_out_records,
    pack_header,
    record_inline_capacity,
)

FRAME_BYTES = 8192  # small frames, so that a few records fill one
BUDGET = 1 << 30


def _tensor_record(tensor: torch.Tensor, place: int = 0) -> Record:
    return Record(FrameKind.TENSOR, tensor.dtype, tuple(tensor.shape), tensor.nbytes, place)


def _frames(laid_out, tensors, frame_bytes=FRAME_BYTES):
    """Write the records into frames as a sender does: each header at its offset, its inline bytes
    after it; a frame ends with a record that says no ``more``."""
    frames, frame = [], bytearray(frame_bytes)
    for (offset, header), tensor in zip(laid_out, tensors, strict=True):
        pack_header(header, memoryview(frame)[offset : offset + HEADER_BYTES])
        if header.inline and header.nbytes:
            start = offset + HEADER_BYTES
            frame[start : start + header.nbytes] = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        if not header.more:
            assert frame_length(offset, header) <= frame_bytes
            frames.append(frame)
            frame = bytearray(frame_bytes)
    return frames


def _unit():
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randn(3, 5, 7, generator=generator),  # 420 bytes, inline
        None,
        torch.randint(-(2**15), 2**15, (13, 11), dtype=torch.int16, generator=generator),  # odd shape
        torch.empty(0, 4),  # no bytes at all
        torch.randn(1500, generator=generator, dtype=torch.float64),  # 12000 bytes: larger than a frame
        torch.randint(0, 255, (6000,), dtype=torch.uint8, generator=generator),  # does not fit where it starts
        torch.randint(0, 255, (3500,), dtype=torch.uint8, generator=generator),  # fits, and fills the frame
        torch.randn(2, 3, generator=generator).to(torch.bfloat16),
    ]


def _records(unit):
    return [Record(FrameKind.NONE) if tensor is None else _tensor_record(tensor) for tensor in unit]


def test_a_unit_laid_out_and_decoded_comes_back_record_for_record():
    unit = _unit()
    laid_out = lay_out_records(
        _records(unit), FRAME_BYTES, True, seq=41, consumed=12345, want_credit=True, freed=3 * SHARED_REGION_ALIGN
    )
    seq = 41
    received = []
    for frame in _frames(laid_out, unit):
        records = decode_frame(memoryview(frame), True, BUDGET, shared_bytes=1 << 20, seq=seq)
        seq += len(records)
        received += [(offset, header, frame) for offset, header in records]
    assert [(offset, header) for offset, header, _ in received] == laid_out
    assert [header.seq for _, header in laid_out] == list(range(41, 41 + len(unit)))
    assert [header.freed for _, header in laid_out] == [3 * SHARED_REGION_ALIGN] + [0] * (len(unit) - 1)
    assert all(header.consumed == 12345 and header.want_credit for _, header in laid_out)
    for (offset, header, frame), tensor in zip(received, unit, strict=True):
        if tensor is None:
            assert header.kind is FrameKind.NONE
            continue
        assert (header.dtype, header.shape, header.nbytes) == (tensor.dtype, tuple(tensor.shape), tensor.nbytes)
        assert offset % RECORD_ALIGN == 0
        # Inline exactly when the tensor fits where its record starts.
        assert header.inline == (tensor.nbytes <= record_inline_capacity(FRAME_BYTES, offset))
        if header.inline and tensor.nbytes:
            start = offset + HEADER_BYTES
            data = torch.frombuffer(bytearray(frame[start : start + tensor.nbytes]), dtype=torch.uint8)
            assert torch.equal(data.view(tensor.dtype).reshape(tensor.shape), tensor)
    # Larger than a frame, or than the rest of the frame where its record starts: a payload.
    assert not laid_out[4][1].inline and not laid_out[5][1].inline and laid_out[5][1].more
    # No header fits after the 3500 bytes: the frame ends, the next record starts a new one.
    assert laid_out[6][1].inline and not laid_out[6][1].more
    assert laid_out[7][0] == 0 and laid_out[7][1].inline and not laid_out[7][1].more


def test_split_records_carry_no_bytes_and_shared_ones_name_their_place():
    tensors = [torch.arange(10, dtype=torch.int32), torch.ones(4, 4)]
    split = lay_out_records([_tensor_record(tensor) for tensor in tensors], FRAME_BYTES, False, 0, 0, False)
    assert [header.inline for _, header in split] == [False, False]
    assert [offset for offset, _ in split] == [0, HEADER_BYTES]  # headers alone share the frame
    (frame,) = _frames(split, tensors)
    assert decode_frame(memoryview(frame), False, BUDGET, 0, 0) == split

    place = SHARED_DATA_START + 5 * SHARED_REGION_ALIGN
    shared = lay_out_records(
        [_tensor_record(tensors[0], place), Record(FrameKind.NONE)], FRAME_BYTES, True, 9, 1, False
    )
    assert shared[0][1].place == place and not shared[0][1].inline  # small, yet not inside the frame
    (frame,) = _frames(shared, [tensors[0], None])
    assert decode_frame(memoryview(frame), True, BUDGET, shared_bytes=1 << 20, seq=9) == shared
    with pytest.raises(KVProtocolError, match="outside"):  # a place beyond what this side mapped
        decode_frame(memoryview(frame), True, BUDGET, shared_bytes=place, seq=9)


def _forge(headers_at, frame_bytes=FRAME_BYTES):
    frame = bytearray(frame_bytes)
    for offset, header in headers_at:
        pack_header(header, memoryview(frame)[offset : offset + HEADER_BYTES])
    return memoryview(frame)


def _two_nones(**second):
    laid_out = lay_out_records([Record(FrameKind.NONE), Record(FrameKind.NONE)], FRAME_BYTES, True, 5, 100, False)
    for name, value in second.items():
        setattr(laid_out[1][1], name, value)
    return laid_out


@pytest.mark.parametrize(
    ("second", "seq", "shared_bytes", "message"),
    [
        ({"consumed": 99}, 5, 0, "disagree on credit"),
        ({"want_credit": True}, 5, 0, "disagree on credit"),
        ({}, 4, 0, "arrived where 4 was due"),
        ({"seq": 7}, 5, 0, "arrived where 6 was due"),
        ({"freed": SHARED_DATA_START}, 5, 1 << 20, "other than its frame's first"),
        ({"kind": FrameKind.KEEPALIVE}, 5, 0, "after another record"),
    ],
)
def test_a_frame_whose_records_break_the_rules_is_refused(second, seq, shared_bytes, message):
    with pytest.raises(KVProtocolError, match=message):
        decode_frame(_forge(_two_nones(**second)), True, BUDGET, shared_bytes, seq)


def test_regions_given_back_where_none_were_lent_are_refused():
    (record,) = lay_out_records([Record(FrameKind.KEEPALIVE)], FRAME_BYTES, True, 0, 0, False, freed=SHARED_DATA_START)
    with pytest.raises(KVProtocolError, match="gave it none"):
        decode_frame(_forge([record]), True, BUDGET, shared_bytes=0, seq=0)
    assert decode_frame(_forge([record]), True, BUDGET, shared_bytes=1 << 20, seq=0) == [record]


def test_a_record_announced_past_the_end_of_the_frame_is_refused():
    tensors = [torch.full((3500,), 3, dtype=torch.uint8), None]
    laid_out = lay_out_records(_records(tensors), FRAME_BYTES, True, 0, 0, False)
    assert laid_out[0][1].more  # fits the sender's frames...
    (frame,) = _frames(laid_out, tensors)
    with pytest.raises(KVProtocolError, match="past the end of its frame"):  # ...not frames of 4096 bytes
        decode_frame(memoryview(frame)[:4096], True, BUDGET, 0, 0)
