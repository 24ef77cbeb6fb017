"""Optional dependencies: which of kvbridge's extras provides which module, and an error that says so.

The transport (``kv_pipe``, ``lookup_buffer``, ``connector``) needs only the core dependencies.
The launchers need more: ``kvbridge pair`` the ``pair`` extra (transformers, tqdm), ``kvbridge
serve`` and the proxy the ``serve`` extra (aiohttp) and vLLM (the ``vllm`` extra). pyproject.toml's
``[project.optional-dependencies]`` lists the distributions; this module lists the modules they provide.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

#: extra -> the top-level modules it provides.
EXTRAS: dict[str, tuple[str, ...]] = {"pair": ("transformers", "tqdm"), "serve": ("aiohttp",), "vllm": ("vllm",)}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(
            f"{module} is not installed; it comes with kvbridge's {extra!r} extra: pip install 'kvbridge[{extra}]'",
            name=module,
        )
        self.extra = extra


def require(extra: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` is installed (nothing is imported)."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(extra, module)


@contextlib.contextmanager
def needs_extra(extra: str) -> Iterator[None]:
    """Turn the ModuleNotFoundError of a missing module of ``extra``, raised by the imports inside the
    block, into :class:`MissingExtraError`; any other import error passes unchanged."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in EXTRAS[extra]:
            raise
        raise MissingExtraError(extra, exc.name) from exc
