"""The redis-server that ``kvbridge serve --kv-store redis`` starts: loopback and a Unix socket in a
private directory only, a password that no command line shows, nothing kept, and stopped with its
directory removed however serve ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import redis

from harness import procs
from kv_pipe.errors import KVConfigError
from launch import redis_server, serve

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cret-Tr0ub4dor&3"
PASSWORD = redis_server.password_from_secret(SECRET)


@pytest.fixture
def directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every directory a managed server makes, made under ``tmp_path`` to be looked at afterwards."""
    made: list[Path] = []
    real = tempfile.mkdtemp

    def mkdtemp(prefix: str) -> str:
        made.append(Path(real(prefix=prefix, dir=tmp_path)))
        return str(made[-1])

    monkeypatch.setattr(redis_server.tempfile, "mkdtemp", mkdtemp)
    return made


def client(port: int, password: str | None) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=10)


def assert_gone(server: redis_server.ManagedRedis, process, directory: Path) -> None:
    assert server.process is None and process.poll() is not None  # reaped
    assert not directory.exists()
    with pytest.raises(redis.ConnectionError):
        client(server.port, PASSWORD).ping()


def test_the_server_answers_only_with_its_password_which_no_command_line_shows(directories: list[Path]) -> None:
    server = redis_server.ManagedRedis(PASSWORD, "64mb").start()
    process = server.process
    try:
        (directory,) = directories
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in cmdline and SECRET.encode() not in cmdline
        assert PASSWORD.encode() not in Path(f"/proc/{process.pid}/environ").read_bytes()
        assert stat.S_IMODE((directory / "redis.conf").stat().st_mode) == 0o600
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert server.socket_path.parent == directory and server.url == f"unix://{server.socket_path}"
        assert stat.S_ISSOCK(server.socket_path.stat().st_mode)
        assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o700
        over_socket = redis.Redis.from_url(server.url, password=PASSWORD, socket_timeout=10)
        assert over_socket.set("through the socket", "yes") and client(server.port, PASSWORD).get("through the socket")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, socket_timeout=10).set("key", "value")  # NOAUTH on the socket too
        assert client(server.port, PASSWORD).ping()
        with pytest.raises(redis.AuthenticationError):
            client(server.port, None).set("key", "value")  # NOAUTH
        with pytest.raises(redis.AuthenticationError):
            client(server.port, "wrong").ping()
        settings = client(server.port, PASSWORD).config_get("*")
        assert (
            settings["bind"],
            settings["maxmemory"],
            settings["maxmemory-policy"],
            settings["save"],
            settings["appendonly"],
        ) == ("127.0.0.1", str(64 << 20), "allkeys-lru", "", "no")
        assert (settings["unixsocket"], settings["unixsocketperm"]) == (str(server.socket_path), "700")
    finally:
        server.stop()
    assert_gone(server, process, directory)
    server.stop()  # twice is harmless


def test_a_server_given_cores_runs_its_main_and_background_threads_there(directories: list[Path]) -> None:
    core = max(os.sched_getaffinity(0))
    server = redis_server.ManagedRedis(PASSWORD, "64mb", cores=[core]).start()
    try:
        placed = dict(procs.thread_cores(server.process.pid).values())
        ours = {name: cores for name, cores in placed.items() if name == "redis-server" or name.startswith("bio_")}
        assert ours and set(ours.values()) == {frozenset({core})}, placed
        assert client(server.port, PASSWORD).ping()
    finally:
        server.stop()


def test_the_server_stops_and_its_directory_goes_when_its_user_raises(directories: list[Path]) -> None:
    with pytest.raises(KeyboardInterrupt):
        with redis_server.ManagedRedis(PASSWORD) as server:
            process = server.process
            assert client(server.port, PASSWORD).ping()
            raise KeyboardInterrupt
    assert_gone(server, process, directories[0])


def test_a_server_that_cannot_start_leaves_nothing_behind(directories: list[Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = redis_server.ManagedRedis(PASSWORD, port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="exited with code") as error:
            server.start()
    assert "in use" in str(error.value) and PASSWORD not in str(error.value)
    assert server.process is None and not directories[0].exists()
    with pytest.raises(KVConfigError, match="apt-get install redis-server"):
        redis_server.ManagedRedis(PASSWORD, executable="/nonexistent/redis-server").start()
    assert not directories[1].exists()


def test_a_directory_too_long_for_a_socket_path_is_refused_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    with pytest.raises(KVConfigError, match="TMPDIR"):
        redis_server.ManagedRedis(PASSWORD)
    assert list(deep.iterdir()) == []


# A stand-in for a vLLM instance: reaches the store it is configured with, with the password in its
# environment, reports, and exits (code 3) instead of serving.
INSTANCE = """
import json, os, sys, redis
extra = json.loads(sys.argv[1])["kv_connector_extra_config"]
url = [tier for tier in extra["kv_store"].split(",") if tier.startswith("unix://")][0]
store = redis.Redis.from_url(url, password=os.environ["KVBRIDGE_STORE_PASSWORD"], socket_timeout=10)
store.set("seen", os.environ["KVBRIDGE_KV_SECRET"])
with open(os.environ["REPORT"], "w") as report:
    json.dump({"store": extra["kv_store"], "ping": store.ping()}, report)
sys.exit(3)
"""


@pytest.mark.parametrize("ending", ["instance exits", "interrupt"])
def test_serve_starts_the_server_for_its_instances_and_stops_it_however_it_ends(
    ending: str, tmp_path: Path, directories: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[redis_server.ManagedRedis, object]] = []

    class Recorded(redis_server.ManagedRedis):
        def start(self, timeout: float = redis_server.START_TIMEOUT) -> redis_server.ManagedRedis:
            super().start(timeout)
            started.append((self, self.process))
            return self

    def interrupted(url: str, process, timeout: float) -> None:
        process.wait(timeout=60)
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.redis_server, "ManagedRedis", Recorded)
    monkeypatch.setattr(
        serve,
        "vllm_serve_command",
        lambda model, host, port, transfer, extra: [sys.executable, "-c", INSTANCE, json.dumps(transfer)],
    )
    if ending == "interrupt":
        monkeypatch.setattr(serve, "wait_healthy", interrupted)
    for name in ("KVBRIDGE_KV_SECRET", "KVBRIDGE_KV_SECRET_FILE", "KVBRIDGE_STORE_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    report = tmp_path / "report.json"
    argv = [
        "/models/tiny",
        "--kv-store",
        "memory,redis",
        "--kv-store-redis-memory",
        "32mb",
        "--prefill-port",
        str(procs.free_port(1)),
        "--prefill-env",
        f"REPORT={report}",
    ]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt if ending == "interrupt" else RuntimeError):
            serve.main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    ((server, process),) = started
    assert json.loads(report.read_text()) == {"store": f"memory,{server.url}", "ping": True}
    assert_gone(server, process, directories[0])
    assert "KVBRIDGE_KV_SECRET" not in os.environ  # generated for the launch, given to the instances only


def test_serve_refusing_its_settings_removes_the_directory_made_for_the_server(
    directories: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVBRIDGE_KV_SECRET", "KVBRIDGE_KV_SECRET_FILE", "KVBRIDGE_STORE_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    argv = ["/models/tiny", "--kv-store", "memory,redis", "--prefill-env", "KVBRIDGE_STORE_PASSWORD=given"]
    assert serve.main(argv) == 2
    (directory,) = directories
    assert not directory.exists()
