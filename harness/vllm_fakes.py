"""vLLM's scheduler objects built by hand, and fakes of the connector worker's surroundings, for the
connector's tests without an engine: requests and scheduler outputs, token runs, random KV blocks, a
buffer whose inserts fail on cue, a connector over a worker, and polling a worker as vLLM does each step."""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from connector.vllm_v1 import KVBridgeConnector
from harness import vllm_procs as vp
from lookup_buffer.loans import Loan

B = vp.BLOCK_SIZE


def make_request(req_id: str, tokens: list[int], params: dict | None = None) -> Request:
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(req_id, tokens, sampling, None)


def new_req_data(request: Request, block_ids: list[int], num_computed: int) -> NewRequestData:
    request.num_computed_tokens = num_computed
    return NewRequestData.from_request(request, (block_ids,))


def scheduler_output(
    new: list[NewRequestData], scheduled: dict[str, int], cached: CachedRequestData | None = None
) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = new
    output.num_scheduled_tokens = scheduled
    output.total_num_scheduled_tokens = sum(scheduled.values())
    if cached is not None:
        output.scheduled_cached_reqs = cached
    return output


def cached_data(req_ids: list[str], num_computed: list[int]) -> CachedRequestData:
    data = CachedRequestData.make_empty()
    data.req_ids = req_ids
    data.num_computed_tokens = num_computed
    data.new_block_ids = [None] * len(req_ids)
    data.num_output_tokens = [0] * len(req_ids)
    return data


def bare_connector(worker: Any) -> KVBridgeConnector:
    """A worker-side KVBridgeConnector over ``worker``, without a vLLM config: its hooks, called as
    vLLM's model runner calls them, reach the worker."""
    connector = object.__new__(KVBridgeConnector)
    connector._worker, connector._scheduler, connector._connector_metadata = worker, None, None
    return connector


FAKE_TOKENS = {
    name: list(range(start, start + n))
    for name, start, n in (("a", 10, 8), ("b", 30, 12), ("c", 50, 4), ("d", 60, 4), ("x", 90, 4))
}


class FailingInserts:
    """A producer's lookup buffer whose inserts raise ``failures[first token]``, others are kept."""

    def __init__(self, failures: dict[int, Exception]) -> None:
        self.failures = failures
        self.inserted: list[list[int]] = []

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        hidden: torch.Tensor | None,
        timeout: float | None = None,
    ) -> None:
        failure = self.failures.get(int(input_tokens[0]))
        if failure is not None:
            raise failure
        self.inserted.append(input_tokens.tolist())

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def close(self) -> None:
        self.inserted.clear()


class LendingInserts(FailingInserts):
    """A producer's lookup buffer that lends what it is given: each insert returns the entry's loan."""

    def __init__(self) -> None:
        super().__init__({})
        self.loans: list[Loan] = []

    def insert(self, *args: Any, **kwargs: Any) -> Loan:
        super().insert(*args, **kwargs)
        self.loans.append(Loan())
        return self.loans[-1]


def random_blocks(seed: int, count: int) -> torch.Tensor:
    """Random KV blocks for ``count`` blocks of :func:`harness.vllm_procs.fake_caches`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (vp.FAKE_LAYERS, count, vp.FAKE_HEADS, vp.FAKE_BLOCK_SIZE, 2 * vp.FAKE_HEAD_SIZE)
    return torch.randn(shape, generator=generator)


def poll_until_reported(
    worker: Any, until: set[str], finished_req_ids: set[str] | None = None
) -> list[tuple[set[str], set[int]]]:
    """Poll as vLLM does each step (finished loads, then failed blocks) until ``until`` were all
    reported; return each poll's reports (a hang guard only: no timing is asserted)."""
    polls: list[tuple[set[str], set[int]]] = []
    deadline = time.monotonic() + 60
    while not until <= set().union(*(f for f, _ in polls)):
        assert time.monotonic() < deadline, f"{until} not reported; got {polls}"
        polls.append((worker.take_finished_loads(finished_req_ids or set()), worker.take_failed_blocks()))
        time.sleep(0.005)
    return polls
