"""The ``kvbridge`` command: its version, and what it says when an optional dependency is missing."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import pytest

import launch
from harness.launchers import console_script
from launch import cli
from launch.extras import MissingExtraError, needs_extra


def test_console_script_prints_the_version() -> None:
    done = subprocess.run([console_script(), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvbridge {importlib.metadata.version('kvbridge')}\n"


def test_version_falls_back_to_the_source_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    assert cli.version() == importlib.metadata.version("kvbridge") == launch.__version__
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == launch.__version__


@pytest.mark.parametrize(
    ("argv", "missing", "extra"),
    [
        (["pair"], "transformers", "pair"),
        (["pair", "--num-prompts", "3"], "tqdm", "pair"),
        (["serve", "MODEL"], "aiohttp", "serve"),
        (["serve", "MODEL"], "vllm", "vllm"),
    ],
)
def test_a_missing_dependency_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, argv: list[str], missing: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # what an uninstalled module looks like to import
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert f"kvbridge {argv[0]}: {missing} is not installed" in error
    assert f"pip install 'kvbridge[{extra}]'" in error


@pytest.mark.parametrize(
    ("module", "missing", "extra"),
    [
        ("launch.proxy", "aiohttp", "serve"),
        ("launch.serve", "aiohttp", "serve"),
        ("launch.model", "transformers", "pair"),
        ("launch.pair", "tqdm", "pair"),
    ],
)
def test_launcher_modules_name_the_extra_they_miss(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: str, extra: str
) -> None:
    for name in ("proxy", "serve", "model", "pair"):  # imported afresh here, the originals restored afterwards
        monkeypatch.delitem(sys.modules, f"launch.{name}", raising=False)
        monkeypatch.delattr(launch, name, raising=False)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(MissingExtraError, match=rf"pip install 'kvbridge\[{extra}\]'") as error:
        importlib.import_module(module)
    assert error.value.name == missing and error.value.extra == extra


def test_other_import_errors_pass_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "not_an_extra_module", None)
    with pytest.raises(ModuleNotFoundError) as error, needs_extra("serve"):
        import not_an_extra_module  # noqa: F401
    assert not isinstance(error.value, MissingExtraError)
