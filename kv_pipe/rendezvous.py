"""How two pipe ends find each other, agree, authenticate, and connect one group per direction.

1. Rank 0 hosts a TCPStore at ``kv_ip:port``, listening on ``kv_ip`` only; rank 1 connects to it.
   The store serves one pair: a third arrival is refused, so a rank that restarts against a peer
   still holding its broken pipe is told so instead of pairing with the leftovers.
2. The sides exchange greetings (:class:`kv_pipe.protocol.Hello`: protocol version, frame size,
   budget, device, kv_timeout), so incompatible peers are refused with a reason instead of failing
   inside the transport.
3. With ``kv_secret``, a challenge-response through the store proves both sides hold the secret.
4. Two point-to-point groups are built, one per direction (rank 0 -> 1 and rank 1 -> 0). A side
   sends only on its outgoing group and receives only on its incoming one: NCCL runs a
   communicator's sends and receives to one peer on one stream, so a receive posted there would
   hold every later send to that peer behind it. These carry the frames, and are gloo groups
   whatever the device. A *split* pipe (every CUDA pipe; :mod:`kv_pipe.channel`) builds a second
   pair for its payloads alone, on the pipe's backend (NCCL on CUDA), on the same store.
   All groups are connected here, eagerly, in the same order on both sides, before any traffic:
   first the frame pair, then the payload pair, each 0 -> 1 before 1 -> 0, each NCCL group bound to
   the pipe's explicit device (``eager_connect_single_device``); then one primer byte crosses each
   group in the same order.
   Creating an NCCL communicator is collective and blocks until both sides join the *same* one: had
   each side connected lazily at its first operation (a send, on its outgoing group), rank 0 would
   wait in one communicator while rank 1 waits in the other, both until ``kv_timeout``. The primer
   creates whatever communicator the backend keeps for point-to-point operations the same way.
   The pipe's NCCL groups are created with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (each
   ``ProcessGroupNCCL`` reads it when it is constructed; the variable is restored at once), and a
   watchdog timeout of twice ``kv_timeout``: the pipe bounds its own waits by ``kv_timeout``, aborts
   its groups and raises ``KVPeerLostError``, and the watchdog never tears the process down for a
   failed pipe.
5. With ``kv_secret``, a second challenge-response runs over each pair of groups before any
   tensor moves. The store is unauthenticated, and the transport's connection addresses travel
   through it: a stranger who rewrites them could divert a group to itself. This binds the groups to
   the peer that proved the secret.

Two sides on the same GPU are refused after the greeting, before any group exists: NCCL cannot
connect two processes on one device; the error names the host-staged mode, which can.

On CUDA the caller runs this on the pipe's set-up stream with the pipe's device current
(:class:`kv_pipe.device.CudaPipeStreams`); nothing here looks at the calling thread's current device.

Every step has a bound (``kv_connect_timeout`` to find the peer, ``kv_timeout`` after that) and
fails with an error that names the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kv_pipe import auth
from kv_pipe.channel import wait_for
from kv_pipe.config import KVTransferConfig, local_address_towards
from kv_pipe.device import describe_gpu
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVProtocolError, KVTransferError
from kv_pipe.protocol import Hello

_ARRIVALS_KEY = "kvbridge/arrivals"
#: Starts a greeting that says why its side refused to pair.
_REFUSAL = b"kvbridge-refused:"
_MIN_DIAL_SECONDS = 0.1  # the shortest try at reaching rank 0's store
_AUTH_TAG = 7  # the tag of the challenge-response over the groups; frames use others
_PRIMER_TAG = 9  # the tag of the primer byte that connects each group; nothing else uses it
#: The groups of a pair, in the order both sides create and prime them: (label, sending rank).
GROUP_ORDER = (("0to1", 0), ("1to0", 1))
#: Prefix of the payload pair's labels (the frame pair's labels have none).
PAYLOAD_PAIR = "payloads-"
#: The NCCL watchdog's timeout, in kv_timeout: later than the pipe's own bound, so that the pipe
#: aborts a failed group before the watchdog would judge it.
NCCL_WATCHDOG_TIMEOUTS = 2
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_environment_lock = threading.Lock()


@dataclasses.dataclass
class Connection:
    """A connected pair. ``store`` must outlive the groups (NCCL reads it when it first connects)."""

    store: dist.TCPStore
    outgoing: dist.ProcessGroup  # this side only sends frames here (gloo)
    incoming: dist.ProcessGroup  # this side only receives frames here (gloo)
    peer_hello: Hello
    #: Split: this side's (outgoing, incoming) groups of payloads alone, on the pipe's backend.
    payloads: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


def connect(
    config: KVTransferConfig,
    port: int,
    hello: Hello,
    device: torch.device,
    listener: socket.socket | None = None,
    split: bool = False,
) -> Connection:
    """Run the rendezvous at ``config.kv_ip:port`` and return the connected groups.

    ``listener``: rank 0 only, a socket already listening at ``port`` for the store (it is taken
    over); without it rank 0 binds ``kv_ip:port`` itself. ``split``: build a pair of payload groups
    on ``device``'s backend besides the frame groups (gloo); both sides must agree.

    Raises:
        KVPeerLostError: no peer within ``kv_connect_timeout``, the rendezvous already served a pair,
            or the peer vanished during setup.
        KVProtocolError: the peer is incompatible or failed authentication.
        KVConfigError: both sides are on the same GPU (the message names the host-staged mode).
    """
    rank = config.kv_rank
    store = _open_store(config, port, listener)
    try:
        if store.add(_ARRIVALS_KEY, 1) > 2:
            _refuse(
                store,
                rank,
                config.kv_timeout,
                f"kvbridge pipe rank {rank}: the rendezvous at {config.kv_ip}:{port} already served a pair "
                f"(or a stranger wrote to it); the other side must close its old pipe and create a new one "
                f"before this side reconnects",
            )
        peer_greeting = exchange(store, rank, "hello", hello.pack())
        if peer_greeting.startswith(_REFUSAL):
            reason = peer_greeting[len(_REFUSAL) :].decode(errors="replace")
            raise KVPeerLostError(f"kvbridge pipe rank {rank}: the peer refused to pair: {reason}")
        peer_hello = Hello.unpack(peer_greeting)
        check_distinct_gpus(hello, peer_hello)
        authenticate_store(store, rank, config.kv_secret)
    except (KVProtocolError, KVPeerLostError, KVConfigError):
        raise
    except (RuntimeError, OSError) as exc:  # torch's store errors derive from RuntimeError
        raise KVPeerLostError(f"kvbridge pipe rank {rank}: rendezvous with the peer failed: {exc}") from exc
    if peer_hello.frame_bytes != hello.frame_bytes or peer_hello.device != hello.device:
        raise KVProtocolError(
            f"incompatible peer: it uses {peer_hello.device} with {peer_hello.frame_bytes}-byte frames, "
            f"this side {hello.device} with {hello.frame_bytes}-byte frames"
        )
    store.set_timeout(datetime.timedelta(seconds=config.kv_timeout))
    host = torch.device("cpu")
    pairs = [(*_create_groups(config, store, host, ""), host)]
    if split:
        pairs.append((*_create_groups(config, store, device, PAYLOAD_PAIR), device))
    try:
        for outgoing, incoming, pair_device in pairs:
            prime_groups(outgoing, incoming, rank, pair_device, config.kv_timeout)
    except KVTransferError:
        raise
    except (RuntimeError, OSError) as exc:
        if config.kv_secret:  # the groups are not authenticated yet: whoever answered may be a stranger
            raise KVProtocolError(
                f"authentication failed: the process connected to this side's groups did not answer their "
                f"primer within kv_timeout (a stranger who rewrote the store's keys, or a lost peer): {exc}"
            ) from exc
        raise KVPeerLostError(
            f"kvbridge pipe rank {rank}: the peer vanished while the groups connected: {exc}"
        ) from exc
    if config.kv_secret:
        for outgoing, incoming, pair_device in pairs:
            authenticate_groups(outgoing, incoming, rank, config.kv_secret, pair_device, config.kv_timeout)
    outgoing, incoming, _ = pairs[0]
    payloads = (pairs[1][0], pairs[1][1]) if split else None
    return Connection(store, outgoing, incoming, peer_hello, payloads)


def _refuse(store: dist.Store, rank: int, kv_timeout: float, reason: str) -> None:
    """Refuse to pair: publish ``reason`` where the peer reads this side's greeting, then raise.
    Rank 0's store goes down with it, so rank 0 first waits (briefly) until the peer has read it."""
    try:
        store.set(f"kvbridge/hello/{rank}", _REFUSAL + reason.encode())
        if rank == 0:
            store.wait(["kvbridge/hello/1"], datetime.timedelta(seconds=min(kv_timeout, 5.0)))
    except (RuntimeError, OSError):
        pass  # the peer is gone or slow: the refusal stands either way
    raise KVPeerLostError(reason)


