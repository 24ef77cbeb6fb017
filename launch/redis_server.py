"""A ``redis-server`` that ``kvbridge serve`` starts for its instances' store, and stops at exit.

It listens on a Unix socket in a private temporary directory (mode 0700, so only this user can
reach the socket), which the instances use (``unix://PATH``: no other user of the host can connect;
it reads as fast as TCP on loopback here), and on a free loopback port; it asks for a password on both,
keeps nothing on disk (``save ""``, ``appendonly no``) and evicts least-recently-used objects once it
holds ``maxmemory``: a cache of KV, not a database. Everything it is told is in a configuration file
(mode 0600) in that directory, so its password never appears on a command line (``ps``,
``/proc/PID/cmdline``); the directory is made with the server's settings and removed when the
server is stopped.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from kv_pipe.auth import derive_key
from kv_pipe.errors import KVConfigError

logger = logging.getLogger(__name__)

#: How Redis spells a memory size (``maxmemory``): bytes, or a number with a unit.
_MEMORY_SIZE = re.compile(r"[1-9][0-9]*(?:b|k|kb|m|mb|g|gb)?", re.IGNORECASE)
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
#: The longest Unix socket path the kernel takes (``sun_path`` holds 108 bytes with the final NUL).
MAX_SOCKET_PATH = 107


def password_from_secret(secret: str) -> str:
    """The managed server's password: derived from the launch's ``kv_secret``, so that one secret
    is all a launch holds, and worthless as a key for the pipe or the stored objects' HMAC."""
    return derive_key(secret, "kv_store/redis-password").hex()


def memory_size(text: str) -> str:
    """``text`` if it is a Redis memory size (``1gb``, ``512mb``, ``1073741824``), else KVConfigError.
    Checked strictly: it is written into the server's configuration file."""
    if not _MEMORY_SIZE.fullmatch(text):
        raise KVConfigError(f"--kv-store-redis-memory must be a size such as 1gb, 512mb or 1073741824, got {text!r}")
    return text


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ManagedRedis:
    """One ``redis-server`` on a Unix socket in its own directory and on ``127.0.0.1:port``, with
    ``password``; ``start`` it, then ``stop`` it (or use it as a context manager). The directory and
    port are chosen at construction, so the instances' settings can name the server (:attr:`url`)
    before it runs; ``stop`` removes the directory, started or not. With ``cores``, the server's
    main and background threads run on those cores only."""

    def __init__(
        self,
        password: str,
        maxmemory: str = "1gb",
        port: int | None = None,
        executable: str = "redis-server",
        cores: Sequence[int] = (),
    ) -> None:
        if not password or any(c.isspace() or c in "\"'\\" for c in password):
            raise KVConfigError("the managed redis-server's password must be non-empty, without spaces or quotes")
        self.password = password
        self.maxmemory = memory_size(maxmemory)
        self.port = free_loopback_port() if port is None else port
        self.executable = executable
        self.cores = list(cores)
        self.process: subprocess.Popen | None = None
        self.directory: Path | None = Path(tempfile.mkdtemp(prefix="kvbridge-redis-"))  # mode 0700
        self.socket_path = self.directory / "redis.sock"
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            self.stop()
            raise KVConfigError(
                f"the managed redis-server's socket {self.socket_path} is longer than a Unix socket path "
                f"may be ({MAX_SOCKET_PATH} bytes): set TMPDIR to a shorter directory"
            )

    @property
    def url(self) -> str:
        """Where the instances reach the server: its Unix socket."""
        return f"unix://{self.socket_path}"

    def config(self, directory: Path) -> str:
        """The server's configuration file, for a server whose files live in ``directory``."""
        return "\n".join(
            [
                "bind 127.0.0.1",
                "protected-mode yes",
                f"port {self.port}",
                f"unixsocket {_quoted(str(self.socket_path))}",
                "unixsocketperm 700",
                "daemonize no",
                f"dir {_quoted(str(directory))}",
                f"logfile {_quoted(str(directory / 'redis.log'))}",
                f"requirepass {self.password}",
                f"maxmemory {self.maxmemory}",
                "maxmemory-policy allkeys-lru",
                'save ""',
                "appendonly no",
                # Redis's own placement of its main and background threads (none: the OS's).
                *(f"{key} {','.join(map(str, self.cores))}" for key in ("server_cpulist", "bio_cpulist") if self.cores),
                "",
            ]
        )

    def start(self, timeout: float = START_TIMEOUT) -> ManagedRedis:
        """Start the server and wait (at most ``timeout`` seconds) until it answers PING. On any
        failure the server is stopped, its directory removed, and the error names the cause."""
        if self.process is not None:
            raise RuntimeError("the managed redis-server was started already")
        if self.directory is None:
            raise RuntimeError("the managed redis-server was stopped: it cannot start again")
        try:
            path = self.directory / "redis.conf"
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(self.config(self.directory))
            try:
                self.process = subprocess.Popen(
                    [self.executable, str(path)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            except FileNotFoundError:
                raise KVConfigError(
                    f"--kv-store redis needs {self.executable!r} (e.g. apt-get install "
                    "redis-server), or give redis://HOST:PORT of a running server"
                ) from None
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "redis-server for the KV store on %s and 127.0.0.1:%d (maxmemory %s, allkeys-lru, nothing persisted)",
            self.url,
            self.port,
            self.maxmemory,
        )
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None and self.directory is not None
        deadline = time.monotonic() + timeout
        while not self.ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.directory / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                state = (
                    f"exited with code {self.process.returncode}"
                    if self.process.poll() is not None
                    else f"did not answer PING within {timeout:g} s"
                )
                raise RuntimeError(f"the managed redis-server on {self.url} {state}:\n{tail}")
            time.sleep(0.05)

    def ping(self, timeout: float = 1.0) -> bool:
        """Whether the server answers PING after AUTH with the password (RESP, one short exchange)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as connection:
                connection.sendall(_command("AUTH", self.password) + _command("PING"))
                answer = b""
                while answer.count(b"\r\n") < 2:
                    data = connection.recv(256)
                    if not data:
                        return False
                    answer += data
        except OSError:
            return False
        return answer == b"+OK\r\n+PONG\r\n"

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout`` seconds, reap it, remove its directory.
        Safe to call more than once, and on a server that never started."""
        process, self.process = self.process, None
        try:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("the managed redis-server did not stop within %g s: killing it", timeout)
                    process.kill()
                    process.wait(timeout=STOP_TIMEOUT)
        finally:
            directory, self.directory = self.directory, None
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ManagedRedis:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def _quoted(value: str) -> str:
    """``value`` as one argument of a Redis configuration line (a temporary directory may hold spaces)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _command(*words: str) -> bytes:
    """One command in Redis's wire protocol (RESP)."""
    encoded = [word.encode() for word in words]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(word), word) for word in encoded)
