"""One entry point to this process's lookup buffer, in the style of vLLM's ``kv_transfer_state``.

:func:`ensure_kv_transfer_initialized` builds the buffer once from a :class:`KVConnectorConfig`:

* without ``kv_store``: a :class:`~lookup_buffer.SimpleBuffer` over a new
  :class:`~kv_pipe.TorchDistributedPipe` to the peer (``kv_role`` producer or consumer);
* with ``kv_store`` (a :func:`kv_store.open_store` spec: ``memory``, ``disk:PATH``,
  ``redis://HOST:PORT``, ``redis+cluster://HOST:PORT``, comma-separated for several tiers): a
  :class:`~lookup_buffer.StoreBuffer` over that store, no pipe; its memory tier holds at most
  ``kv_buffer_size`` bytes, its objects are signed with ``kv_secret`` when one is set.

:func:`get_kv_transfer_group` returns it, :func:`has_kv_transfer_group` says whether there is one,
:func:`ensure_kv_transfer_shutdown` closes it. :func:`build_kv_buffer` builds one without keeping it.

The store settings live here, not in :class:`kv_pipe.KVTransferConfig`: the pipe layer knows
nothing of stores, and vLLM's ``kv_connector_extra_config`` (which becomes a ``KVTransferConfig``)
keeps refusing settings its connector does not act on.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping

from kv_pipe import KVConfigError, KVTransferConfig, TorchDistributedPipe
from kv_store import mac_key_from_secret, open_store
from lookup_buffer import KVLookupBufferBase, SimpleBuffer, StoreBuffer
from lookup_buffer.config import BufferConfig


@dataclasses.dataclass(frozen=True)
class KVConnectorConfig:
    """A :class:`kv_pipe.KVTransferConfig` and the connector's store settings.

    Attributes:
        transfer: the transfer settings (role, secret, byte budget, pipe settings).
        kv_store: a store spec (see the module docstring); None: a pipe to the peer.
        kv_chunk_size: tokens per stored object (with ``kv_store``); a multiple of the KV block
            size for paged KV.
        buffer: what a producer's buffer over a pipe does with entries nobody selects.
    """

    transfer: KVTransferConfig = dataclasses.field(default_factory=KVTransferConfig)
    kv_store: str | None = None
    kv_chunk_size: int = 256
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)

    def __post_init__(self) -> None:
        if self.kv_store is not None and (not isinstance(self.kv_store, str) or not self.kv_store.strip()):
            raise KVConfigError(f"kv_store must be a store spec such as 'disk:/path' or None, got {self.kv_store!r}")
        if isinstance(self.kv_chunk_size, bool) or not isinstance(self.kv_chunk_size, int) or self.kv_chunk_size < 1:
            raise KVConfigError(f"kv_chunk_size must be an integer >= 1, got {self.kv_chunk_size!r}")

    @classmethod
    def from_env(cls, transfer: KVTransferConfig, environ: Mapping[str, str] | None = None) -> KVConnectorConfig:
        """``transfer`` with ``KVBRIDGE_KV_STORE``, ``KVBRIDGE_KV_CHUNK_SIZE`` and the lookup buffer's
        variables (:meth:`lookup_buffer.config.BufferConfig.from_env`); unset ones keep their defaults."""
        env = os.environ if environ is None else environ
        chunk_text = env.get("KVBRIDGE_KV_CHUNK_SIZE")
        try:
            chunk_size = cls.kv_chunk_size if chunk_text is None else int(chunk_text)
        except ValueError:
            raise KVConfigError(f"KVBRIDGE_KV_CHUNK_SIZE must be an integer, got {chunk_text!r}") from None
        return cls(
            transfer=transfer,
            kv_store=env.get("KVBRIDGE_KV_STORE") or None,
            kv_chunk_size=chunk_size,
            buffer=BufferConfig.from_env(env),
        )


def build_kv_buffer(
    config: KVConnectorConfig,
    *,
    identity: Mapping[str, str | int] | None = None,
    token_dim: int | None = None,
    block_size: int = 1,
) -> KVLookupBufferBase:
    """A new buffer as the module docstring says. Over a store, ``identity``, ``token_dim`` and
    ``block_size`` describe the KV (see :class:`lookup_buffer.StoreBuffer`); the engine knows them,
    the config does not. The caller owns the buffer (close it)."""
    transfer = config.transfer
    if config.kv_store is None:
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):  # refused before the pipe waits for its peer
            raise KVConfigError(
                f"a buffer over a pipe needs kv_role 'kv_producer' or 'kv_consumer', got "
                f"{transfer.kv_role!r}; 'kv_both' needs a kv_store"
            )
        pipe = TorchDistributedPipe(transfer)
        try:
            return SimpleBuffer(pipe, transfer, buffer_config=config.buffer)
        except BaseException:
            pipe.close()
            raise
    if identity is None or token_dim is None:
        raise KVConfigError("a buffer over a store needs the KV's identity and token dimension")
    store = open_store(config.kv_store, memory_bytes=transfer.kv_buffer_size)
    try:
        return StoreBuffer(
            store,
            transfer.kv_role,
            identity,
            token_dim=token_dim,
            chunk_size=config.kv_chunk_size,
            block_size=block_size,
            mac_key=mac_key_from_secret(transfer.kv_secret),
        )
    except BaseException:
        store.close()
        raise


_lock = threading.Lock()
_group: KVLookupBufferBase | None = None


def ensure_kv_transfer_initialized(
    config: KVConnectorConfig,
    *,
    identity: Mapping[str, str | int] | None = None,
    token_dim: int | None = None,
    block_size: int = 1,
) -> KVLookupBufferBase:
    """This process's buffer: built by :func:`build_kv_buffer` on the first call, the same one after
    (later arguments are then not used). Thread-safe."""
    global _group
    with _lock:
        if _group is None:
            _group = build_kv_buffer(config, identity=identity, token_dim=token_dim, block_size=block_size)
        return _group


def get_kv_transfer_group() -> KVLookupBufferBase:
    """The buffer :func:`ensure_kv_transfer_initialized` built; KVConfigError before that."""
    group = _group
    if group is None:
        raise KVConfigError("the KV transfer group is not initialized: call ensure_kv_transfer_initialized first")
    return group


def has_kv_transfer_group() -> bool:
    return _group is not None


def ensure_kv_transfer_shutdown() -> None:
    """Close and forget this process's buffer, if any (a later ensure builds a new one)."""
    global _group
    with _lock:
        group, _group = _group, None
    if group is not None:
        group.close()
