"""The GPU path on a real GPU (``pytest -m cuda``; skipped without CUDA). The checks themselves live
in :mod:`harness.cuda_checks`, so that ``scripts/gpu-check.sh`` can run them on a machine without pytest."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(check) -> None:
    from harness import cuda_checks

    try:
        check(cuda_checks)()
    except cuda_checks.Skip as skip:
        pytest.skip(str(skip))


@pytest.mark.timeout(300)
def test_pipe_carries_cuda_tensors_host_staged_bit_exact() -> None:
    _run(lambda checks: checks.check_pipe_host_staged)


@pytest.mark.timeout(300)
def test_paged_gather_and_scatter_on_gpu_layouts_match_the_cpu() -> None:
    _run(lambda checks: checks.check_paged_layouts)


@pytest.mark.timeout(300)
def test_connector_moves_a_batch_between_two_processes_on_one_gpu() -> None:
    _run(lambda checks: checks.check_connector_one_gpu)


@pytest.mark.timeout(120)
def test_nccl_pipe_ends_on_one_gpu_are_refused_naming_the_host_staged_mode() -> None:
    _run(lambda checks: checks.check_same_gpu_refused)


@pytest.mark.timeout(300)
def test_nccl_pipe_between_two_gpus() -> None:
    _run(lambda checks: checks.check_nccl_two_gpus)


@pytest.mark.timeout(300)
def test_nccl_peer_killed_gives_peer_lost_and_the_survivor_lives() -> None:
    _run(lambda checks: checks.check_nccl_killed_peer)


@pytest.mark.timeout(300)
def test_engine_synchronize_returns_at_once_while_an_nccl_pipe_is_idle() -> None:
    _run(lambda checks: checks.check_nccl_idle_synchronize)


def test_pair_with_the_model_on_the_gpu() -> None:
    _run(lambda checks: checks.check_pair_on_gpu)
