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
   communicator's sends and receives to one peer on one stream, so a receive kept posted (a pipe
   always has one) would hold every later send to that peer behind it.
5. With ``kv_secret``, a second challenge-response runs over the two groups themselves before any
   tensor moves. The store is unauthenticated, and the transport's connection addresses travel
   through it: a stranger who rewrites them could divert a group to itself. This binds the groups to
   the peer that proved the secret.

Every step has a bound (``kv_connect_timeout`` to find the peer, ``kv_timeout`` after that) and
fails with an error that names the cause.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist

from kv_pipe import auth
from kv_pipe.config import KVTransferConfig, local_address_towards
from kv_pipe.errors import KVPeerLostError, KVProtocolError, KVTransferError
from kv_pipe.protocol import Hello

_ARRIVALS_KEY = "kvbridge/arrivals"
#: Starts a greeting that says why its side refused to pair.
_REFUSAL = b"kvbridge-refused:"
_AUTH_TAG = 7  # the tag of the challenge-response over the groups; frames use others


@dataclasses.dataclass
class Connection:
    """A connected pair. ``store`` must outlive the groups (NCCL reads it when it first connects)."""

    store: dist.TCPStore
    outgoing: dist.ProcessGroup  # this side only sends here
    incoming: dist.ProcessGroup  # this side only receives here
    peer_hello: Hello


def connect(config: KVTransferConfig, port: int, hello: Hello, device: torch.device,
            listener: socket.socket | None = None) -> Connection:
    """Run the rendezvous at ``config.kv_ip:port`` and return the connected groups.

    ``listener``: rank 0 only, a socket already listening at ``port`` for the store (it is taken
    over); without it rank 0 binds ``kv_ip:port`` itself.

    Raises:
        KVPeerLostError: no peer within ``kv_connect_timeout``, the rendezvous already served a pair,
            or the peer vanished during setup.
        KVProtocolError: the peer is incompatible or failed authentication.
    """
    rank = config.kv_rank
    store = _open_store(config, port, listener)
    try:
        if store.add(_ARRIVALS_KEY, 1) > 2:
            _refuse(store, rank, config.kv_timeout,
                    f"kvbridge pipe rank {rank}: the rendezvous at {config.kv_ip}:{port} already served a pair "
                    f"(or a stranger wrote to it); the other side must close its old pipe and create a new one "
                    f"before this side reconnects")
        peer_greeting = exchange(store, rank, "hello", hello.pack())
        if peer_greeting.startswith(_REFUSAL):
            reason = peer_greeting[len(_REFUSAL):].decode(errors="replace")
            raise KVPeerLostError(f"kvbridge pipe rank {rank}: the peer refused to pair: {reason}")
        peer_hello = Hello.unpack(peer_greeting)
        authenticate_store(store, rank, config.kv_secret)
    except (KVProtocolError, KVPeerLostError):
        raise
    except (RuntimeError, OSError) as exc:  # torch's store errors derive from RuntimeError
        raise KVPeerLostError(f"kvbridge pipe rank {rank}: rendezvous with the peer failed: {exc}") from exc
    if peer_hello.frame_bytes != hello.frame_bytes or peer_hello.device != hello.device:
        raise KVProtocolError(
            f"incompatible peer: it uses {peer_hello.device} with {peer_hello.frame_bytes}-byte frames, "
            f"this side {hello.device} with {hello.frame_bytes}-byte frames"
        )
    store.set_timeout(datetime.timedelta(seconds=config.kv_timeout))
    outgoing, incoming = _create_groups(config, store, device)
    if config.kv_secret:
        authenticate_groups(outgoing, incoming, rank, config.kv_secret, device)
    return Connection(store, outgoing, incoming, peer_hello)


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
    try:
        return dist.TCPStore(config.kv_ip, port, world_size=2, is_master=rank == 0,
                             timeout=datetime.timedelta(seconds=config.kv_connect_timeout),
                             wait_for_workers=True, master_listen_fd=listen_fd)
    except (RuntimeError, OSError) as exc:  # DistStoreError, DistNetworkError, connection errors
        raise KVPeerLostError(
            f"kvbridge pipe rank {rank}: no peer at {config.kv_ip}:{port} within "
            f"{config.kv_connect_timeout:g} s (kv_connect_timeout): {exc}"
        ) from exc


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


def _create_groups(config: KVTransferConfig, store: dist.Store,
                   device: torch.device) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This side's (outgoing, incoming) groups."""
    rank = config.kv_rank
    timeout = datetime.timedelta(seconds=config.kv_timeout)
    groups = {}
    # Both sides build the 0 -> 1 group first: group construction is collective.
    for sender in (0, 1):
        prefix = f"kvbridge/group/{sender}to{1 - sender}"
        try:
            groups[sender] = _create_group(dist.PrefixStore(prefix, store), rank, timeout, device, config.kv_ip)
        except (RuntimeError, OSError) as exc:
            raise KVPeerLostError(
                f"kvbridge pipe rank {rank}: could not connect the group for rank {sender}'s sends: {exc}"
            ) from exc
    return groups[rank], groups[1 - rank]


def _create_group(store: dist.Store, rank: int, timeout: datetime.timedelta, device: torch.device,
                  kv_ip: str) -> dist.ProcessGroup:
    if device.type == "cuda":
        # Unverified on GPU (no GPU in this project's CI): same calls, NCCL backend.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Listen on the interface that faces the peer, not on whatever the host name resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(kv_ip))]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def authenticate_groups(outgoing: dist.ProcessGroup, incoming: dist.ProcessGroup, rank: int, secret: str,
                        device: torch.device) -> None:
    """Challenge-response over the groups: whoever is at their other end must hold ``secret``.

    Each side sends a fresh nonce on its outgoing group, then a proof over both nonces, at the same
    time as the peer does, so that each side judges the other's proof on its own and neither waits.
    """
    key = auth.derive_key(secret, "pipe-groups")
    peer = 1 - rank
    nonce = auth.new_nonce()
    try:
        peer_nonce = swap_bytes(outgoing, incoming, peer, nonce, device, _AUTH_TAG)
        proof = auth.sign(key, bytes([rank]), nonce, peer_nonce)
        peer_proof = swap_bytes(outgoing, incoming, peer, proof, device, _AUTH_TAG)
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


def swap_bytes(outgoing: dist.ProcessGroup, incoming: dist.ProcessGroup, peer: int, data: bytes,
               device: torch.device, tag: int) -> bytes:
    """Send ``data`` to the peer on ``tag`` and receive the same number of bytes from it."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    theirs = torch.zeros_like(mine)
    # Both posted before either is waited on: gloo completes a send only once the peer's receive is
    # posted, and both sides send first.
    sent = outgoing.send([mine], peer, tag)
    received = incoming.recv([theirs], peer, tag)
    sent.wait()
    received.wait()
    return theirs.cpu().numpy().tobytes()
