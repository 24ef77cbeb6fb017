"""The host memory pool recycles a buffer only once no tensor uses its memory any more."""

from __future__ import annotations

import gc

import pytest
import torch

from kv_pipe.host_memory import POOL_MIN_BYTES, HostMemoryPool, size_class
from kv_pipe.protocol import HEADER_BYTES, HOST_FRAME_BYTES
from kv_pipe.wire import INLINE_VIEW_MIN_BYTES, HostWire


def test_buffer_comes_back_only_after_every_view_is_gone():
    pool = HostMemoryPool(max_idle_bytes=64 << 20)
    first = pool.allocate(POOL_MIN_BYTES + 3)
    address = first.data_ptr()
    first.fill_(7)
    view = first[10:20].view(torch.int8)
    del first
    gc.collect()
    assert pool.idle_bytes == 0, "recycled while a view still uses the memory"
    other = pool.allocate(POOL_MIN_BYTES + 3)
    assert other.data_ptr() != address
    assert torch.equal(view, torch.full((10,), 7, dtype=torch.int8))
    del view
    gc.collect()
    assert pool.idle_bytes > 0
    assert pool.allocate(POOL_MIN_BYTES + 3).data_ptr() == address, "the freed buffer was not reused"


def test_byte_views_keep_the_buffer_too():
    pool = HostMemoryPool(max_idle_bytes=64 << 20)
    frame = pool.allocate(POOL_MIN_BYTES)
    frame[:8] = torch.arange(8, dtype=torch.uint8)
    tensor = torch.frombuffer(memoryview(frame.numpy())[:8], dtype=torch.uint8)
    del frame
    gc.collect()
    assert pool.idle_bytes == 0, "recycled while a tensor over a byte view still uses the memory"
    assert tensor.tolist() == list(range(8))
    del tensor
    gc.collect()
    assert pool.idle_bytes == POOL_MIN_BYTES


def test_idle_memory_is_bounded_and_small_buffers_are_not_pooled():
    pool = HostMemoryPool(max_idle_bytes=2 * POOL_MIN_BYTES)
    buffers = [pool.allocate(POOL_MIN_BYTES) for _ in range(4)]
    small = pool.allocate(POOL_MIN_BYTES - 1)
    del buffers, small
    gc.collect()
    assert pool.idle_bytes == 2 * POOL_MIN_BYTES


def test_size_classes_have_at_most_a_quarter_of_slack_and_few_sizes():
    sizes = {size_class(n) for n in range(1, 1 << 16)}
    assert len(sizes) < 70
    for n in (1, 7, 8, 9, 1000, (1 << 20) + 1, 3 << 20, (64 << 20) - 1):
        assert n <= size_class(n) <= max(n * 1.25, n + 1)


@pytest.mark.timeout(30)
def test_a_buffer_dropped_inside_the_pools_own_lock_comes_back_later():
    """A finalizer may run anywhere, the pool's own critical section included (garbage collection
    there): it must not wait for the lock it runs under."""
    pool = HostMemoryPool(max_idle_bytes=64 << 20)
    tensor = pool.allocate(POOL_MIN_BYTES)
    with pool._lock:
        del tensor
    assert pool.idle_bytes == POOL_MIN_BYTES


def test_headroom_is_known_only_for_a_live_buffer_allocated_with_it_and_a_tensor_right_after_it():
    """Only bytes the pool's user keeps out of every tensor may be written in front of one: never
    those of a buffer without headroom (a caller's slice may start at the same offset), and never
    once the buffer went back, when the address may hold another tensor's memory."""
    pool = HostMemoryPool(max_idle_bytes=64 << 20)
    nbytes = POOL_MIN_BYTES + 512
    framed = pool.allocate(nbytes, headroom=512)
    assert pool.headroom(framed[512:]) == 512
    assert pool.headroom(framed[512:1000].view(torch.int32)) == 512  # a view of its start, any dtype
    assert pool.headroom(framed) == 0 and pool.headroom(framed[513:]) == 0 and pool.headroom(framed[1024:]) == 0
    address = framed.data_ptr()
    del framed
    gc.collect()
    plain = pool.allocate(nbytes)
    assert plain.data_ptr() == address, "the pool did not reuse the buffer: the test proves nothing"
    assert pool.headroom(plain[512:]) == 0, "a buffer reused without headroom still claimed it"
    assert pool.headroom(torch.empty(1 << 10, dtype=torch.uint8)[512:]) == 0  # not the pool's memory


def test_only_tensors_that_can_travel_inline_get_room_for_a_header():
    """Room in front costs a larger size class: a payload-sized tensor (sent after its frame, never
    in place) must not pay for it."""
    wire = HostWire(torch.device("cpu"), max_idle_bytes=256 << 20)
    inline = wire.allocate_to_send(INLINE_VIEW_MIN_BYTES)
    assert inline.untyped_storage().nbytes() == INLINE_VIEW_MIN_BYTES + HEADER_BYTES
    for nbytes in (INLINE_VIEW_MIN_BYTES - 1, HOST_FRAME_BYTES - HEADER_BYTES + 1, 64 << 20):
        tensor = wire.allocate_to_send(nbytes)
        assert tensor.untyped_storage().nbytes() == nbytes, nbytes
