"""Configuration shared by every kvbridge layer.

Field names follow vLLM's ``KVTransferConfig`` so that vLLM users recognise them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import socket
from collections.abc import Mapping
from typing import Any

from kv_pipe.errors import KVConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_BUFFER_DEVICES = ("cpu", "cuda")
SHARED_MEMORY_MODES = ("auto", "on", "off")

#: Environment variables read by :meth:`KVTransferConfig.from_env` (``KVBRIDGE_*`` beat torchrun's).
ENV_PREFIX = "KVBRIDGE_"


@dataclasses.dataclass
class KVTransferConfig:
    """How one side of a kvbridge connection is set up.

    Attributes:
        kv_role: ``kv_producer`` (prefill side, inserts KV), ``kv_consumer`` (decode side, selects
            KV) or ``kv_both`` (a storage tier); None (the default): no role, enough for a pipe, which
            carries tensors either way. Every lookup buffer and the connector need one.
        kv_rank: 0 or 1, this side's rank inside the 2-member transfer group. Rank 0 hosts the
            rendezvous (TCPStore) and, in a lookup buffer, the producer's control server.
        kv_parallel_size: members of the transfer group; kvbridge pipes are point-to-point, so 2.
        kv_ip: address of rank 0, where the rendezvous and control channel listen.
        kv_port: first port used (see docs/configuration.md, "Ports").
        kv_buffer_size: byte budget: bytes a pipe keeps in flight, and bytes a lookup buffer holds.
        kv_buffer_device: ``cpu`` (gloo, or shared memory on one host) or ``cuda`` (NCCL; tensors are
            received on the GPU ``kv_device_index``). ``cpu`` with KV caches on a GPU is the host-staged
            mode: the connector copies blocks between the GPU and the pipe's host memory, which works
            on any GPU box, one GPU included.
        kv_device_index: this side's GPU. With ``cuda``: the pipe's device (NCCL's communicators are
            bound to it, its streams live there); needed when more than one GPU is visible, and never
            taken from the calling thread's current device. With ``cpu`` (host-staged): the GPU the
            KV is copied from and to; the pipe then pins its shared-memory segments for that copy.
            None: no GPU (``cpu``), or the only visible one (``cuda``).
        kv_timeout: seconds after which a silent peer is declared lost; also the default bound of
            blocking waits such as a full lookup buffer. Must exceed the time one 64 MiB chunk takes
            on the wire.
        kv_connect_timeout: seconds to wait for the peer to appear when the pipe is created.
        kv_secret: optional shared secret; when set, both sides must hold the same one.
        kv_shared_memory: ``auto`` (the same-host path, payloads through shared memory and frames
            over a local socket, when both sides prove they share a host and network namespace,
            else everything over the transport), ``on`` (refuse to connect without it) or ``off``
            (always over the transport). CUDA pipes always use NCCL.

    What a producer's lookup buffer does with entries nobody selects is the buffer's own
    configuration (:class:`lookup_buffer.config.BufferConfig`).
    """

    kv_role: str | None = None
    kv_rank: int = 0
    kv_parallel_size: int = 2
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: int = 1 << 30
    kv_buffer_device: str = "cpu"
    kv_device_index: int | None = None
    kv_timeout: float = 30.0
    kv_connect_timeout: float = 300.0
    kv_secret: str | None = dataclasses.field(default=None, repr=False)
    kv_shared_memory: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`KVConfigError` naming the first invalid field."""
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise KVConfigError(f"kv_role must be one of {KV_ROLES} or None, got {self.kv_role!r}")
        if self.kv_parallel_size != 2:
            raise KVConfigError(
                f"kv_parallel_size must be 2 (kvbridge pipes are point-to-point), got {self.kv_parallel_size!r}"
            )
        if not _is_int(self.kv_rank) or self.kv_rank not in (0, 1):
            raise KVConfigError(f"kv_rank must be 0 or 1, got {self.kv_rank!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise KVConfigError(f"kv_ip must be a host name or IP address, got {self.kv_ip!r}")
        if not _is_int(self.kv_port) or not 1 <= self.kv_port <= 65535:
            raise KVConfigError(f"kv_port must be an integer in [1, 65535], got {self.kv_port!r}")
        if not _is_int(self.kv_buffer_size) or self.kv_buffer_size < 1 << 16:
            raise KVConfigError(
                f"kv_buffer_size must be an integer number of bytes >= 65536, got {self.kv_buffer_size!r}"
            )
        if self.kv_buffer_device not in KV_BUFFER_DEVICES:
            raise KVConfigError(f"kv_buffer_device must be one of {KV_BUFFER_DEVICES}, got {self.kv_buffer_device!r}")
        if self.kv_device_index is not None and (not _is_int(self.kv_device_index) or self.kv_device_index < 0):
            raise KVConfigError(f"kv_device_index must be None or a GPU index >= 0, got {self.kv_device_index!r}")
        for name in ("kv_timeout", "kv_connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise KVConfigError(f"{name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise KVConfigError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        if self.kv_secret is not None and (not isinstance(self.kv_secret, str) or not self.kv_secret):
            raise KVConfigError("kv_secret must be a non-empty string or None")
        if self.kv_shared_memory not in SHARED_MEMORY_MODES:
            raise KVConfigError(f"kv_shared_memory must be one of {SHARED_MEMORY_MODES}, got {self.kv_shared_memory!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def replace(self, **changes: Any) -> KVTransferConfig:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVTransferConfig:
        """Build from a mapping (e.g. vLLM's ``kv_connector_extra_config``); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise KVConfigError(f"unknown kvbridge config keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KVTransferConfig:
        """Build from torchrun's variables plus ``KVBRIDGE_*`` overrides.

        Mapping (a ``KVBRIDGE_<FIELD>`` variable always wins):

        ========================  =====================================================
        field                     default taken from
        ========================  =====================================================
        ``kv_rank``               ``RANK`` (0 = prefill/producer, 1 = decode/consumer)
        ``kv_role``               ``kv_producer`` for rank 0, ``kv_consumer`` for rank 1
        ``kv_ip``                 ``MASTER_ADDR``
        ``kv_port``               ``MASTER_PORT`` + 1 (torchrun's store keeps MASTER_PORT)
        ``kv_parallel_size``      2 (``WORLD_SIZE`` must be 2 when torchrun launches both)
        ``kv_device_index``       ``LOCAL_RANK``, only with ``kv_buffer_device=cuda``
        ========================  =====================================================

        Every other field (``kv_buffer_size``, ``kv_buffer_device``, ``kv_device_index`` (``none``
        for None), ``kv_timeout``,
        ``kv_connect_timeout``, ``kv_secret``, ``kv_shared_memory``) is read from
        ``KVBRIDGE_<FIELD>`` or keeps its default. Keyword ``overrides`` beat the environment. The
        lookup buffer's own variables are read by :meth:`lookup_buffer.config.BufferConfig.from_env`.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if "RANK" in env:
            values["kv_rank"] = _parse_int("RANK", env["RANK"])
        if "MASTER_ADDR" in env:
            values["kv_ip"] = env["MASTER_ADDR"]
        if "MASTER_PORT" in env:
            values["kv_port"] = _parse_int("MASTER_PORT", env["MASTER_PORT"]) + 1
        for field in dataclasses.fields(cls):
            key = ENV_PREFIX + field.name.upper()
            if key in env:
                values[field.name] = _parse_field(field, key, env[key])
        if "kv_role" not in values:
            values["kv_role"] = "kv_producer" if values.get("kv_rank", 0) == 0 else "kv_consumer"
        values.update(overrides)
        if (
            values.get("kv_buffer_device") == "cuda" and "kv_device_index" not in values and "LOCAL_RANK" in env
        ):  # torchrun: one GPU per local rank
            values["kv_device_index"] = _parse_int("LOCAL_RANK", env["LOCAL_RANK"])
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise KVConfigError(f"environment variable {key} must be an integer, got {text!r}") from None


def _parse_field(field: dataclasses.Field, key: str, text: str) -> Any:
    if field.name in ("kv_rank", "kv_parallel_size", "kv_port", "kv_buffer_size"):
        return _parse_int(key, text)
    if field.name == "kv_device_index":
        return None if text.strip().lower() in ("", "none") else _parse_int(key, text)
    if field.name in ("kv_timeout", "kv_connect_timeout"):
        try:
            return float(text)
        except ValueError:
            raise KVConfigError(f"environment variable {key} must be a number, got {text!r}") from None
    return text


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(key: str, text: str) -> bool:
    """The boolean an environment variable ``key`` holds (KVConfigError if it is not one)."""
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise KVConfigError(f"environment variable {key} must be one of {_TRUE + _FALSE}, got {text!r}")


def local_address_towards(remote_ip: str) -> str:
    """The local address the kernel would use to reach ``remote_ip``.

    gloo listens on the address the host name resolves to unless told otherwise, which is often
    127.0.0.1: a peer on another host then gets "connection refused". Asking the routing table
    (a UDP connect sends no packet) gives the interface that really faces the peer.
    """
    family = socket.AF_INET6 if _is_ipv6(remote_ip) else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((remote_ip, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False
