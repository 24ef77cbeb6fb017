"""Where ``kv_secret`` comes from, in every mode (pair, vLLM, ``kvbridge serve``), and keeping it out of logs.

A secret on a command line is visible to every user of the host (``ps``, ``/proc/PID/cmdline``) and
ends up in logs (vLLM logs its non-default arguments), so kvbridge takes it only from:

``KVBRIDGE_KV_SECRET``
    the secret itself, in the environment (``/proc/PID/environ`` is readable by the same user and
    root only);
``KVBRIDGE_KV_SECRET_FILE`` or the ``kv_secret_file`` key of ``kv_connector_extra_config``
    the path of a file holding it (one trailing newline is ignored). The file must be a regular
    file with no permission for others (e.g. ``chmod 600``): a file that any user of the host may
    read is refused, as the secret would no longer be one.

At most one of these may be given; two are refused rather than one silently preferred.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from kv_pipe.errors import KVConfigError

SECRET_ENV = "KVBRIDGE_KV_SECRET"
SECRET_FILE_ENV = "KVBRIDGE_KV_SECRET_FILE"
#: The ``kv_connector_extra_config`` key naming a secret file (the path is not secret).
SECRET_FILE_KEY = "kv_secret_file"
#: A secret file is read whole; anything this large is not a secret file.
_MAX_SECRET_FILE_BYTES = 1 << 16


def read_secret_file(path: str) -> str:
    """The secret held in ``path``; raise :class:`KVConfigError` if the file is unfit (see the module)."""
    try:
        # O_NONBLOCK: opening a FIFO planted at the path must fail the regular-file check, not hang.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise KVConfigError(f"cannot open the kv_secret file {path!r}: {exc.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KVConfigError(f"the kv_secret file {path!r} is not a regular file")
        if info.st_mode & stat.S_IRWXO:
            raise KVConfigError(
                f"the kv_secret file {path!r} is accessible to every user of the host (mode "
                f"{stat.filemode(info.st_mode)}): restrict it, e.g. chmod 600 {path}"
            )
        data = file.read(_MAX_SECRET_FILE_BYTES + 1)
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise KVConfigError(f"the kv_secret file {path!r} is larger than {_MAX_SECRET_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KVConfigError(f"the kv_secret file {path!r} is not UTF-8 text") from None
    secret = text.removesuffix("\n").removesuffix("\r")
    if not secret:
        raise KVConfigError(f"the kv_secret file {path!r} is empty")
    return secret


def resolve_secret(environ: Mapping[str, str] | None = None, secret_file: str | None = None) -> str | None:
    """The secret from ``KVBRIDGE_KV_SECRET``, ``KVBRIDGE_KV_SECRET_FILE`` or ``secret_file``
    (a ``kv_secret_file`` setting); None when none is given. Raises KVConfigError when several are."""
    env = os.environ if environ is None else environ
    sources = {SECRET_ENV: env.get(SECRET_ENV), SECRET_FILE_ENV: env.get(SECRET_FILE_ENV), SECRET_FILE_KEY: secret_file}
    given = [name for name, value in sources.items() if value is not None]
    if len(given) > 1:
        raise KVConfigError(f"kv_secret is given by both {given[0]} and {given[1]}: give it once")
    if not given:
        return None
    if given[0] == SECRET_ENV:
        if not sources[SECRET_ENV]:
            raise KVConfigError(f"{SECRET_ENV} is set but empty")
        return sources[SECRET_ENV]
    path = sources[given[0]]
    if not isinstance(path, str) or not path:
        raise KVConfigError(f"{given[0]} must be the path of a file holding the secret")
    return read_secret_file(path)


def refuse_inline_secret(settings: Mapping[str, object], where: str) -> None:
    """Raise KVConfigError if ``settings`` carries ``kv_secret`` itself; the message never shows it."""
    if "kv_secret" in settings:
        raise KVConfigError(
            f"kv_secret in {where} would be visible to every user of the host (ps) and in vLLM's logs: "
            f"set {SECRET_ENV}, {SECRET_FILE_ENV} or {SECRET_FILE_KEY} instead"
        )
