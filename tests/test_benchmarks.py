"""The benchmarks run end to end and print complete tables (their numbers are not judged: timing
thresholds do not belong in tests on a shared machine)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import procs

NUMBER = r"\d+(?:\.\d+)?"


def table_cells(stdout: str, first_cell: str) -> list[str]:
    """The cells of the one table row whose first cell is ``first_cell``."""
    rows = [line for line in stdout.splitlines() if re.match(rf"\|?\s*{re.escape(first_cell)}\s*\|", line)]
    assert len(rows) == 1, f"expected one row for {first_cell!r}:\n{stdout}"
    return [cell.strip() for cell in rows[0].strip().strip("|").split("|")]


@pytest.mark.timeout(200)
def test_bench_pipe_times_raw_pipe_and_the_one_copy_floor(tmp_path: Path) -> None:
    command = [sys.executable, "benchmarks/bench_pipe.py", "--sizes", "4K,1M,2M", "--iters", "2", "--rounds", "1"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("4 KiB", "1 MiB"):  # they fit a frame: the floor is timed
        cells = table_cells(result.stdout, size)
        assert len(cells) == 8 and all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:]), cells
        assert all(float(cell.rstrip("x")) > 0 for cell in cells[1:]), cells
    cells = table_cells(result.stdout, "2 MiB")  # a payload after its frame: no one-copy floor
    assert all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:6]) and cells[6:] == ["-", "-"], cells


@pytest.mark.timeout(200)
def test_bench_buffer_compares_drop_select_with_the_raw_pipe_and_fills(tmp_path: Path) -> None:
    [result] = procs.run_commands([([sys.executable, "benchmarks/bench_buffer.py", "--max-mib", "1"], {})],
                                  tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"):
        cells = table_cells(result.stdout, size)
        assert len(cells) == 7 and all(re.fullmatch(NUMBER, cell) and float(cell) > 0 for cell in cells[1:]), cells
    for fill in ("10", "1000", "10000"):
        cells = table_cells(result.stdout, fill)
        assert len(cells) == 4 and all(re.fullmatch(NUMBER, cell) for cell in cells[1:]), cells
