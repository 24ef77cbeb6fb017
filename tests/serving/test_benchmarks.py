"""The benchmarks run end to end and print complete tables (their numbers are not judged: timing
thresholds do not belong in tests on a shared machine)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from harness import procs

NUMBER = r"\d+(?:\.\d+)?"


def table_cells(stdout: str, first_cell: str) -> list[str]:
    """The cells of the one table row whose first cell is ``first_cell``."""
    rows = [line for line in stdout.splitlines() if re.match(rf"\|?\s*{re.escape(first_cell)}\s*\|", line)]
    assert len(rows) == 1, f"expected one row for {first_cell!r}:\n{stdout}"
    return [cell.strip() for cell in rows[0].strip().strip("|").split("|")]


@pytest.mark.timeout(200)
def test_bench_pipe_times_raw_both_payload_paths_and_the_one_copy_floor(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_pipe", "--sizes", "4K,1M,2M", "--iters", "2", "--rounds", "1"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("4 KiB", "1 MiB"):  # they fit a frame: the floor is timed
        cells = table_cells(result.stdout, size)
        assert len(cells) == 11 and all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:]), cells
        assert all(float(cell) > 0 for cell in cells[6:10]), cells  # times (GB/s may round to 0.00)
    cells = table_cells(result.stdout, "2 MiB")  # a payload after its frame: no one-copy floor
    assert all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:9]) and cells[9:] == ["-", "-"], cells


PEER_SIZES = ("4 KiB", "64 KiB")
ALWAYS_THERE = ("memcpy (torch, 1 thread)", "raw gloo", "kvbridge (transport)")


def run_bench_peers(tmp_path: Path, *options: str) -> procs.Finished:
    """bench_peers at two small sizes, with NIXL hidden from its workers (its import fails as if it
    were not installed), so that the report of an absent peer is checked wherever the test runs."""
    hidden = tmp_path / "hidden" / "nixl"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ModuleNotFoundError("hidden from the benchmark", name="nixl")\n')
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_peers",
        "--sizes",
        "4K,64K",
        "--rounds",
        "1",
        "--iters",
        "2",
        "--plot",
        str(tmp_path / "peers.png"),
        "--timeout",
        "240",
        *options,
    ]
    env = {"PYTHONPATH": os.pathsep.join([str(procs.REPO), str(tmp_path / "hidden")])}
    [result] = procs.run_commands([(command, env)], tmp_path, timeout=280)
    return result


def assert_timed(stdout: str, name: str) -> None:
    cells = table_cells(stdout, name)
    assert len(cells) == 1 + 2 * len(PEER_SIZES), cells
    assert all(re.fullmatch(NUMBER, cell) for cell in cells[1:]) and all(float(c) > 0 for c in cells[2::2]), cells


def assert_peers_and_ratios(stdout: str) -> None:
    """NIXL is reported as not installed, with its ratio not applicable; Mooncake is timed, or says why not."""
    for nixl in ("NIXL (UCX)", "NIXL (UCX), told, ping-pong"):
        assert table_cells(stdout, nixl)[1:] == ["not installed: pip install 'kvbridge[peers]'", "-", "-", "-"]
    mooncake = table_cells(stdout, "Mooncake TE (tcp)")
    if not re.fullmatch(NUMBER, mooncake[1]):
        assert re.match(
            r"(not installed: pip install 'kvbridge\[peers\]'|cannot load: .+|failed to start: .+)$", mooncake[1]
        ) and mooncake[2:] == ["-", "-", "-"], mooncake
    assert table_cells(stdout, "kvbridge/NIXL")[1:] == ["n/a (NIXL (UCX): see above)"] * len(PEER_SIZES)
    assert table_cells(stdout, "kvbridge/NIXL told")[1:] == ["n/a (NIXL (UCX), told, ping-pong: see above)"] * len(
        PEER_SIZES
    )
    for ratio in ("kvbridge/memcpy", "kvbridge/raw gloo"):
        cells = table_cells(stdout, ratio)
        assert len(cells) == 3 and all(re.fullmatch(rf"{NUMBER}x", cell) for cell in cells[1:]), cells
    assert "Every transport's bytes were checked at every size." in stdout


def assert_plot(stdout: str, path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot not written: matplotlib is not installed" in stdout, stdout
        return
    assert f"plot: {path}" in stdout and path.read_bytes().startswith(b"\x89PNG"), stdout


@pytest.mark.timeout(300)
def test_bench_peers_times_every_transport_and_reports_an_absent_peer(tmp_path: Path) -> None:
    result = run_bench_peers(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for name in (*ALWAYS_THERE, "kvbridge (shared memory)"):
        assert_timed(result.stdout, name)
    assert_peers_and_ratios(result.stdout)
    assert (
        "the path the pipe takes by itself here" in result.stdout
        and "kvbridge is kvbridge (shared memory)" in result.stdout
    )
    assert_plot(result.stdout, tmp_path / "peers.png")


@pytest.mark.timeout(300)
def test_bench_peers_across_network_namespaces_takes_the_transport(tmp_path: Path) -> None:
    result = run_bench_peers(tmp_path, "--netns")
    if result.returncode != 0 and "--netns: cannot create a network namespace" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for name in ALWAYS_THERE:
        assert_timed(result.stdout, name)
    assert table_cells(result.stdout, "kvbridge (shared memory)")[1:] == ["n/a (another host)", "-", "-", "-"]
    assert "kvbridge (transport) chose the transport by itself (kv_shared_memory='auto')." in result.stdout
    assert_peers_and_ratios(result.stdout)
    assert_plot(result.stdout, tmp_path / "peers.png")


@pytest.mark.timeout(200)
def test_bench_buffer_compares_drop_select_with_the_raw_pipe_and_fills(tmp_path: Path) -> None:
    [result] = procs.run_commands(
        [([sys.executable, "-m", "benchmarks.bench_buffer", "--max-mib", "1"], {})], tmp_path, timeout=180
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"):
        cells = table_cells(result.stdout, size)
        assert len(cells) == 7 and all(re.fullmatch(NUMBER, cell) for cell in cells[1:]), cells
        # Repetitions, times and the ratio are positive; GB/s at small sizes may round to 0.00.
        assert all(float(cells[index]) > 0 for index in (1, 2, 3, 6)), cells
    for fill in ("10", "1000", "10000"):
        cells = table_cells(result.stdout, fill)
        assert len(cells) == 4 and all(re.fullmatch(NUMBER, cell) for cell in cells[1:]), cells


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("path", "extra"), [("shared-memory", []), ("transport", []), ("shared-memory", ["--stored"])])
def test_bench_connector_compares_a_paged_transfer_with_the_pipe_alone(
    tmp_path: Path, path: str, extra: list[str]
) -> None:
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_connector",
        "--mib",
        "2,4",
        "--repeats",
        "1",
        "--path",
        path,
        *extra,
    ]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    assert ("through shared memory" if path == "shared-memory" else "over the transport") in result.stdout
    assert ("stored before" if extra else "built after") in result.stdout
    for size in ("2 MiB", "4 MiB"):
        cells = table_cells(result.stdout, size)
        assert len(cells) == 9 and all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:]), cells


@pytest.mark.timeout(200)
def test_bench_one_copy_times_every_way_and_checks_the_bytes(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_one_copy", "--mib", "2,4", "--repeats", "1"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("2 MiB", "4 MiB"):
        cells = table_cells(result.stdout, size)
        assert len(cells) == 8 and all(re.fullmatch(NUMBER, cell) for cell in cells[1:4]), cells
        # Cross-memory attach is timed, or says why it was refused (then there is no ratio).
        assert all(re.fullmatch(rf"{NUMBER}|refused: .+", cell) for cell in cells[4:6]), cells
        assert re.fullmatch(rf"{NUMBER}x", cells[6]) and re.fullmatch(rf"{NUMBER}x|-", cells[7]), cells


@pytest.mark.timeout(200)
def test_bench_doorbell_times_every_design_and_checks_the_bytes(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_doorbell", "--sizes", "4K,1M", "--iters", "2", "--rounds", "2"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    for size in ("4 KiB", "1 MiB"):
        cells = table_cells(result.stdout, size)
        assert len(cells) == 7, cells
        assert all(re.fullmatch(rf"{NUMBER} us( \({NUMBER} GB/s\))?", cell) for cell in cells[1:5]), cells
        assert all(re.fullmatch(rf"{NUMBER}x", cell) for cell in cells[5:]), cells


@pytest.mark.timeout(900)
def test_bench_store_measures_every_tier_and_every_answer_matches_recompute(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_store", "--quick", "--documents", "2", "--doc-tokens", "300"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=840)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = (
        "plain (recompute)",
        "plain + prefix cache, later rounds",
        "plain + prefix cache, everything fits, later rounds",
        "memory, cold",
        "memory, warm",
        "disk, cold",
        "disk, warm",
        "disk, new instance",
        "redis, cold",
        "redis, warm",
        "redis, new instance",
    )
    for name in rows:
        cells = table_cells(result.stdout, name)
        assert len(cells) == 11 and all(re.fullmatch(rf"{NUMBER}x?", cell) for cell in cells[1:7]), cells
        assert cells[9] == "0", cells  # every answer equals the plain instance's
    for name in ("memory, warm", "disk, new instance", "redis, new instance"):  # served from the store
        assert table_cells(result.stdout, name)[7] != "0%"


@pytest.mark.timeout(600)
def test_bench_store_serves_multi_turn_chats_from_concurrent_clients_and_every_answer_matches(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_store", "--quick", "--workload", "chat"]
    command += ["--clients", "2", "--tiers", "disk"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=540)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "3 chats of 2 turns over one 128-token system prompt" in result.stdout
    assert "2 clients:" in result.stdout
    rows = (
        "plain (recompute)",
        "plain + prefix cache, later rounds",
        "plain + prefix cache, everything fits, later rounds",
        "disk, first turns",
        "disk, later turns",
    )
    for name in rows:
        cells = table_cells(result.stdout, name)
        assert len(cells) == 11 and cells[9] == "0" and cells[10] == "-", cells  # no targets for chats
    assert table_cells(result.stdout, "disk, later turns")[7] != "0%"  # the earlier turns, from the store
