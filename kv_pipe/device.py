"""The pipe's device: which one it is, which GPU, the streams of its threads, and host <-> GPU copies.

* **An explicit device.** A CUDA pipe's device comes from the configuration (``kv_device_index``),
  never from ``torch.cuda.current_device()``: that is per thread, and pipes are built in threads of
  their own (a lookup buffer's listener, a connector's load pool), where it is ``cuda:0`` whatever
  GPU the engine uses.
* **The GPU's identity.** Each side's greeting carries its GPU's UUID (empty for a host pipe), so two
  processes on one GPU, which NCCL cannot connect, are refused at once with an error that names the
  host-staged mode.
* **The pipe's own streams.** On CUDA, every NCCL operation is issued by the pipe's own threads, each
  on a stream of its own made current on the pipe's device (:class:`CudaPipeStreams`). NCCL's
  ``Work.wait()`` does not block the host: it makes the *calling thread's current stream* wait. Issued
  from an engine thread, a receive kept posted between frames would hold the engine's kernels back;
  on the pipe's streams it holds nothing but the pipe. A caller's tensor is handed over with an event
  recorded on the caller's stream (the send stream waits for it), and a received tensor is complete
  before the caller sees it (its stream is synchronised) and is recorded as used by the caller's stream.
* **Host-staged copies.** :func:`copy_between` copies between host memory and a GPU on a stream of its
  own, after the work the calling thread queued before (the KV it wrote), and returns once the copy
  is done: the engine's streams never wait for it, and the destination can be used at once.
  :func:`pin_host_memory` pins host memory in place (the pipe's shared-memory segments), so that those
  copies are single DMA transfers.

On a host-only pipe every stream operation is a no-op (:class:`PipeStreams`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator

import torch

from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError
from kv_pipe.protocol import GPU_ID_BYTES

logger = logging.getLogger(__name__)

#: cudaHostRegister's flag: the memory is pinned for every GPU, not only the current one.
_REGISTER_PORTABLE = 1


def select_device(config: KVTransferConfig) -> torch.device:
    """The pipe's device: ``cpu``, or ``cuda:kv_device_index`` (the only visible GPU when unset).

    Never the calling thread's current device. Raises :class:`KVConfigError` when the index is
    missing with several GPUs visible or names no visible GPU.
    """
    if config.kv_buffer_device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise KVConfigError(
            "kv_buffer_device='cuda' but torch sees no CUDA device (for a GPU box whose "
            "processes share one GPU, or without NCCL, use kv_buffer_device='cpu')"
        )
    count = torch.cuda.device_count()
    index = config.kv_device_index
    if index is None:
        if count != 1:
            raise KVConfigError(
                f"kv_buffer_device='cuda' with {count} GPUs visible needs kv_device_index: the GPU of this "
                f"side (the vLLM connector takes it from the worker's KV caches; torchrun's LOCAL_RANK "
                f"is used by KVTransferConfig.from_env)"
            )
        index = 0
    if index >= count:
        raise KVConfigError(f"kv_device_index={index}, but torch sees {count} GPU(s)")
    return torch.device("cuda", index)


def gpu_identity(device: torch.device) -> bytes:
    """The UUID of the GPU ``device`` is (16 bytes), or b"" for a host device or where unknown."""
    if device.type != "cuda":
        return b""
    try:
        uuid = torch.cuda.get_device_properties(device.index).uuid
    except (AttributeError, AssertionError, RuntimeError):
        return b""
    raw = getattr(uuid, "bytes", None)
    if raw is not None and len(bytes(raw)) == GPU_ID_BYTES:
        return bytes(raw)
    text = str(uuid).strip()
    for prefix in ("GPU-", "MIG-"):
        text = text.removeprefix(prefix)
    hex_digits = text.replace("-", "")
    try:
        identity = bytes.fromhex(hex_digits)
    except ValueError:
        identity = b""
    if len(identity) != GPU_ID_BYTES:
        identity = hashlib.sha256(str(uuid).encode()).digest()[:GPU_ID_BYTES] if str(uuid) else b""
    return identity


def describe_gpu(identity: bytes) -> str:
    """A GPU identity the way nvidia-smi prints it (GPU-xxxxxxxx-xxxx-...)."""
    text = identity.hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


class PipeStreams:
    """The streams of a pipe's threads, for a host pipe: every operation is a no-op."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def context(self, role: str) -> contextlib.AbstractContextManager:
        """Make ``role``'s stream (``setup``, ``send`` or ``recv``) current on the pipe's device,
        in the calling thread, for the duration of the block."""
        return contextlib.nullcontext()

    def ready_event(self, tensor: torch.Tensor) -> object | None:
        """Caller's thread: an event after the work queued so far on its stream that produced
        ``tensor`` (on the pipe's device), for :meth:`wait_ready`; None where nothing is to wait for."""
        return None

    def wait_ready(self, event: object | None) -> None:
        """Pipe thread: the current stream waits for ``event`` (from :meth:`ready_event`)."""

    def synchronize(self) -> None:
        """Pipe thread: block until the current stream's work (a received frame or payload) is done."""

    def hand_over(self, tensor: torch.Tensor | None) -> None:
        """Caller's thread: ``tensor``, received by a pipe thread, is the caller's from now on."""


