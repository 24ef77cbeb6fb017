"""A vLLM-shaped transfer end to end against the pipe alone, measured in the same run.

Two spawned processes, a producer (rank 0) and a consumer (rank 1), each with paged KV caches in
vLLM's CPU layout (``[num_blocks, kv_heads, block_size, 2 * head_size]`` per layer) and two pipes:

* **pipe alone**: the consumer asks with a one-element tensor; the producer sends a tensor of the
  transfer's size that it gathered once beforehand; the consumer has it as soon as it arrives.
* **connector**: the consumer asks the same way; the producer gathers the request's blocks out of
  its caches and inserts them into a lookup buffer (``send_kv_caches_and_hidden_states``); the
  consumer selects them and scatters them into other blocks of its own caches
  (``recv_kv_caches_and_hidden_states``).
* **connector, lent**: the same with ``lend=True`` and the producer's caches exported: it inserts
  where the blocks lie instead of a copy, and the consumer copies them straight into its own blocks
  and releases them (the only copy). Over the transport the producer copies them when they are
  selected instead, so there the two connector columns do the same work.

All are timed on the consumer, from the ask to the data being usable (received, or written into
its caches), alternating request by request. By default the producer builds its entry after the
ask, so a connector's whole work is timed, its gather included. With ``--stored`` it stores the
entry before the consumer asks, as a vLLM prefill step does before the decode instance asks: what
is timed is then what the decode side waits for. and both pipes use the same payload path (shared
memory, or the transport with ``--path transport``). The consumer checks its caches bit for bit
after the first transfer of each size of each connector. The last columns are the connectors'
rates as fractions of the pipe's.

The lookup buffer is a :class:`~lookup_buffer.SimpleBuffer` on one pipe, or with ``--buffer
listener`` what the vLLM connector runs: a :class:`~lookup_buffer.BufferListener` on the producer
that the consumer dials (:func:`~lookup_buffer.dial`).

    python -m benchmarks.bench_connector [--mib 16,64] [--repeats 7] [--path shared-memory|transport]
        [--buffer simple|listener] [--stored]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.measure import run_two_ranks
from connector import (
    VLLM_CPU_LAYOUT,
    KVRequest,
    PagedKV,
    PagedKVCaches,
    gather_blocks,
    recv_kv_caches_and_hidden_states,
    send_kv_caches_and_hidden_states,
)
from harness.procs import free_port
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.exported_memory import page_aligned_empty
from lookup_buffer import BufferListener, SimpleBuffer, dial

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_SIZE = 8, 8, 32, 128
BLOCK_BYTES = KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4  # fp32: 256 KiB per block and layer
PATHS = {"shared-memory": "on", "transport": "off"}


def page_aligned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` whose blocks can all be exported (vLLM's caches start and end mid-page,
    and requests whose blocks touch those partial pages are then copied, not lent)."""
    aligned = page_aligned_empty(tensor.shape, tensor.dtype)
    aligned.copy_(tensor)
    return aligned


def caches(num_blocks: int, seed: int) -> PagedKVCaches:
    generator = torch.Generator().manual_seed(seed)
    layers = [torch.randn(num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=generator) for _ in range(LAYERS)]
    return PagedKVCaches(layers, VLLM_CPU_LAYOUT)