def _open_store(config: KVTransferConfig, port: int, listener: socket.socket | None) -> dist.TCPStore:
    rank = config.kv_rank
    # TCPStore listens on every interface by itself; hand it a socket bound to kv_ip only.
    listen_fd = None
    if rank == 0:
        listen_fd = listener.detach() if listener is not None else _listen_on(config.kv_ip, port)
    timeout = datetime.timedelta(seconds=config.kv_connect_timeout)
    try:
        if rank == 0:
            return dist.TCPStore(
                config.kv_ip,
                port,
                world_size=2,
                is_master=True,
                timeout=timeout,
                wait_for_workers=True,
                master_listen_fd=listen_fd,
            )
        store = _dial_store(config.kv_ip, port, time.monotonic() + config.kv_connect_timeout)
        store.set_timeout(timeout)
        return store
    except (RuntimeError, OSError) as exc:  # DistStoreError, DistNetworkError, connection errors
        raise KVPeerLostError(
            f"kvbridge pipe rank {rank}: no peer at {config.kv_ip}:{port} within "
            f"{config.kv_connect_timeout:g} s (kv_connect_timeout): {exc}"
        ) from exc


def _dial_store(host: str, port: int, deadline: float) -> dist.TCPStore:
    """Connect to rank 0's store by about ``deadline``.

    One TCPStore client retries on its own after a pause, and a try that fails late can take about
    three times its timeout; so each try gets a third of the time left and tries repeat until the
    deadline. The whole wait overruns ``kv_connect_timeout`` by its last short try (under a
    second measured with nobody listening), not by twice the timeout.
    """
    while True:
        remaining = deadline - time.monotonic()
        try:
            return dist.TCPStore(
                host,
                port,
                world_size=2,
                is_master=False,
                timeout=datetime.timedelta(seconds=max(remaining / 3, _MIN_DIAL_SECONDS)),
            )
        except (RuntimeError, OSError):
            if deadline - time.monotonic() <= _MIN_DIAL_SECONDS:
                raise


