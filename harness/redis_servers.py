"""Real redis-server processes for the store's tests: one server or a three-node cluster on free
loopback ports, in a temporary directory, nothing persisted, reaped at the end. A server may also
listen on a Unix socket in its directory (``unix``), which its ``url`` then names."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from harness import procs

START_TIMEOUT = 30.0


def _free_port_with_bus() -> int:
    """A port p with p + 10000 (a cluster node's bus port) free as well."""
    for _ in range(100):
        port = procs.free_port(1)
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a redis cluster node")


@dataclasses.dataclass
class RedisServer:
    port: int
    directory: Path
    options: list[str]
    password: str | None = None
    process: subprocess.Popen | None = None
    unix: bool = False

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}" if self.unix else f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10)

    def start(self) -> None:
        """Start (or restart, empty) the server and wait until it answers."""
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.directory / "redis.log"),
            *self.options,
        ]
        if self.password is not None:
            command += ["--requirepass", self.password]
        if self.unix:
            command += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log").read_text() if (self.directory / "redis.log").exists() else ""
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped server cannot die otherwise
            self.process.kill()
            self.process.wait(timeout=10)

    def pause(self) -> None:
        """The server stops answering, its port still open: only a timeout can tell."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


def start_server(directory: Path, *options: str, password: str | None = None, unix: bool = False) -> RedisServer:
    """A server on a free loopback port (and, with ``unix``, on ``directory/redis.sock``, which its
    ``url`` names)."""
    directory.mkdir(parents=True, exist_ok=True)
    server = RedisServer(procs.free_port(1), directory, list(options), password, unix=unix)
    server.start()
    return server


def start_cluster(directory: Path, nodes: int = 3) -> list[RedisServer]:
    """``nodes`` masters sharing the hash slots, the cluster answering on every node."""
    servers: list[RedisServer] = []
    try:
        for index in range(nodes):
            port = _free_port_with_bus()
            node_dir = directory / f"node{index}"
            node_dir.mkdir(parents=True)
            server = RedisServer(
                port, node_dir, ["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf")]
            )
            servers.append(server)
            server.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{s.port}" for s in servers),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT,
        )
        wait_cluster_ok(servers)
        return servers
    except BaseException:
        for server in servers:
            server.kill()
        raise


def wait_cluster_ok(servers: list[RedisServer]) -> None:
    """Until every node says the cluster serves all its slots."""
    deadline = time.monotonic() + START_TIMEOUT
    while not all(s.client().cluster("info")["cluster_state"] == "ok" for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError("the redis cluster did not become ok")
        time.sleep(0.1)


class WatchedSocket:
    """A client socket whose receives are cut into pieces of at most ``piece()`` bytes, with a hook
    called after each receive with the bytes received so far; sends are counted."""

    def __init__(
        self,
        sock: socket.socket,
        piece: Callable[[], int] | None = None,
        after_receive: Callable[[int], None] | None = None,
    ) -> None:
        self.sock = sock
        self.piece = piece
        self.after_receive = after_receive
        self.received = 0
        self.sends = 0

    def recv_into(self, buffer: memoryview) -> int:
        limit = len(buffer) if self.piece is None else min(len(buffer), self.piece())
        count = self.sock.recv_into(buffer[:limit])
        self.received += count
        if self.after_receive is not None:
            self.after_receive(self.received)
        return count

    def sendall(self, data: bytes) -> None:
        self.sends += 1
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def fileno(self) -> int:
        return self.sock.fileno()


class CannedServer:
    """A TCP listener that answers every request on its first connection with ``reply`` (not Redis:
    the client's view of a server that breaks the protocol). Use as a context manager."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(START_TIMEOUT)
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self.listener.accept()
            with connection:
                connection.settimeout(START_TIMEOUT)
                while connection.recv(1 << 16):
                    connection.sendall(self.reply)

    def __enter__(self) -> CannedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(START_TIMEOUT)
        self.listener.close()
