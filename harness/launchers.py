"""The ``kvbridge`` console script and the pair's small workload, for the tests that launch them."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from harness import procs


def console_script() -> str:
    """The ``kvbridge`` command pip installed into this Python's environment."""
    path = Path(sysconfig.get_path("scripts")) / "kvbridge"
    assert path.is_file(), f"no kvbridge console script in {path.parent} (scripts/install.sh installs it)"
    return str(path)


#: A small workload: the pair then runs in a few seconds on 2 cores.
NUM_PROMPTS = 5
SMALL_RUN = {
    "KVBRIDGE_NUM_PROMPTS": str(NUM_PROMPTS),
    "KVBRIDGE_MAX_NEW_TOKENS": "6",
    "KVBRIDGE_MAX_PROMPT_LEN": "80",
    "KVBRIDGE_KV_TIMEOUT": "10",
    "KVBRIDGE_KV_CONNECT_TIMEOUT": "60",
    "KVBRIDGE_PEER_TIMEOUT": "60",
    "KVBRIDGE_SELECT_TIMEOUT": "5",
    "OMP_NUM_THREADS": "1",
}


def table_rows(stdout: str, word: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("|") and f"| {word} " in line]


def run_processes(
    commands: list[tuple[list[str], dict[str, str]]], tmp_path: Path, timeout: float
) -> list[procs.Finished]:
    """:func:`procs.run_commands` with the small workload in every command's environment."""
    return procs.run_commands([(command, {**SMALL_RUN, **env}) for command, env in commands], tmp_path, timeout)


def explain(result: procs.Finished) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"