def _listen_on(host: str, port: int) -> int:
    return listen(host, port).detach()  # the TCPStore owns the descriptor from here on


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (port 0: one the kernel picks), for a rank 0's store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise KVTransferError(f"kvbridge pipe rank 0 cannot listen on {host}:{port}: {exc}") from exc


def exchange(store: dist.Store, rank: int, name: str, value: bytes) -> bytes:
    """Publish this side's ``value`` under ``name`` and return the peer's.

    Rank 1 reads before it writes. Rank 0 hosts the store and may refuse, and so take the store
    down, as soon as it has read rank 1's value; by then rank 1 already holds what it needs to
    refuse with the same clear error instead of a lost connection.
    """
    mine, theirs = f"kvbridge/{name}/{rank}", f"kvbridge/{name}/{1 - rank}"
    if rank == 0:
        store.set(mine, value)
        return store.get(theirs)
    peer_value = store.get(theirs)
    store.set(mine, value)
    return peer_value


def authenticate_store(store: dist.Store, rank: int, secret: str | None) -> None:
    """Challenge-response on ``kv_secret`` through the store; both sides must agree on using one."""
    peer_mode = exchange(store, rank, "auth", b"required" if secret else b"none")
    if not secret:
        if peer_mode != b"none":
            raise KVProtocolError("authentication failed: the peer requires kv_secret and this side has none")
        return
    if peer_mode != b"required":
        raise KVProtocolError("authentication failed: this side requires kv_secret and the peer has none")
    key = auth.derive_key(secret, "pipe-rendezvous")
    nonce = auth.new_nonce()
    peer_nonce = exchange(store, rank, "nonce", nonce)
    peer_proof = exchange(store, rank, "proof", auth.sign(key, bytes([rank]), nonce, peer_nonce))
    if not auth.verify(key, peer_proof, bytes([1 - rank]), peer_nonce, nonce):
        raise KVProtocolError(
            "authentication failed: the peer does not hold this side's kv_secret (wrong secret or a stranger)"
        )


