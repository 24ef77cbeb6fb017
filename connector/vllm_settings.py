"""The kvbridge settings of a vLLM instance, read from vLLM's ``--kv-transfer-config``.

vLLM's own ``KVTransferConfig`` carries ``kv_role``, ``kv_port`` and ``kv_buffer_device``; every
other kvbridge field (``kv_ip``, ``kv_rank``, ``kv_buffer_size``, ``kv_timeout``, ...) and the
connector's own options go into ``kv_connector_extra_config``::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_consumer",
        "kv_port": 14579, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_ip": "10.0.0.5", "kv_timeout": 10, "kv_load_timeout": 5}}'

Connector options (extra config keys that are neither :class:`kv_pipe.KVTransferConfig` fields nor
:class:`lookup_buffer.config.BufferConfig` fields, which go to the producer's lookup buffer):

``kv_load_timeout`` (seconds, default 5)
    How long the consumer waits for the producer's entry of a request the producer announced
    (see :mod:`connector.transfer_plan`) before recomputing it. Unannounced requests never wait.
``kv_save_timeout`` (seconds, default 0)
    How long the producer waits for room in its lookup buffer before dropping a request's KV
    (the request is then announced with 0 tokens and the consumer computes it at once). The
    engine step waits too: by default it holds only for the copy out of the paged cache, and a
    full buffer (a decode instance that is behind) costs that request its transfer, not every
    running request its next token.
``kv_lend_blocks`` (bool, default true)
    Producer: lend a saved request's blocks where they lie instead of copying them out. Its caches
    are moved into shared memory in place at start (:mod:`kv_pipe.exported_memory`); a decode
    instance on the same host then copies the blocks straight into its own caches, the only copy,
    and one on another host gets them copied when it takes them. vLLM keeps a lent request's blocks
    until then (or until the entry expires, or its borrower is lost or holds it past
    ``kv_timeout``); they count against ``kv_buffer_size`` like copied entries.
``kv_lend_lease`` (seconds, default 2)
    Producer: how long after a request's end its lent blocks may stay lent. An entry no decode
    instance has taken by then (its client went away, its decode instance is late or never comes)
    is copied into the lookup buffer, where it stays selectable until it expires or gives way to
    newer entries, and vLLM gets its blocks back for new requests: an abandoned request holds host
    memory for a while, never the prefill instance's KV cache.
``kv_producer_tp_size`` (int, default: this instance's TP size)
    Consumer: the TP size of the prefill instance a request loads from when its
    ``kv_transfer_params`` do not say (requests without an announcement, which load from
    ``kv_ip:kv_port``; announcements name the prefill instance's TP size themselves). A decode
    instance may have another TP size than its prefill instances where one divides the other
    (:mod:`connector.tp_layout`).
``kv_thread_cores`` (``"auto"``, ``"inherit"`` or a core list such as ``"1,3"``, default ``"auto"``)
    The cores kvbridge's own threads (saves, loads, pipes, tier writers) run on: by default the
    process's cores minus those vLLM binds its compute threads to (``VLLM_CPU_OMP_THREADS_BIND``),
    so that they do not compete with the model's steps; see :mod:`kv_pipe.cores`.
``kv_secret_file`` (path, default unset)
    A file holding the shared secret (see :mod:`connector.secret`). The secret itself is never
    a key here: vLLM's command line and logs would show it. ``KVBRIDGE_KV_SECRET`` /
    ``KVBRIDGE_KV_SECRET_FILE`` in the instance's environment work too.

Of the lookup buffer's fields, ``kv_evict_unclaimed`` defaults to true here (false in
:class:`lookup_buffer.config.BufferConfig`): when the prefill instance's buffer is full, the oldest entries no
decode instance has taken yet (their client went away, their request was prefilled twice, their
decode instance never came) give way to new saves, and their lent blocks go back to vLLM,
instead of every new save failing until they expire. ``kv_save_timeout`` then matters only with
``"kv_evict_unclaimed": false``.

Roles: ``kv_producer`` (prefill) or ``kv_consumer`` (decode), as a lookup buffer carries KV one
way; ``kv_both`` with a ``kv_store`` entry is the storage tier (:mod:`connector.vllm_store`), and
is refused without one. A producer listens at its ``kv_ip:kv_port`` (an address of its own host,
which it announces in ``kv_transfer_params``); a consumer loads from the producer a request's
``kv_transfer_params`` name, and from its own ``kv_ip:kv_port`` for requests that name none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from connector.secret import SECRET_FILE_KEY, refuse_inline_secret, resolve_secret
from kv_pipe import cores
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError
from lookup_buffer.config import BufferConfig

#: Extra config keys owned by the connector; every other key must be a kvbridge config field.
_OPTION_DEFAULTS: dict[str, Any] = {
    "kv_load_timeout": 5.0,
    "kv_save_timeout": 0.0,
    "kv_lend_blocks": True,
    "kv_lend_lease": 2.0,
    "kv_producer_tp_size": None,
    cores.SETTING_KEY: cores.AUTO,
    SECRET_FILE_KEY: None,
}


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector needs from vLLM's configuration.

    Attributes:
        bridge: the kvbridge transport configuration (role, addresses, byte budget, pipe).
        load_timeout: see the module docstring (``kv_load_timeout``).
        save_timeout: see ``kv_save_timeout``.
        lend_blocks: see ``kv_lend_blocks``.
        lend_lease: see ``kv_lend_lease``.
        producer_tp_size: see ``kv_producer_tp_size`` (None: this instance's own TP size).
        buffer: what the producer's lookup buffer does with entries nobody selects (evicting
            them when full, by default here).
        thread_cores: see ``kv_thread_cores`` (a value of :func:`kv_pipe.cores.parse_setting`).
    """

    bridge: KVTransferConfig
    load_timeout: float
    save_timeout: float
    lend_blocks: bool = True
    lend_lease: float = 2.0
    producer_tp_size: int | None = None
    buffer: BufferConfig = dataclasses.field(default_factory=lambda: BufferConfig(kv_evict_unclaimed=True))
    thread_cores: cores.Setting = cores.AUTO

    @classmethod
    def from_vllm(
        cls,
        kv_role: str,
        kv_port: int,
        kv_buffer_device: str,
        extra: Mapping[str, Any],
        environ: Mapping[str, str] | None = None,
    ) -> ConnectorSettings:
        """Merge vLLM's fields with ``kv_connector_extra_config`` and the secret's sources (``environ``,
        default ``os.environ``); raise KVConfigError naming a bad key (never showing a secret)."""
        if not isinstance(extra, Mapping):
            raise KVConfigError(f"kv_connector_extra_config must be a mapping, got a {type(extra).__name__}")
        refuse_inline_secret(extra, "kv_connector_extra_config")
        options = dict(_OPTION_DEFAULTS)
        bridge_values: dict[str, Any] = {}
        # Unselected entries must not hold the budget (and vLLM's lent blocks) until they expire.
        buffer_values: dict[str, Any] = {"kv_evict_unclaimed": True}
        for name, value in extra.items():
            if name in options:
                options[name] = value
            elif name in BufferConfig.fields():
                buffer_values[name] = value
            else:
                bridge_values[name] = value
        for name in ("kv_role", "kv_buffer_device"):
            if name in bridge_values:
                raise KVConfigError(f"set {name} in vLLM's kv-transfer-config, not in kv_connector_extra_config")
        bridge_values["kv_role"] = kv_role
        bridge_values.setdefault("kv_port", kv_port)
        if kv_buffer_device not in ("cpu", "cuda"):
            raise KVConfigError(f"kv_buffer_device must be 'cpu' or 'cuda' for kvbridge, got {kv_buffer_device!r}")
        bridge_values["kv_buffer_device"] = kv_buffer_device
        if kv_role not in ("kv_producer", "kv_consumer"):
            raise KVConfigError(
                f"KVBridgeConnector needs kv_role 'kv_producer' (prefill instance) or 'kv_consumer' "
                f"(decode instance), or 'kv_both' with a kv_store entry (a storage tier), got "
                f"{kv_role!r}: a kvbridge lookup buffer carries KV one way"
            )
        bridge_values.setdefault("kv_rank", 0 if kv_role == "kv_producer" else 1)
        bridge_values["kv_secret"] = resolve_secret(environ, options[SECRET_FILE_KEY])
        bridge = KVTransferConfig.from_dict(bridge_values)
        buffer = BufferConfig.from_dict(buffer_values)
        for name in ("kv_load_timeout", "kv_save_timeout", "kv_lend_lease"):
            value = options[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise KVConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if not isinstance(options["kv_lend_blocks"], bool):
            raise KVConfigError(f"kv_lend_blocks must be true or false, got {options['kv_lend_blocks']!r}")
        producer_tp = options["kv_producer_tp_size"]
        if producer_tp is not None and (
            isinstance(producer_tp, bool) or not isinstance(producer_tp, int) or not 1 <= producer_tp <= MAX_TP_SIZE
        ):
            raise KVConfigError(f"kv_producer_tp_size must be a TP size from 1 to {MAX_TP_SIZE}, got {producer_tp!r}")
        return cls(
            bridge=bridge,
            load_timeout=float(options["kv_load_timeout"]),
            save_timeout=float(options["kv_save_timeout"]),
            lend_blocks=options["kv_lend_blocks"],
            lend_lease=float(options["kv_lend_lease"]),
            producer_tp_size=producer_tp,
            buffer=buffer,
            thread_cores=cores.parse_setting(options[cores.SETTING_KEY]),
        )


#: Largest TP size accepted in settings and announcements.
MAX_TP_SIZE = 1024


def listen_port_offset(tp_rank: int) -> int:
    """Port offset of TP rank ``tp_rank``: a producer's rank r listens at ``kv_port + r``, so an
    instance with TP size t uses ports ``kv_port .. kv_port + t - 1`` (space instances' kv_ports at
    least t apart); each connection adds two ports the kernel picks. A consumer's rank connects to
    the producer ranks whose KV heads it holds (:func:`connector.tp_layout.plan_sources`): with
    equal TP sizes, rank r to rank r."""
    return tp_rank
