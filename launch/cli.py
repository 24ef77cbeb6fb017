"""The ``kvbridge`` command. ``kvbridge pair`` is ``torchrun --nproc-per-node=2 -m launch.pair``;
``kvbridge serve ...`` is ``python -m launch.serve ...`` (prefill + decode vLLM servers and the proxy);
``kvbridge --version`` prints the version. A missing optional dependency is reported with the extra
that provides it (``pip install 'kvbridge[pair]'``, ``[serve]``, ``[vllm]``).

Workload options set the matching ``KVBRIDGE_*`` variables (see :mod:`launch.pair`); every other
option goes to torchrun unchanged, e.g. ``kvbridge pair --nnodes=2 --node-rank=0 --master-addr=HOST
--master-port=PORT`` on each of two hosts (one process per host then).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import launch
from launch.extras import MissingExtraError, require

#: Option name -> environment variable read by launch.pair.
_PAIR_OPTIONS = {
    "num_prompts": ("KVBRIDGE_NUM_PROMPTS", int, "number of prompts (default 16)"),
    "max_new_tokens": ("KVBRIDGE_MAX_NEW_TOKENS", int, "tokens generated per prompt (default 16)"),
    "model": ("KVBRIDGE_MODEL", str, "local directory of a Hugging Face causal LM (default: built-in Llama)"),
    "seed": ("KVBRIDGE_SEED", int, "seed of weights, prompts and order (default 0)"),
    "store": (
        "KVBRIDGE_KV_STORE",
        str,
        "move the KV through a store both ranks reach, not a pipe: disk:PATH or redis://HOST:PORT (default: a pipe)",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description="Move LLM KV caches from prefill to decode.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    pair = commands.add_parser(
        "pair",
        allow_abbrev=False,
        help="run a prefill and a decode instance that exchange KV caches, and check their tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, (_, kind, text) in _PAIR_OPTIONS.items():
        pair.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    commands.add_parser(
        "serve",
        add_help=False,
        help="serve a model disaggregated: prefill + decode vLLM servers and an OpenAI-compatible proxy "
        "(kvbridge serve --help)",
    )
    return parser


def version() -> str:
    """The installed distribution's version; the source tree's when kvbridge is not installed."""
    try:
        return importlib.metadata.version("kvbridge")
    except importlib.metadata.PackageNotFoundError:
        return launch.__version__


def torchrun_args(forwarded: Sequence[str]) -> list[str]:
    """torchrun's command line for the pair: 2 processes on one node, 1 per node on several."""
    if any(arg.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for arg in forwarded):
        return [*forwarded, "-m", "launch.pair"]
    nodes = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    nodes.add_argument("--nnodes", default="1")
    single_node = nodes.parse_known_args(forwarded)[0].nnodes == "1"
    return [f"--nproc-per-node={2 if single_node else 1}", *forwarded, "-m", "launch.pair"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except MissingExtraError as error:
        print(f"kvbridge {argv[0]}: {error}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        require("serve")
        require("vllm")
        from launch import serve  # its options are its own

        return serve.main(argv[1:])
    args, forwarded = _parser().parse_known_args(argv)
    require("pair")  # checked here: torchrun's workers would each fail with a traceback
    for name, (variable, _, _) in _PAIR_OPTIONS.items():
        if getattr(args, name) is not None:
            os.environ[variable] = str(getattr(args, name))
    try:
        torchrun.main(torchrun_args(forwarded))
    except ChildFailedError as error:
        failure = error.get_first_failure()[1]
        print(f"kvbridge pair: rank {failure.global_rank} exited with status {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