def check_distinct_gpus(mine: Hello, peer: Hello) -> None:
    """Refuse a peer on this side's own GPU (both greetings name it): NCCL cannot connect two
    processes on one device, and would only fail later with a lost peer."""
    if mine.gpu_id and mine.gpu_id == peer.gpu_id:
        raise KVConfigError(
            f"both sides of this pipe use the same GPU ({describe_gpu(mine.gpu_id)}): NCCL cannot connect two "
            f"processes on one GPU. Use the host-staged mode instead: kv_buffer_device='cpu' on both sides "
            f"(KV caches stay on the GPU; the connector copies blocks through the pipe's host memory, "
            f"shared memory on one host), or give each side its own GPU (kv_device_index)"
        )


def _create_groups(
    config: KVTransferConfig, store: dist.Store, device: torch.device, pair: str = ""
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This side's (outgoing, incoming) groups of a pair (``pair`` prefixes its labels), both
    connected: created in :data:`GROUP_ORDER` on both sides (construction is collective), on gloo
    for a host ``device``, else on NCCL bound to ``device``."""
    rank = config.kv_rank
    timeout = datetime.timedelta(seconds=config.kv_timeout)
    groups = {}
    for label, sender in GROUP_ORDER:
        try:
            groups[sender] = _create_group(
                dist.PrefixStore(f"kvbridge/group/{pair}{label}", store),
                rank,
                timeout,
                device,
                config.kv_ip,
                pair + label,
            )
        except (RuntimeError, OSError) as exc:
            raise KVPeerLostError(
                f"kvbridge pipe rank {rank}: could not connect the {pair}group for rank {sender}'s sends: {exc}"
            ) from exc
    return groups[rank], groups[1 - rank]


def _create_group(
    store: dist.Store, rank: int, timeout: datetime.timedelta, device: torch.device, kv_ip: str, label: str
) -> dist.ProcessGroup:
    """One connected group of a pair (``label`` names it, for tests and messages)."""
    if device.type == "cuda":
        return _create_nccl_group(store, rank, timeout, device)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Listen on the interface that faces the peer, not on whatever the host name resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(kv_ip))]
    return dist.ProcessGroupGloo(store, rank, 2, options)  # gloo connects both ends here


def _create_nccl_group(
    store: dist.Store, rank: int, timeout: datetime.timedelta, device: torch.device
) -> dist.ProcessGroup:
    """An NCCL group whose communicator is created now, on ``device`` (what ``device_id=`` of
    ``init_process_group`` does: ``eager_connect_single_device``), not at its first operation on
    whatever device is current then, and whose errors and timeouts are the pipe's to handle (see
    :func:`_pipe_error_handling`). Unverified on a GPU in this project's CI."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout * NCCL_WATCHDOG_TIMEOUTS
    options.is_high_priority_stream = False
    with _pipe_error_handling():
        group = dist.ProcessGroupNCCL(store, rank, 2, options)
    group.eager_connect_single_device(device)
    return group


