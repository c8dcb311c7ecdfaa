"""Signed weight announcements: the learner signs each with its Ed25519 key, and whoever loads
weights (producers, `sao serve`, `sao eval`) verifies the signature with the public keys it trusts
before acting on the announcement. The signature covers every field that decides what is loaded
(version, base, the digest of the resulting state, where the payload is and, for an inline one, its
bytes' hash), so an announcement cannot be re-sent under another version, point at other bytes or
name another state; the digest then binds each tensor. Without the learner's private key, writing
`sao.weights` can change nothing an engine runs.

Keys: `sao keys --out DIR` writes `learner.key` (the private key, PEM, readable by its owner only)
and `learner.pub` (the public key, PEM). A key is known by its id, the first 16 hex digits of the
SHA-256 of its raw public bytes. Rotation: followers trust the old and the new public key while
the learner switches to the new private key, then drop the old one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack

from schemas.config import ConfigError
from schemas.files import atomic_file
from schemas.messages import Weights

PRIVATE_FILE, PUBLIC_FILE = "learner.key", "learner.pub"


def _raw(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key) -> str:
    return hashlib.sha256(_raw(public_key)).hexdigest()[:16]


def create_keys(folder: Path) -> tuple[Path, Path]:
    """A new Ed25519 key pair in `folder`: (private key file, mode 0600; public key file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private, public = folder / PRIVATE_FILE, folder / PUBLIC_FILE
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    atomic_file(private, pem, mode=0o600)
    atomic_file(public, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@dataclass(frozen=True)
class Signer:
    """The learner's private key, and its id."""

    key: object
    key_id: str

    def sign(self, w: Weights) -> Weights:
        signed = replace(w, key_id=self.key_id, signature=b"")
        return replace(signed, signature=self.key.sign(signed_bytes(signed)))


def load_signer(path: Path, flag: str = "--weights.signing-key") -> Signer:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{flag} {path}: not a readable PEM private key ({type(e).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{flag} {path}: an Ed25519 key is needed (sao keys makes one)")
    return Signer(key, key_id(key.public_key()))


def load_trusted(paths: str, flag: str = "--weights.trusted-keys") -> dict[str, object]:
    """The public keys of the comma-separated PEM files `paths`, by key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    trusted = {}
    for path in (p.strip() for p in paths.split(",") if p.strip()):
        try:
            key = serialization.load_pem_public_key(Path(path).read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{flag}: {path} is not a readable PEM public key ({type(e).__name__})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{flag}: {path} is not an Ed25519 public key")
        trusted[key_id(key)] = key
    return trusted


def signed_bytes(w: Weights) -> bytes:
    """What the signature covers: every field that decides what is loaded, and the key's id."""
    return msgpack.packb(["sao.weights/1", w.version, w.step, w.base, w.digest, w.num_bytes, w.uri,
                          hashlib.sha256(w.payload).hexdigest(), w.store, w.dtype, w.format,
                          float(w.created_at), w.key_id], use_bin_type=True)


def refusal(w: Weights, trusted: dict[str, object]) -> str:
    """Why `w` must not be acted on ("" when its signature verifies with a trusted key): `unsigned`,
    `untrusted` (signed by a key not trusted here) or `forged` (the signature does not match)."""
    from cryptography.exceptions import InvalidSignature

    if not w.signature:
        return "unsigned"
    key = trusted.get(w.key_id)
    if key is None:
        return "untrusted"
    try:
        key.verify(w.signature, signed_bytes(w))
    except InvalidSignature:
        return "forged"
    return ""
