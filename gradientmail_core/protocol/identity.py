"""Per-node identities: an Ed25519 key pair per node, kept in a file the user names.

The key file is a PEM (PKCS#8) or 64 hex characters of a 32-byte seed, mode 0600, created on
first use. A public key travels as 64 lowercase hex characters; its fingerprint (16 hex of its
sha256) ends a members-only node's learner id (``learner_id``). ``cryptography`` (the ``identity``
extra) is imported on first use only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import re
import secrets
from typing import Any

from ..errors import MissingExtra
from . import keys

PUBKEY = re.compile(r"[0-9a-f]{64}")
SIG = re.compile(r"[0-9a-f]{128}")
FINGERPRINT_HEX = 16
_MAX_KEY_FILE = 16 << 10


def _crypto(module: str) -> Any:
    try:
        return importlib.import_module(f"cryptography.{module}")
    except ImportError as e:
        raise MissingExtra("identity", "cryptography") from e


def _ed25519() -> Any:
    return _crypto("hazmat.primitives.asymmetric.ed25519")


def _serialization() -> Any:
    return _crypto("hazmat.primitives.serialization")


def fingerprint(public_hex: str) -> str:
    """The short name of a public key: the first 16 hex characters of its sha256."""
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:FINGERPRINT_HEX]


def learner_id(base: str, public_hex: str) -> str:
    """``base`` with ``-{fingerprint}`` appended (unless it already ends so), cut to fit 64 characters."""
    fp = fingerprint(public_hex)
    if base.endswith("-" + fp):
        return keys.validate_learner_id(base)
    head = base[: 64 - FINGERPRINT_HEX - 1].rstrip("-") or "node"
    return keys.validate_learner_id(f"{head}-{fp}")


def names_key(learner: str, public_hex: str) -> bool:
    """True if learner id ``learner`` carries the fingerprint of ``public_hex``."""
    return learner.endswith("-" + fingerprint(public_hex))


@functools.lru_cache(maxsize=4096)
def _public_key(public_hex: str) -> Any:
    return _ed25519().Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))


def verify(public_hex: str, sig_hex: str, message: bytes) -> bool:
    """True if ``sig_hex`` is ``public_hex``'s Ed25519 signature of ``message``."""
    if not PUBKEY.fullmatch(public_hex) or not SIG.fullmatch(sig_hex):
        return False
    try:
        _public_key(public_hex).verify(bytes.fromhex(sig_hex), message)
    except (ValueError, _crypto("exceptions").InvalidSignature):  # not a point on the curve; a bad signature
        return False
    return True


class Identity:
    """A node's Ed25519 key pair. Signs; never shows its private half."""

    def __init__(self, private_key: Any, path: str | None = None) -> None:
        self._key = private_key
        self.path = path
        raw = private_key.public_key().public_bytes(_serialization().Encoding.Raw, _serialization().PublicFormat.Raw)
        self.public_hex = raw.hex()
        self.fingerprint = fingerprint(self.public_hex)

    def __repr__(self) -> str:
        return f"Identity({self.fingerprint}, path={self.path!r})"

    @classmethod
    def generate(cls) -> Identity:
        return cls(_ed25519().Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A key pair from a 32-byte seed (tests and benchmarks: deterministic keys)."""
        return cls(_ed25519().Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, create: bool = True) -> Identity:
        """The identity in ``path``; a new one is created there first if the file does not exist
        (and ``create``). Raises ``ValueError`` naming the file if it is not a usable key."""
        path = os.fspath(path)
        if create and not os.path.lexists(path):
            _create(path)
        return cls(_read(path), path)

    def pem(self) -> bytes:
        s = _serialization()
        return self._key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()

    def learner_id(self, base: str) -> str:
        return learner_id(base, self.public_hex)


def _create(path: str) -> None:
    """Write a new private key to ``path`` atomically, mode 0600; if another process creates
    ``path`` first, keep theirs."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"identity file {path!r}: the folder {folder!r} does not exist")
    pem = Identity.generate().pem()
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # fails if it exists: never overwrites a key
    finally:
        os.unlink(tmp)


def _read(path: str) -> Any:
    try:
        st = os.stat(path)
        if os.name == "posix" and st.st_mode & 0o077:
            raise ValueError(
                f"identity file {path!r} is readable by others (mode {st.st_mode & 0o777:o}): a private key must be "
                f"private; run chmod 600 {path}"
            )
        if st.st_size > _MAX_KEY_FILE:
            raise ValueError(f"identity file {path!r} is {st.st_size} bytes: not a key file")
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_FILE + 1)
    except OSError as e:
        raise ValueError(f"identity file {path!r} cannot be read: {e}") from None
    text = data.strip()
    ed = _ed25519()
    if re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        return ed.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text.decode()))
    try:
        key = _serialization().load_pem_private_key(text, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"identity file {path!r} is not an Ed25519 private key (expected a PEM PKCS#8 key or 64 hex "
            f"characters of a raw seed): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if not isinstance(key, ed.Ed25519PrivateKey):
        raise ValueError(f"identity file {path!r} holds a {type(key).__name__}, not an Ed25519 private key")
    return key
