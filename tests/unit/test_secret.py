"""Where kv_secret comes from (environment or a private file, never a command line), in every mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from connector.secret import SECRET_ENV, SECRET_FILE_ENV, read_secret_file, resolve_secret
from connector.vllm_settings import ConnectorSettings
from kv_pipe.errors import KVConfigError
from launch.pair import transfer_config

SECRET = "s3cret-Tr0ub4dor&3"


def secret_file(tmp_path: Path, text: str = SECRET + "\n", mode: int = 0o600) -> str:
    path = tmp_path / "kv_secret"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    assert resolve_secret({}) is None
    assert resolve_secret({SECRET_ENV: SECRET}) == SECRET
    assert resolve_secret({SECRET_FILE_ENV: path}) == SECRET  # one trailing newline is not part of it
    assert resolve_secret({}, secret_file=path) == SECRET
    assert read_secret_file(secret_file(tmp_path, "two\nlines\r\n")) == "two\nlines"
    assert read_secret_file(secret_file(tmp_path, SECRET, mode=0o640)) == SECRET  # shared with a group: allowed


@pytest.mark.parametrize(
    ("environ", "key", "named"),
    [
        ({SECRET_ENV: SECRET, SECRET_FILE_ENV: "/some/file"}, None, f"{SECRET_ENV} and {SECRET_FILE_ENV}"),
        ({SECRET_ENV: SECRET}, "/some/file", f"{SECRET_ENV} and kv_secret_file"),
        ({SECRET_ENV: ""}, None, "set but empty"),
        ({SECRET_FILE_ENV: ""}, None, "path of a file"),
    ],
)
def test_ambiguous_or_empty_secret_settings_are_refused(environ: dict, key: str | None, named: str) -> None:
    with pytest.raises(KVConfigError, match=named) as error:
        resolve_secret(environ, key)
    assert SECRET not in str(error.value)


@pytest.mark.parametrize(
    ("text", "mode", "named"),
    [
        (SECRET, 0o644, "accessible to every user of the host .* chmod 600"),
        (SECRET, 0o602, "accessible to every user"),
        ("", 0o600, "is empty"),
        ("\n", 0o600, "is empty"),
        ("x" * (1 << 17), 0o600, "larger than"),
    ],
)
def test_unfit_secret_files_are_refused(tmp_path: Path, text: str, mode: int, named: str) -> None:
    path = secret_file(tmp_path, text, mode)
    with pytest.raises(KVConfigError, match=named) as error:
        read_secret_file(path)
    assert path in str(error.value) and SECRET not in str(error.value)


def test_a_missing_file_or_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(KVConfigError, match="cannot open"):
        read_secret_file(str(tmp_path / "absent"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opening it for reading would wait for a writer: it must not
    with pytest.raises(KVConfigError, match="not a regular file"):
        read_secret_file(str(fifo))


def test_vllm_mode_reads_the_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from_env = ConnectorSettings.from_vllm("kv_consumer", 20000, "cpu", {"kv_ip": "10.0.0.1"}, {SECRET_ENV: SECRET})
    from_key = ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {"kv_secret_file": secret_file(tmp_path)}, {})
    assert from_env.bridge.kv_secret == from_key.bridge.kv_secret == SECRET
    assert ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {}, {}).bridge.kv_secret is None
    assert SECRET not in repr(from_env) + repr(from_key)


def test_vllm_mode_refuses_the_secret_in_the_transfer_config() -> None:
    with pytest.raises(KVConfigError, match="kv_secret in kv_connector_extra_config would be visible") as error:
        ConnectorSettings.from_vllm("kv_consumer", 20000, "cpu", {"kv_secret": SECRET}, {})
    with pytest.raises(KVConfigError, match="must be a mapping, got a list") as other:
        ConnectorSettings.from_vllm("kv_consumer", 20000, "cpu", [("kv_secret", SECRET)], {})  # type: ignore[arg-type]
    assert SECRET not in str(error.value) + str(other.value)


def test_pair_mode_reads_the_secret_from_the_environment_or_a_file(tmp_path: Path) -> None:
    torchrun = {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert transfer_config({**torchrun, SECRET_ENV: SECRET}).kv_secret == SECRET
    assert transfer_config({**torchrun, SECRET_FILE_ENV: secret_file(tmp_path)}).kv_secret == SECRET
    config = transfer_config(torchrun)
    assert (config.kv_secret, config.kv_rank, config.kv_port) == (None, 1, 29501)
    with pytest.raises(KVConfigError, match="accessible to every user"):
        transfer_config({**torchrun, SECRET_FILE_ENV: secret_file(tmp_path, mode=0o604)})