class CudaPipeStreams(PipeStreams):
    """One stream per role on the pipe's GPU, created for that device explicitly."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._streams = {role: torch.cuda.Stream(device=device) for role in ("setup", "send", "recv")}

    @contextlib.contextmanager
    def context(self, role: str) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[role]):
            yield

    def ready_event(self, tensor: torch.Tensor) -> object | None:
        if tensor.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def wait_ready(self, event: object | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def hand_over(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.device.type == "cuda" and tensor.numel():
            # The allocator reuses the memory only once the caller's stream is done with it too.
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


#: NCCL's buffer for each side of a connection between two ranks unless ``NCCL_BUFFSIZE`` says otherwise.
NCCL_DEFAULT_BUFFSIZE = 4 << 20


def nccl_pipe_bytes() -> int:
    """Device memory a CUDA pipe keeps while it lives, besides the tensors it hands out: its two
    payload communicators (one per direction), each with a send and a receive buffer of
    ``NCCL_BUFFSIZE``. An estimate from NCCL's own setting; its frames are host memory."""
    try:
        buffsize = int(os.environ.get("NCCL_BUFFSIZE", NCCL_DEFAULT_BUFFSIZE))
    except ValueError:
        buffsize = NCCL_DEFAULT_BUFFSIZE
    return 2 * 2 * max(buffsize, 0)


def pipe_streams(device: torch.device) -> PipeStreams:
    """The streams of a pipe on ``device``."""
    return CudaPipeStreams(device) if device.type == "cuda" else PipeStreams(device)


_copy_streams = threading.local()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream for host <-> GPU copies on ``device`` (made once per thread and GPU)."""
    streams = getattr(_copy_streams, "by_device", None)
    if streams is None:
        streams = _copy_streams.by_device = {}
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device=device)
    return stream


@contextlib.contextmanager
def staged_copies(device: torch.device) -> Iterator[None]:
    """Run the block's GPU work (gathers, scatters, host <-> GPU copies on ``device``) on a stream of
    this thread's own, after what the thread's current stream queued before (the KV it wrote), and
    return only once it is done. A no-op for a host ``device``."""
    if device.type != "cuda":
        yield
        return
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield
    stream.synchronize()


def copy_between(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)``, bit-exact, whatever devices the two are on; done when it returns.

    Between host memory and a GPU it is one copy on a stream of this thread's own
    (:func:`staged_copies`): a DMA transfer where the host memory is pinned.
    """
    if target.device == source.device:
        target.copy_(source)
        return
    gpu = target.device if target.device.type == "cuda" else source.device
    with staged_copies(gpu):
        target.copy_(source, non_blocking=True)


def pin_host_memory(address: int, nbytes: int) -> bool:
    """Pin ``nbytes`` of host memory at ``address`` in place (``cudaHostRegister``), so that copies
    to and from any GPU are single DMA transfers. False (and nothing pinned) where CUDA is absent or
    refuses; never raises. Undo with :func:`unpin_host_memory` before the memory is unmapped."""
    if not nbytes or not torch.cuda.is_available():
        return False
    try:
        status = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE))
    except (RuntimeError, AttributeError) as exc:
        logger.info("kvbridge: host memory not pinned (%s): host-staged copies go through CUDA's staging", exc)
        return False
    if status != 0:
        # The runtime keeps the error as this thread's last one: clear it, or the next kernel launch
        # check in this thread would report it as its own.
        clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
        if clear is not None:
            clear()
        logger.info(
            "kvbridge: cudaHostRegister of %d bytes failed (error %d): host-staged copies go through CUDA's staging",
            nbytes,
            status,
        )
        return False
    return True


def unpin_host_memory(address: int) -> None:
    """Undo :func:`pin_host_memory`; never raises."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except (RuntimeError, AttributeError):
        pass