@contextlib.contextmanager
def _pipe_error_handling() -> Iterator[None]:
    """Construct an NCCL group whose watchdog leaves errors to the waiter: with torch's default
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) a failed or timed-out operation of any group tears the
    whole process down, where the pipe raises KVPeerLostError and lives on. ProcessGroupNCCL takes
    this from the environment in its constructor and has no option for it, so the variable is set
    for the construction only and then restored; the engine's own groups keep their setting."""
    with _environment_lock:
        before = os.environ.get(_NCCL_ERROR_HANDLING)
        os.environ[_NCCL_ERROR_HANDLING] = "0"
        try:
            yield
        finally:
            if before is None:
                del os.environ[_NCCL_ERROR_HANDLING]
            else:
                os.environ[_NCCL_ERROR_HANDLING] = before


def prime_groups(
    outgoing: dist.ProcessGroup, incoming: dist.ProcessGroup, rank: int, device: torch.device, timeout: float
) -> None:
    """Send one byte through each group, in :data:`GROUP_ORDER` on both sides, and check it arrived
    (each wait at most ``timeout`` seconds).

    Whatever a backend sets up at a group's first point-to-point operation (NCCL: the communicator it
    keeps for a pair of ranks) is set up here, one group after the other on both sides, not at each
    side's first frame, where the two sides would start on different groups.
    """
    peer = 1 - rank
    for _, sender in GROUP_ORDER:
        probe = torch.full((1,), 0x5A + sender, dtype=torch.uint8, device=device)
        if sender == rank:
            wait_for(outgoing.send([probe], peer, _PRIMER_TAG), timeout)
        else:
            received = torch.zeros_like(probe)
            wait_for(incoming.recv([received], peer, _PRIMER_TAG), timeout)
            if int(received.cpu()[0]) != 0x5A + sender:
                raise KVProtocolError(
                    f"kvbridge pipe rank {rank}: the peer's primer on its group was "
                    f"{int(received.cpu()[0])}, not {0x5A + sender}: not a kvbridge pipe"
                )


def authenticate_groups(
    outgoing: dist.ProcessGroup,
    incoming: dist.ProcessGroup,
    rank: int,
    secret: str,
    device: torch.device,
    timeout: float,
) -> None:
    """Challenge-response over a pair of groups: whoever is at their other end must hold ``secret``.

    Each side sends a fresh nonce on its outgoing group, then a proof over both nonces, at the same
    time as the peer does, so that each side judges the other's proof on its own and neither waits.
    """
    key = auth.derive_key(secret, "pipe-groups")
    peer = 1 - rank
    nonce = auth.new_nonce()
    try:
        peer_nonce = swap_bytes(outgoing, incoming, peer, nonce, device, _AUTH_TAG, timeout)
        proof = auth.sign(key, bytes([rank]), nonce, peer_nonce)
        peer_proof = swap_bytes(outgoing, incoming, peer, proof, device, _AUTH_TAG, timeout)
    except (RuntimeError, OSError) as exc:
        raise KVProtocolError(
            f"authentication failed: the peer connected to this side's groups did not complete the "
            f"challenge within kv_timeout (a stranger, or a lost peer): {exc}"
        ) from exc
    if not auth.verify(key, peer_proof, bytes([peer]), peer_nonce, nonce):
        raise KVProtocolError(
            "authentication failed: the process connected to this side's groups does not hold kv_secret "
            "(the rendezvous store was tampered with, or a stranger answered)"
        )


def swap_bytes(
    outgoing: dist.ProcessGroup,
    incoming: dist.ProcessGroup,
    peer: int,
    data: bytes,
    device: torch.device,
    tag: int,
    timeout: float | None = None,
) -> bytes:
    """Send ``data`` to the peer on ``tag`` and receive the same number of bytes from it (each wait
    at most ``timeout`` seconds; None: the groups' own timeout, gloo's)."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    theirs = torch.zeros_like(mine)
    # Both posted before either is waited on: gloo completes a send only once the peer's receive is
    # posted, and both sides send first.
    sent = outgoing.send([mine], peer, tag)
    received = incoming.recv([theirs], peer, tag)
    for work in (sent, received):
        if timeout is None:
            work.wait()
        else:
            wait_for(work, timeout)
    return theirs.cpu().numpy().tobytes()
