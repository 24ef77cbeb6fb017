"""Shared-secret authentication (HMAC-SHA256). It authenticates, it does not encrypt.

Both layers use it: the pipe proves knowledge of ``kv_secret`` in a challenge-response during its
rendezvous, and the lookup buffer signs every control message with a key derived from it. Keys are
derived per purpose so a signature made for one channel is worthless on the other.
"""

from __future__ import annotations

import hashlib
import hmac
import os

TAG_BYTES = 32
NONCE_BYTES = 32


def derive_key(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), b"kvbridge/" + purpose.encode(), hashlib.sha256).digest()


def sign(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        # Length-prefix each part so that ("ab", "c") and ("a", "bc") sign differently.
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(sign(key, *parts), tag)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
