"""Content keys of stored chunks: the same in every process, one per chunk, chained over the prefix,
and different for every incompatible identity."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kv_store import ChunkKey, KVStoreConfigError, chunk_keys, namespace

pytestmark = pytest.mark.timeout(120)

IDENTITY = {
    "model": "meta-llama/Llama-3.2-1B",
    "kv_dtype": "bfloat16",
    "layout": "NHD",
    "layers": 16,
    "kv_heads": 8,
    "head_size": 64,
    "format_version": 1,
    "tp_part": "0/1",
}
TOKENS = [int(t) for t in range(1000, 1000 + 2 * 97 + 13)]
_PRINT_KEYS = (
    "from kv_store import chunk_keys, namespace; import json, sys; "
    "identity, tokens = json.loads(sys.argv[1]); "
    "print(' '.join(k.key.hex() for k in chunk_keys(namespace(identity), tokens, 97)))"
)


def test_keys_are_the_same_in_processes_with_different_hash_seeds():
    argument = json.dumps([IDENTITY, TOKENS])
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _PRINT_KEYS, argument],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs.add(done.stdout.strip())
    mine = " ".join(key.key.hex() for key in chunk_keys(namespace(IDENTITY), TOKENS, 97))
    assert outputs == {mine}


def test_one_key_per_chunk_and_one_for_the_partial_tail():
    keys = chunk_keys(namespace(IDENTITY), TOKENS, 97)
    assert [(k.start, k.stop) for k in keys] == [(0, 97), (97, 194), (194, 207)]
    assert len({k.key for k in keys}) == 3 and all(len(k.key) == 32 for k in keys)
    assert chunk_keys(namespace(IDENTITY), TOKENS[:194], 97) == keys[:2]
    assert chunk_keys(namespace(IDENTITY), [], 97) == []


def test_each_key_chains_the_previous_one():
    ns = namespace(IDENTITY)
    keys = chunk_keys(ns, TOKENS, 97)
    parent = bytes(32)
    for chunk in keys:
        tokens = b"".join(t.to_bytes(8, "little", signed=True) for t in TOKENS[chunk.start : chunk.stop])
        parent = hashlib.sha256(ns + parent + tokens).digest()
        assert chunk.key == parent
    # A change in the first chunk changes every later key; one in the last changes only the last.
    early = chunk_keys(ns, [TOKENS[0] + 1, *TOKENS[1:]], 97)
    late = chunk_keys(ns, [*TOKENS[:-1], TOKENS[-1] + 1], 97)
    assert all(a.key != b.key for a, b in zip(early, keys, strict=True))
    assert [a.key == b.key for a, b in zip(late, keys, strict=True)] == [True, True, False]


def test_a_partial_chunk_is_not_the_full_chunk():
    ns = namespace(IDENTITY)
    assert chunk_keys(ns, TOKENS[:50], 97)[0] != chunk_keys(ns, TOKENS[:97], 97)[0]


@pytest.mark.parametrize("field", sorted(IDENTITY))
def test_every_identity_field_changes_the_namespace(field):
    changed = dict(IDENTITY)
    changed[field] = changed[field] + 1 if isinstance(changed[field], int) else changed[field] + "x"
    assert namespace(changed) != namespace(IDENTITY)
    assert chunk_keys(namespace(changed), TOKENS, 97)[0] != chunk_keys(namespace(IDENTITY), TOKENS, 97)[0]


def test_namespace_ignores_order_and_tells_types_apart():
    assert namespace(dict(reversed(list(IDENTITY.items())))) == namespace(IDENTITY)
    assert namespace({**IDENTITY, "layers": "16"}) != namespace(IDENTITY)
    assert namespace({"ab": "c"}) != namespace({"a": "bc"})


def test_bad_arguments_are_config_errors():
    with pytest.raises(KVStoreConfigError, match="chunk_size"):
        chunk_keys(namespace(IDENTITY), TOKENS, 0)
    with pytest.raises(KVStoreConfigError, match="namespace"):
        chunk_keys(b"short", TOKENS, 16)
    with pytest.raises(KVStoreConfigError, match="int64"):
        chunk_keys(namespace(IDENTITY), [2**63], 16)
    with pytest.raises(KVStoreConfigError, match="layers"):
        namespace({"layers": 1.5})
    with pytest.raises(KVStoreConfigError, match="layers"):
        namespace({"layers": True})


NOT_INT64 = {
    "bool": [5, True, 7],
    "numpy bool": [np.True_],
    "float": [1.0, 2.0],
    "int64 overflow": [2**63],
    "too big": [2**64],
    "uint64 overflow": np.array([2**63], dtype=np.uint64),
    "str": ["5"],
}


@pytest.mark.parametrize("tokens", NOT_INT64.values(), ids=NOT_INT64.keys())
def test_tokens_that_are_not_int64_integers_are_refused_not_converted(tokens):
    with pytest.raises(KVStoreConfigError, match="token ids"):
        chunk_keys(namespace(IDENTITY), tokens, 16)


def test_a_bool_chunk_size_is_refused_and_unsigned_tokens_key_as_their_values():
    with pytest.raises(KVStoreConfigError, match="chunk_size"):
        chunk_keys(namespace(IDENTITY), TOKENS, True)
    unsigned = chunk_keys(namespace(IDENTITY), np.array(TOKENS, dtype=np.uint32), 16)
    assert unsigned == chunk_keys(namespace(IDENTITY), TOKENS, 16)
    assert isinstance(chunk_keys(namespace(IDENTITY), [1], 1)[0], ChunkKey)
