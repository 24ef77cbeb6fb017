"""README.md's quick start is what CI runs, its links and cited tests exist, and no file speaks of history.

CI (.ci/run) installs with ``bash scripts/install.sh``, then runs the line after the
``<!-- test command -->`` marker in README.md that starts with ``python -m pytest``. These tests
replicate that extraction, so the README and CI cannot drift apart unnoticed.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"
MARKER = "<!-- test command -->"
TEST_COMMAND = "python -m pytest tests"
MAIN_JOB_COMMAND = "bash scripts/install.sh && kvbridge pair"
CONSOLE_SCRIPT = ("kvbridge", "launch.cli:main")
#: A user's document: reference material belongs in docs/.
MAX_README_LINES = 280
#: What .ci/run does to find the test command; the test below checks it still does exactly this.
CI_EXTRACTION = ("grep -A3 '<!-- test command -->' README.md", "grep -m1 -E '^\\s*python -m pytest'")
#: Words that belong to a development log, not to the product's files.
HISTORY = re.compile(r"\bsession[- ]?[0-9]+|\bsessions? [0-9]|\bround [0-9]+ of work\b", re.IGNORECASE)
#: Not part of the repository's own text: build and install artefacts, caches.
_SKIPPED_DIRS = {".git", "__pycache__", "build", "dist", ".pytest_cache", ".ruff_cache"}


def readme_lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def ci_test_command(lines: list[str]) -> str | None:
    """The command .ci/run extracts: ``grep -A3 MARKER`` (each marker line and the 3 after it),
    then the first of those lines matching ``^\\s*python -m pytest``; None when there is none."""
    window: list[str] = []
    for index, line in enumerate(lines):
        if MARKER in line:
            window.extend(lines[index : index + 4])
    return next((line for line in window if re.match(r"\s*python -m pytest", line)), None)


def repository_text_files() -> list[Path]:
    """README, docs and every Python file of the repository (not the installed egg-info)."""
    found = []
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if parts & _SKIPPED_DIRS or any(part.endswith(".egg-info") for part in parts) or not path.is_file():
            continue
        if path.suffix == ".py" or path.suffix == ".md":
            found.append(path)
    return found


def test_ci_extracts_exactly_the_test_command_from_the_readme() -> None:
    assert ci_test_command(readme_lines()) == TEST_COMMAND


def test_ci_script_still_extracts_the_test_command_and_installs_first() -> None:
    script = CI_SCRIPT.read_text(encoding="utf-8")
    for step in CI_EXTRACTION:
        assert step in script, f".ci/run no longer runs {step!r}: update ci_test_command() to what it does now"
    assert "bash scripts/install.sh" in script
    assert script.index("bash scripts/install.sh") < script.index(CI_EXTRACTION[0])


def test_extraction_follows_the_marker_and_ignores_other_lines() -> None:
    """The replica of .ci/run's grep logic itself: a wrong replica would make the check above vacuous."""
    assert ci_test_command(["python -m pytest elsewhere", MARKER, "```bash", TEST_COMMAND, "```"]) == TEST_COMMAND
    assert ci_test_command([MARKER, "a", "b", "c", TEST_COMMAND]) is None  # more than 3 lines after
    assert ci_test_command([MARKER, "    python -m pytest tests -x"]) == "    python -m pytest tests -x"
    assert ci_test_command(["python -m pytest tests"]) is None  # no marker


def test_readme_quick_start_is_the_main_job_then_the_tests() -> None:
    lines = [line.strip() for line in readme_lines()]
    assert MAIN_JOB_COMMAND in lines
    command_lines = [line for line in lines if line in (MAIN_JOB_COMMAND, TEST_COMMAND)]
    assert command_lines[:2] == [MAIN_JOB_COMMAND, TEST_COMMAND], "the quick start is these two commands, in order"


def test_kvbridge_console_script_is_declared_and_resolves() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    name, target = CONSOLE_SCRIPT
    assert scripts.get(name) == target, f"pyproject.toml does not declare the console script {name} = {target!r}"
    module_name, function_name = target.split(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


def test_readme_is_short() -> None:
    assert len(readme_lines()) <= MAX_README_LINES


def test_every_docs_link_in_the_readme_exists() -> None:
    targets = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text(encoding="utf-8"))
    assert targets, "README.md links no page under docs/"
    missing = sorted({target for target in targets if not (ROOT / target).is_file()})
    assert not missing, f"README.md links missing pages: {missing}"


def test_links_between_docs_pages_exist() -> None:
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+\.md)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).is_file():
                missing.append(f"{page.name} -> {target}")
    assert not missing, missing


def test_every_test_the_docs_cite_exists() -> None:
    """The failure tables name the test behind each row: a renamed or deleted test must not leave a
    row citing nothing."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    cited = {
        match for page in pages for match in re.findall(r"(test_\w+\.py)::(test_\w+)", page.read_text(encoding="utf-8"))
    }
    assert cited, "no page cites a test"
    defined: dict[str, set[str]] = {}
    missing = []
    for file_name, test_name in sorted(cited):
        if file_name not in defined:
            paths = sorted((ROOT / "tests").rglob(file_name))  # test files live in tier folders under tests/
            tree = ast.parse(paths[0].read_text(encoding="utf-8")) if paths else ast.Module(body=[])
            defined[file_name] = {
                node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        if test_name not in defined[file_name]:
            missing.append(f"{file_name}::{test_name}")
    assert not missing, f"the docs cite tests that do not exist: {missing}"


@pytest.mark.parametrize(
    "text, is_history",
    [
        ("what session " + "12 measured", True),
        ("in Session-" + "3", True),
        ("two sessions " + "5 and 6", True),
        ("the round 2 " + "of work", True),
        ("a session key is derived per purpose", False),
        ("three rounds of 5 round trips", False),
    ],
)
def test_history_pattern(text: str, is_history: bool) -> None:
    assert bool(HISTORY.search(text)) is is_history


def test_no_file_speaks_of_development_history() -> None:
    files = repository_text_files()
    assert README in files and any(path.suffix == ".py" for path in files)
    hits = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "development history in the repository:\n" + "\n".join(hits)
