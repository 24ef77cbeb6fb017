"""How much KV cache each vLLM CPU instance of ``kvbridge serve`` gets when the user does not say.

vLLM on CPU reserves ``--gpu-memory-utilization`` (0.92 by default) of the host's memory for one
instance, so a second instance on the same host fails at start. When neither
``--kv-cache-memory-bytes`` nor ``--gpu-memory-utilization`` (nor ``VLLM_CPU_KVCACHE_SPACE``) is
given, ``kvbridge serve`` gives each instance ``--kv-cache-memory-bytes`` =
``KV_FRACTION * available / instances``, at most ``KV_CAP_BYTES``, in whole MiB: the other half of
the available memory stays for the models' weights, activations and the Python processes.

*Available* is measured as vLLM checks it at start: the smallest of ``MemAvailable``
(``/proc/meminfo``), the free plus reclaimable memory of each NUMA node (vLLM checks the node
of the instance's first core) and, in a memory-limited cgroup, the limit minus the usage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

#: Share of the available memory given to the KV caches of all instances together.
KV_FRACTION = 0.5
#: Per instance, whatever the host: a CPU engine cannot use more KV cache than this to advantage.
KV_CAP_BYTES = 16 << 30
MIB = 1 << 20
#: Options of ``vllm serve`` that size the KV cache; when one is given, the user's choice stands.
KV_SIZE_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
KV_SIZE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: cgroup v1 reports "no limit" as a value near 2**63.
_NO_CGROUP_LIMIT = 1 << 62


def user_sized(serve_args: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``vllm serve`` arguments or the instance's environment already size the KV cache."""
    given = any(arg == option or arg.startswith(option + "=") for arg in serve_args for option in KV_SIZE_OPTIONS)
    return given or KV_SIZE_ENV in env


def kv_cache_bytes(available: int, instances: int) -> int:
    """The KV cache of one of ``instances`` instances sharing ``available`` bytes (see the module)."""
    return min(KV_CAP_BYTES, int(available * KV_FRACTION / instances)) // MIB * MIB


def available_memory(root: str = "/") -> int | None:
    """Bytes an instance can count on (see the module), or None where the host does not say (not Linux)."""
    base = Path(root)
    figures = []
    meminfo = _meminfo(base / "proc/meminfo")
    if "MemAvailable" in meminfo:
        figures.append(meminfo["MemAvailable"])
    for node in sorted((base / "sys/devices/system/node").glob("node[0-9]*/meminfo")):
        info = _meminfo(node)
        figures.append(sum(info.get(key, 0) for key in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")))
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(base / "sys/fs/cgroup" / limit_file)
        usage = _read_int(base / "sys/fs/cgroup" / usage_file)
        if limit is not None and limit < _NO_CGROUP_LIMIT and usage is not None:
            figures.append(max(limit - usage, 0))
            break
    return min(figures) if figures else None


def _meminfo(path: Path) -> dict[str, int]:
    """``/proc/meminfo`` or a NUMA node's ``meminfo`` ("Node 0 MemFree: 123 kB") as bytes by key."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        words = line.split()
        if words[:1] == ["Node"]:
            words = words[2:]
        if len(words) >= 2 and words[0].endswith(":") and words[1].isdigit():
            unit = 1024 if words[2:3] == ["kB"] else 1
            values[words[0][:-1]] = int(words[1]) * unit
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" when there is no limit
