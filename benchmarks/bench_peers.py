"""kvbridge beside its peers: memcpy, raw gloo, the kvbridge pipe on both payload paths, Mooncake's
transfer engine and NIXL (as one-sided writes, and as messages its target is told of), timed in one run.

Two processes (benchmarks/peer_transports.py says what each transport does) time every transport
in alternating rounds, so that a noisy neighbour slows all alike; a table gives the median one-way
time per message and GB/s (1e9 bytes / one-way time) per size, and the ratios of kvbridge to both
NIXL rows, memcpy and raw gloo, where "kvbridge" is the path the pipe takes by itself: shared memory on one
host, the transport between two. A bar chart of the same goes to ``--plot``.

``--netns`` puts the two processes on two "hosts": network namespaces joined by a veth pair (needs
root), with NIXL's UCX on TCP. There the pipe must choose the transport, and the shared-memory path
is reported as not applicable.

A peer that is not installed is reported in the table: ``pip install 'kvbridge[peers]'`` brings
NIXL, Mooncake (which needs Debian's ``libibverbs1``), matplotlib and tqdm.

    python -m benchmarks.bench_peers [--sizes 4K,1M,16M,128M] [--rounds 3] [--iters 7] [--netns]
                                     [--plot /tmp/kvbridge-peers.png]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.measure import label, parse_sizes
from benchmarks.peer_transports import ANOTHER_HOST
from harness import netns
from harness.procs import OWN_PROCESS_GROUP, REPO, free_port

NIXL, NIXL_TOLD = "NIXL (UCX)", "NIXL (UCX), told, ping-pong"
MEMCPY, RAW = "memcpy (torch, 1 thread)", "raw gloo"
KVBRIDGE = {False: "kvbridge (shared memory)", True: "kvbridge (transport)"}  # by across_hosts
DEFAULT_PLOT = Path(tempfile.gettempdir()) / "kvbridge-peers.png"


def start_workers(log_dir: Path, args: argparse.Namespace, hosts: netns.TwoHosts | None) -> list[netns.Child]:
    """The two worker processes, each in its own process group (in its namespace with ``hosts``)."""
    port = free_port(span=6)
    ip = hosts.addresses[0] if hosts else "127.0.0.1"
    # The caller's PYTHONPATH stays (after the repository): it may decide which peers can be imported.
    # UCX (NIXL) would otherwise also use the host's other interfaces: only loopback on one host, and
    # TCP between the namespaces (which have nothing but their veth and loopback).
    env = netns.child_env(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **({"UCX_TLS": "tcp"} if hosts else {"UCX_NET_DEVICES": "lo"}),
        }
    )
    children = []
    for rank in (0, 1):
        tag = f"rank{rank}"
        result_file = log_dir / f"{tag}.json"
        work = {
            "rank": rank,
            "ip": ip,
            "own_ip": hosts.addresses[rank] if hosts else ip,
            "port": port,
            "sizes": args.sizes,
            "rounds": args.rounds,
            "iters": args.iters,
            "across_hosts": hosts is not None,
        }
        argv = [sys.executable, "-m", "benchmarks.peer_transports", str(result_file), json.dumps(work)]
        if hosts:
            process = hosts.popen(rank, argv, env, log_dir, tag)
        else:
            with open(log_dir / f"{tag}.out", "w") as out, open(log_dir / f"{tag}.err", "w") as err:
                process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=err, **OWN_PROCESS_GROUP)
        children.append(netns.Child(tag, process, log_dir / f"{tag}.out", log_dir / f"{tag}.err", result_file))
    return children


def rounds_done(child: netns.Child) -> int:
    return sum(line.startswith("step ") for line in child.stdout.read_text().splitlines())


def collect(children: list[netns.Child], total: int, timeout: float) -> dict:
    """Rank 0's result; every worker is killed and reaped in the end. SystemExit with the failed
    worker's traceback (or the logs, on timeout) if the run did not succeed."""
    from tqdm import tqdm

    deadline = time.monotonic() + timeout
    try:
        with tqdm(total=total, desc="size x round", file=sys.stderr) as bar:
            while True:
                if (done := rounds_done(children[0])) > bar.n:
                    bar.update(done - bar.n)
                codes = [child.process.poll() for child in children]
                if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
                    break  # finished, or one failed: the other would only wait for it until its own timeout
                if time.monotonic() > deadline:
                    logs = "\n".join(child.logs() for child in children)
                    raise SystemExit(f"the benchmark did not finish within {timeout:g} s\n{logs}")
                time.sleep(0.2)
        failed_first = sorted(children, key=lambda child: child.process.poll() in (None, 0))
        try:
            results = {child.tag: child.result(timeout=10) for child in failed_first}
        except AssertionError as exc:
            raise SystemExit(f"a benchmark process failed:\n{exc}") from None
        return results["rank0"]
    finally:
        for child in children:
            child.kill()


