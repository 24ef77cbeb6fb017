"""The host memory pool recycles a buffer only once no tensor uses its memory any more."""

from __future__ import annotations

import gc

import torch

from kv_pipe.host_memory import POOL_MIN_BYTES, HandedOverBuffers, HostMemoryPool


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
    # The pipe hands large inline tensors over through torch.frombuffer on a memoryview of a frame.
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


FRAME_BYTES = 4096


def test_handed_over_frame_comes_back_only_after_every_tensor_over_it_is_gone():
    # As the pipe does it: a frame, a byte view of a numpy array over it, a tensor from hand_over's view.
    frames = HandedOverBuffers(keep=2)
    frame = torch.randint(0, 256, (FRAME_BYTES,), dtype=torch.uint8)
    frame_bytes = memoryview(frame.numpy())
    tensor = torch.frombuffer(frames.hand_over(frame, frame_bytes, 512, 1024), dtype=torch.uint8)
    assert torch.equal(tensor, frame[512:1536])
    assert frames.take_idle(FRAME_BYTES) is None, "taken back while the caller holds the tensor"
    derived = tensor.view(torch.int16).reshape(16, 32)[3:]
    del tensor
    gc.collect()
    assert frames.take_idle(FRAME_BYTES) is None, "taken back while a view of the tensor lives"
    as_numpy = derived.numpy()
    del derived
    assert frames.take_idle(FRAME_BYTES) is None, "taken back while a numpy array over the tensor lives"
    del as_numpy
    taken = frames.take_idle(FRAME_BYTES)
    assert taken is not None and taken[0] is frame and taken[1] is frame_bytes
    assert frames.take_idle(FRAME_BYTES) is None, "one frame was taken back twice"


def test_handed_over_frames_are_taken_back_in_any_order_and_only_the_newest_are_kept():
    frames = HandedOverBuffers(keep=2)
    made = [torch.zeros(FRAME_BYTES, dtype=torch.uint8) for _ in range(3)]
    views = [memoryview(frame.numpy()) for frame in made]
    tensors = [torch.frombuffer(frames.hand_over(frame, view, 0, 64), dtype=torch.uint8)
               for frame, view in zip(made, views, strict=True)]
    del tensors[2]  # the newest is dropped first; the oldest was forgotten when the third came
    assert frames.take_idle(FRAME_BYTES)[0] is made[2]
    assert frames.take_idle(FRAME_BYTES) is None
    tensors.clear()
    assert frames.take_idle(FRAME_BYTES)[0] is made[1]
    assert frames.take_idle(FRAME_BYTES) is None, "a forgotten frame came back"


def test_only_a_handed_over_buffer_of_the_size_asked_for_comes_back_and_idle_bytes_counts_unused_ones():
    handed = HandedOverBuffers(keep=3)
    sizes = (FRAME_BYTES, 2 * FRAME_BYTES, 2 * FRAME_BYTES)
    buffers = [torch.randint(0, 256, (size,), dtype=torch.uint8) for size in sizes]
    views = [memoryview(buffer.numpy()) for buffer in buffers]
    tensors = [torch.frombuffer(handed.hand_over(buffer, view, 0, 100), dtype=torch.uint8)
               for buffer, view in zip(buffers, views, strict=True)]
    assert handed.idle_bytes == 0
    del tensors[0]
    assert handed.idle_bytes == FRAME_BYTES
    assert handed.take_idle(2 * FRAME_BYTES) is None, "a buffer of another size, or one still held, came back"
    del tensors[1]
    assert handed.idle_bytes == 3 * FRAME_BYTES
    assert handed.take_idle(2 * FRAME_BYTES)[0] is buffers[2]
    assert handed.take_idle(2 * FRAME_BYTES) is None
    assert handed.take_idle(FRAME_BYTES)[0] is buffers[0]
    assert handed.idle_bytes == 0
