"""Sealed store blobs: authenticated (a keyed MAC) and, optionally, encrypted at rest.

A page's device digests catch bit rot, torn writes, misfiled and stale pages, but
they are not a MAC: anyone who can write the store can change a page and recompute
its digests with the public ``integrity.digest_np``. A ``Sealer`` closes that gap
for stores shared beyond one trust domain. Every blob written carries, over the
whole blob and the store key it is written under (so a sealed blob moved to another
key fails too):

* ``auth``: an HMAC-SHA-256 tag; the page bytes stay readable;
* ``encrypt``: AES-256-GCM (``pip install 'kvxfer[crypto]'``), which authenticates
  and hides the page bytes (stores shared across tenants).

Frame: ``b"KVXSEAL1" | mode u8 | nonce (12 bytes, encrypt only) | body``, where the
body is ``tag (32 bytes) | blob`` or the GCM ciphertext (blob and 16-byte tag). The
two keys (MAC, cipher) are derived from the caller's key material with keyed
BLAKE2b, each under its own personalisation.

Example:
    >>> sealer = Sealer(b"sixteen byte key!")
    >>> sealed = sealer.seal("page-1", b"blob")
    >>> sealer.open("page-1", sealed)
    b'blob'
    >>> sealer.open("page-2", sealed)
    Traceback (most recent call last):
    ...
    kvxfer.store._seal.SealError: blob under 'page-2' fails its MAC (changed, moved from another key, or sealed with another key)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

__all__ = ["Sealer", "SealError", "MIN_KEY_BYTES"]

_MAGIC = b"KVXSEAL1"
_HEAD = struct.Struct("<8sB")
_AUTH, _ENCRYPT = 1, 2
_TAG = 32
_NONCE = 12
MIN_KEY_BYTES = 16
CRYPTO_HINT = "pip install 'kvxfer[crypto]' (the cryptography package)"


class SealError(ValueError):
    """A sealed blob that does not open: not sealed, changed, or sealed otherwise."""


def _derive(key: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(b"kvxfer-store-seal", key=key[:64] if len(key) > 64 else key,
                           digest_size=32, person=person).digest()


class Sealer:
    """Seals blobs before they reach a store and opens them after.

    Args:
      key: secret key material, bytes of at least 16 bytes (32 random bytes is
        right); every process that shares the store's pages needs the same key.
      encrypt: also encrypt the page bytes (AES-256-GCM; needs ``cryptography``).

    Raises:
      TypeError, ValueError: ``key`` is not bytes or too short.
      ImportError: ``encrypt=True`` without the ``cryptography`` package.
    """

    def __init__(self, key: bytes, *, encrypt: bool = False):
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"the store key must be bytes (32 random bytes, say). Got "
                            f"{type(key).__name__}")
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the store key has {len(key)} bytes; use at least "
                             f"{MIN_KEY_BYTES} (32 random bytes: os.urandom(32))")
        key = bytes(key)
        self.encrypt = bool(encrypt)
        self._mac_key = _derive(key, b"kvxfer-mac")
        self._cipher = None
        if self.encrypt:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError as e:
                raise ImportError(f"encrypt=True needs AES-GCM: {CRYPTO_HINT}") from e
            self._cipher = AESGCM(_derive(key, b"kvxfer-aes"))

    @property
    def mode(self) -> str:
        """``"auth"`` or ``"encrypt"`` (part of the store keys of sealed pages)."""
        return "encrypt" if self.encrypt else "auth"

    def seal(self, store_key: str, blob: bytes) -> bytes:
        """``blob`` sealed for ``store_key``."""
        if self._cipher is not None:
            head = _HEAD.pack(_MAGIC, _ENCRYPT)
            nonce = os.urandom(_NONCE)
            body = self._cipher.encrypt(nonce, bytes(blob), head + store_key.encode())
            return head + nonce + body
        head = _HEAD.pack(_MAGIC, _AUTH)
        tag = hmac.new(self._mac_key, head + _framed(store_key) + blob, "sha256").digest()
        return head + tag + blob

    def open(self, store_key: str, data: bytes) -> bytes:
        """The blob ``seal(store_key, blob)`` made, or ``SealError``.

        Raises:
          SealError: ``data`` is not sealed in this sealer's mode, is cut short, or
            fails its tag (changed, moved from another key, or sealed with another
            key).
        """
        view = memoryview(data)
        if len(view) < _HEAD.size:
            raise SealError(f"blob under {store_key!r} is not sealed ({len(view)} bytes)")
        magic, mode = _HEAD.unpack_from(view)
        want = _ENCRYPT if self._cipher is not None else _AUTH
        if magic != _MAGIC or mode != want:
            raise SealError(f"blob under {store_key!r} is not sealed for {self.mode} (an "
                            "unsealed page, or one sealed in another mode)")
        head = bytes(view[:_HEAD.size])
        if self._cipher is not None:
            from cryptography.exceptions import InvalidTag
            nonce = bytes(view[_HEAD.size:_HEAD.size + _NONCE])
            try:
                return self._cipher.decrypt(nonce, bytes(view[_HEAD.size + _NONCE:]),
                                            head + store_key.encode())
            except (InvalidTag, ValueError):
                raise SealError(f"blob under {store_key!r} fails its AES-GCM tag (changed, "
                                "moved from another key, or sealed with another key)") \
                    from None
        tag = bytes(view[_HEAD.size:_HEAD.size + _TAG])
        blob = view[_HEAD.size + _TAG:]
        mac = hmac.new(self._mac_key, head + _framed(store_key), "sha256")
        mac.update(blob)
        if len(tag) != _TAG or not hmac.compare_digest(tag, mac.digest()):
            raise SealError(f"blob under {store_key!r} fails its MAC (changed, moved from "
                            "another key, or sealed with another key)")
        return bytes(blob)

    def __repr__(self) -> str:
        return f"Sealer({self.mode})"  # never the key


def _framed(store_key: str) -> bytes:
    raw = store_key.encode()
    return struct.pack("<I", len(raw)) + raw
