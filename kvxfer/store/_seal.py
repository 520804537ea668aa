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
BLAKE2b, each under its own personalisation; key material longer than BLAKE2b's 64
key bytes is hashed whole first (under a derivation of its own, so it never meets a
short key's).

Each sealer names its key with a key id (``key_id``: 16 hex digits of a keyed BLAKE2b
under a personalisation of its own, which says nothing of the key). Store keys carry
it, so caches with other keys (a rotation, another fleet) miss each other's pages
instead of deleting them; ``previous_keys`` lets a rotated cache still open the pages
its old keys sealed (``previous``: one sealer per old key).

Example:
    >>> sealer = Sealer(b"sixteen byte key!")
    >>> sealed = sealer.seal("page-1", b"blob")
    >>> sealer.open("page-1", sealed)
    b'blob'
    >>> sealer.open("page-2", sealed)
    Traceback (most recent call last):
    ...
    kvxfer.store._seal.SealError: blob under 'page-2' fails its MAC (changed, moved from another key, or sealed with another key)
    >>> rotated = Sealer(b"a new sixteen byte key", previous_keys=[b"sixteen byte key!"])
    >>> old, = rotated.previous
    >>> rotated.key_id != sealer.key_id, old.key_id == sealer.key_id, old.open("page-1", sealed)
    (True, True, b'blob')
    >>> len(sealed) == sealer.overhead + len(b"blob")
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Iterable

__all__ = ["Sealer", "SealError", "MIN_KEY_BYTES"]

_MAGIC = b"KVXSEAL1"
_HEAD = struct.Struct("<8sB")
_AUTH, _ENCRYPT = 1, 2
_TAG = 32
_NONCE = 12
MIN_KEY_BYTES = 16
_BLAKE2B_KEY = 64  # the most key bytes BLAKE2b takes
_GCM_TAG = 16
CRYPTO_HINT = "pip install 'kvxfer[crypto]' (the cryptography package)"


class SealError(ValueError):
    """A sealed blob that does not open: not sealed, changed, or sealed otherwise."""


def _derive(key: bytes, person: bytes, size: int = 32) -> bytes:
    """``size`` bytes derived from all of ``key`` under ``person``.

    A key longer than BLAKE2b takes is hashed whole to 64 bytes first, and then keys a
    different message: a short key equal to that hash derives other bytes.
    """
    message = b"kvxfer-store-seal"
    if len(key) > _BLAKE2B_KEY:
        key = hashlib.blake2b(key, digest_size=_BLAKE2B_KEY, person=b"kvxfer-longkey").digest()
        message = b"kvxfer-store-seal-long"
    return hashlib.blake2b(message, key=key, digest_size=size, person=person).digest()


def _check_key(key: object, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"{what} must be bytes (32 random bytes, say). Got "
                        f"{type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{what} has {len(key)} bytes; use at least "
                         f"{MIN_KEY_BYTES} (32 random bytes: os.urandom(32))")
    return bytes(key)


class Sealer:
    """Seals blobs before they reach a store and opens them after.

    Args:
      key: secret key material, bytes of at least 16 bytes (32 random bytes is
        right; every byte counts, however many); every process that shares the
        store's pages needs the same key.
      encrypt: also encrypt the page bytes (AES-256-GCM; needs ``cryptography``).
      previous_keys: keys this one replaced (a rotation): pages sealed with them can
        still be opened by ``previous``, in this order, to be sealed again with
        ``key``. Never used to seal.

    Raises:
      TypeError, ValueError: ``key`` or a previous key is not bytes or too short.
      ImportError: ``encrypt=True`` without the ``cryptography`` package.
    """

    def __init__(self, key: bytes, *, encrypt: bool = False,
                 previous_keys: Iterable[bytes] = ()):
        key = _check_key(key, "the store key")
        if isinstance(previous_keys, (bytes, bytearray, str)):
            raise TypeError("previous_keys must be a list of keys (bytes). Got one "
                            f"{type(previous_keys).__name__}: pass [key]")
        old = [_check_key(k, f"previous key {i}") for i, k in enumerate(previous_keys)]
        self.encrypt = bool(encrypt)
        self.key_id = _derive(key, b"kvxfer-key-id", 8).hex()
        self._mac_key = _derive(key, b"kvxfer-mac")
        self._cipher = None
        if self.encrypt:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError as e:
                raise ImportError(f"encrypt=True needs AES-GCM: {CRYPTO_HINT}") from e
            self._cipher = AESGCM(_derive(key, b"kvxfer-aes"))
        previous: dict[str, Sealer] = {}
        for k in old:
            sealer = Sealer(k, encrypt=self.encrypt)
            if sealer.key_id != self.key_id:  # (the current key, listed again: no use)
                previous.setdefault(sealer.key_id, sealer)
        #: A sealer per previous key, in the order given (each key once).
        self.previous: tuple[Sealer, ...] = tuple(previous.values())

    @property
    def mode(self) -> str:
        """``"auth"`` or ``"encrypt"`` (part of the store keys of sealed pages)."""
        return "encrypt" if self.encrypt else "auth"

    @property
    def overhead(self) -> int:
        """Bytes a sealed blob has beyond the blob: the frame's head, and the nonce and
        GCM tag (``encrypt``) or the MAC tag (``auth``)."""
        return _HEAD.size + (_NONCE + _GCM_TAG if self.encrypt else _TAG)

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

    def __repr__(self) -> str:  # never the key; its id names it
        old = f", {len(self.previous)} previous" if self.previous else ""
        return f"Sealer({self.mode}, key id {self.key_id}{old})"


def _framed(store_key: str) -> bytes:
    raw = store_key.encode()
    return struct.pack("<I", len(raw)) + raw