def request_blocks(nbytes: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Distinct, shuffled block ids of a request of ``nbytes`` (over all layers)."""
    count = nbytes // (BLOCK_BYTES * LAYERS)
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:count]


def open_buffer(kind: str, config: KVTransferConfig, raw: TorchDistributedPipe):
    """The lookup buffer of this rank; for a listener, once the consumer's connection is up."""
    if kind == "simple":
        return SimpleBuffer(TorchDistributedPipe(config), config)
    if config.kv_rank == 1:
        assert raw.recv_tensor(timeout=60) is None  # the producer listens
        return dial(config, config.kv_ip, config.kv_port)
    listener = BufferListener(config)
    raw.send_tensor(None)
    deadline = time.monotonic() + 60
    while listener.connections == 0:  # the connection is set up in the listener's own thread
        if time.monotonic() > deadline:
            raise SystemExit("the consumer did not connect to the listener within 60 s")
        time.sleep(0.01)
    return listener


def worker(
    rank: int, port: int, mib: list[int], repeats: int, path: str, buffer_kind: str, stored: bool, results
) -> None:
    torch.set_num_threads(1)
    largest = max(mib) << 20
    config = KVTransferConfig(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_buffer_size=2 * largest + (64 << 20),
        kv_timeout=60.0,
        kv_connect_timeout=60.0,
        kv_shared_memory=PATHS[path],
    )
    raw = TorchDistributedPipe(config, port_offset=2)
    buffer = open_buffer(buffer_kind, config, raw)
    num_blocks = 2 * largest // (BLOCK_BYTES * LAYERS)
    paged = caches(num_blocks, seed=rank)
    if rank == 0:
        paged = PagedKVCaches([page_aligned(layer) for layer in paged.caches], VLLM_CPU_LAYOUT)
        paged.export()
    rows = []
    try:
        from tqdm import tqdm

        for size in tqdm(mib, desc="sizes", file=sys.stderr, disable=rank != 1):
            nbytes = size << 20
            producer_ids = request_blocks(nbytes, num_blocks, seed=size)
            consumer_ids = request_blocks(nbytes, num_blocks, seed=size + 1)
            tokens = torch.arange(len(producer_ids) * BLOCK_SIZE, dtype=torch.int64) + size
            gathered = gather_blocks(paged.caches, VLLM_CPU_LAYOUT, producer_ids)
            alone, copied, lent = [], [], []
            for index in range(repeats + 1):  # the first of each is a warm-up
                if rank == 0:
                    raw.recv_tensor(timeout=120)
                    raw.send_tensor(gathered)
                    for lend in (False, True):
                        if not stored:
                            raw.recv_tensor(timeout=120)  # the ask
                        request = KVRequest(tokens, PagedKV(paged, producer_ids))
                        [sent] = send_kv_caches_and_hidden_states(buffer, [request], timeout=120, lend=lend)
                        if stored:
                            raw.send_tensor(None)  # stored: the consumer may ask
                        if lend:  # the blocks are the producer's again once the consumer has copied them
                            outcome = sent.loan.wait(120)
                            assert outcome == ("returned" if raw.uses_shared_memory else "sent"), outcome
                    continue
                start = time.perf_counter()
                raw.send_tensor(torch.ones(1))
                received = raw.recv_tensor(timeout=120)
                alone.append(time.perf_counter() - start)
                del received  # gives its shared-memory region back
                for times in (copied, lent):
                    for layer in paged.caches:
                        layer.zero_()  # each connector must write every byte it claims
                    if stored:
                        assert raw.recv_tensor(timeout=120) is None
                    start = time.perf_counter()
                    if not stored:
                        raw.send_tensor(torch.ones(1))
                    [result] = recv_kv_caches_and_hidden_states(
                        buffer, [KVRequest(tokens, PagedKV(paged, consumer_ids))], timeout=120
                    )
                    times.append(time.perf_counter() - start)
                    assert result.hit, result.reason
                    if index == 0:  # the producer's caches were seeded with rank 0: rebuild its blocks here
                        expected = gather_blocks(caches(num_blocks, seed=0).caches, VLLM_CPU_LAYOUT, producer_ids)
                        assert torch.equal(gather_blocks(paged.caches, VLLM_CPU_LAYOUT, consumer_ids), expected)
            if rank == 1:
                rows.append((nbytes, *(statistics.median(times[1:]) for times in (alone, copied, lent))))
        if rank == 1:
            results.put((raw.uses_shared_memory, rows))
            raw.send_tensor(None)  # done: the producer closes only after the last select
        else:
            assert raw.recv_tensor(timeout=120) is None
    finally:
        buffer.close()
        raw.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="16,64", help="transfer sizes in MiB (multiples of 2)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--path", choices=sorted(PATHS), default="shared-memory")
    parser.add_argument(
        "--buffer",
        choices=["simple", "listener"],
        default="simple",
        help="a SimpleBuffer, or a BufferListener the consumer dials (the vLLM connector's)",
    )
    parser.add_argument(
        "--stored", action="store_true", help="the producer stores each entry before the consumer asks (as in vLLM)"
    )
    args = parser.parse_args()
    mib = [int(size) for size in args.mib.split(",")]
    shared, rows = run_two_ranks(worker, (free_port(span=4), mib, args.repeats, args.path, args.buffer, args.stored))
    print(
        f"torch {torch.__version__}; {LAYERS} layers of fp32 blocks of {BLOCK_BYTES >> 10} KiB in vLLM's CPU "
        f"layout; payloads {'through shared memory' if shared else 'over the transport'}; lookup buffer: "
        f"{args.buffer}; entries {'stored before' if args.stored else 'built after'} the ask; medians of "
        f"{args.repeats}, one way, timed by the consumer"
    )
    print(
        f"{'size':>8} | {'pipe alone ms':>13} | {'connector ms':>12} | {'lent ms':>7} | {'pipe GB/s':>9} | "
        f"{'connector GB/s':>14} | {'lent GB/s':>9} | {'connector/pipe':>14} | {'lent/pipe':>9}"
    )
    print("-" * 124)
    for nbytes, alone, copied, lent in rows:
        print(
            f"{nbytes >> 20:>4} MiB | {alone * 1e3:13.2f} | {copied * 1e3:12.2f} | {lent * 1e3:7.2f} | "
            f"{nbytes / alone / 1e9:9.2f} | {nbytes / copied / 1e9:14.2f} | {nbytes / lent / 1e9:9.2f} | "
            f"{alone / copied:13.2f}x | {alone / lent:8.2f}x"
        )


if __name__ == "__main__":
    main()