def cell(result: dict, name: str, nbytes: int) -> tuple[str, str]:
    seconds = result["seconds"][name][str(nbytes)]
    micros = seconds * 1e6
    return f"{nbytes / seconds / 1e9:.2f}", f"{micros:.1f}" if micros >= 10 else f"{micros:.2f}"


def ratio(result: dict, numerator: str, denominator: str, nbytes: int) -> str:
    """How many times ``numerator``'s GB/s is ``denominator``'s."""
    missing = [name for name in (numerator, denominator) if result["unavailable"][name]]
    if missing:
        return f"n/a ({missing[0]}: see above)"
    seconds = result["seconds"]
    return f"{seconds[denominator][str(nbytes)] / seconds[numerator][str(nbytes)]:.2f}x"


def table(result: dict, sizes: list[int], across_hosts: bool) -> list[str]:
    header = ["transport", *(f"{label(nbytes)} {unit}" for nbytes in sizes for unit in ("GB/s", "us"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in result["order"]:
        reason = result["unavailable"][name]
        if reason:
            cells = [reason, *["-"] * (2 * len(sizes) - 1)]
        else:
            cells = [value for nbytes in sizes for value in cell(result, name, nbytes)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    kvbridge = KVBRIDGE[across_hosts]
    lines += [
        "",
        f"Ratios of GB/s; kvbridge is {kvbridge}, the path the pipe takes by itself here.",
        "| ratio | " + " | ".join(label(nbytes) for nbytes in sizes) + " |",
        "|" + "---|" * (len(sizes) + 1),
    ]
    for other, short in ((NIXL, "NIXL"), (NIXL_TOLD, "NIXL told"), (MEMCPY, "memcpy"), (RAW, "raw gloo")):
        lines.append(f"| kvbridge/{short} | " + " | ".join(ratio(result, kvbridge, other, n) for n in sizes) + " |")
    return lines


def plot(result: dict, sizes: list[int], title: str, path: Path) -> str:
    """Save a bar chart of GB/s per size and transport; what happened, for the output."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
        from matplotlib.patches import Patch
    except ImportError:
        return "plot not written: matplotlib is not installed (pip install 'kvbridge[peers]')"
    names = result["order"]
    figure, axes = pyplot.subplots(figsize=(12, 5.5))
    width = 0.8 / len(names)
    legend = []
    for index, name in enumerate(names):
        reason = result["unavailable"][name]
        if reason:  # no bars, but named in the legend with the reason
            legend.append(Patch(facecolor="none", edgecolor="grey", hatch="//", label=f"{name}: {reason}"))
            continue
        positions = [size_index + (index - (len(names) - 1) / 2) * width for size_index in range(len(sizes))]
        bars = axes.bar(
            positions, [float(cell(result, name, nbytes)[0]) for nbytes in sizes], width, color=f"C{index}", label=name
        )
        axes.bar_label(bars, fmt="%.2f", fontsize=6)
        legend.append(bars)
    axes.set_xticks(range(len(sizes)), [label(nbytes) for nbytes in sizes])
    axes.set_yscale("log")
    axes.set_ylabel("GB/s (1e9 bytes / one-way time, median)")
    axes.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    axes.legend(handles=legend, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return f"plot: {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,1M,16M,128M", type=parse_sizes, help="comma-separated, e.g. 4K,1M")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is over all of them")
    parser.add_argument(
        "--iters", type=int, default=7, help="timed messages per round, at least (small sizes get more, up to 1,000)"
    )
    parser.add_argument("--netns", action="store_true", help="two network namespaces joined by a veth pair")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="where the bar chart (PNG) goes")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the whole run may take")
    args = parser.parse_args()
    # A plain SIGTERM would end this process without its clean-up: the workers and namespaces would stay.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-peers-") as logs:
        total = len(args.sizes) * args.rounds
        if args.netns:
            try:
                with netns.two_hosts() as hosts:
                    result = collect(start_workers(Path(logs), args, hosts), total, args.timeout)
            except netns.NamespacesUnavailable as exc:
                raise SystemExit(f"--netns: {exc}") from None
        else:
            result = collect(start_workers(Path(logs), args, None), total, args.timeout)
    where = (
        "two network namespaces joined by a veth pair (NIXL: UCX_TLS=tcp)"
        if args.netns
        else "two processes on one host"
    )
    title = (
        f"kvbridge and its peers, {where}; one-way time per message, median of {args.rounds} alternating "
        f"rounds; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(title)
    counts = ", ".join(f"{label(n)} {result['messages'][str(n)]}" for n in args.sizes)
    print(
        "memcpy: one copy_ in one process; raw gloo, kvbridge, NIXL told: ping-pong / 2; Mooncake, NIXL: one "
        f"completed write (its target not told). Messages per round: {counts}. Every transport's bytes were "
        "checked at every size."
    )
    for line in table(result, args.sizes, args.netns):
        print(line)
    if result["unavailable"][KVBRIDGE[False]] == ANOTHER_HOST:
        print(f"{KVBRIDGE[True]} chose the transport by itself (kv_shared_memory='auto').")
    print(plot(result, args.sizes, title, args.plot))


if __name__ == "__main__":
    main()
