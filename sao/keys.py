"""`sao keys`: a new Ed25519 key pair for signing weight announcements (schemas/signing.py).

The learner signs with the private key (`sao learner --weights.signing-key DIR/learner.key`; keep
it where only the learner can read it); producers, `sao serve` and `sao eval` load only what it
signed (`--weights.trusted-keys DIR/learner.pub`, `sao eval --trusted-keys`). To rotate: make a new
pair, give followers both public keys (`--weights.trusted-keys old.pub,new.pub`), restart the
learner on the new private key, then drop the old public key from the followers. The compose
stack runs `sao keys --keep --public-copy /weights/learner.pub` at every start (docker-compose.yml).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.config import ConfigError
from schemas.signing import PRIVATE_FILE, PUBLIC_FILE, create_keys, load_signer


@dataclass(kw_only=True)
class KeysConfig:
    out: Path = Path("keys")
    """Folder for learner.key (private, mode 0600) and learner.pub (public)."""
    force: bool = False
    """Replace a key pair already there (followers must then trust the new public key)."""
    keep: bool = False
    """Keep a key pair already there instead of refusing (a stack's every start: docker-compose.yml)."""
    public_copy: Path | None = None
    """Also write the public key here (where followers read it: a shared weights volume)."""


def run(cfg: KeysConfig) -> None:
    private, public = cfg.out / PRIVATE_FILE, cfg.out / PUBLIC_FILE
    if private.exists() and not (cfg.force or cfg.keep):
        raise ConfigError(f"--out {cfg.out}: holds a key pair already; --force replaces it, --keep keeps it")
    if cfg.force or not private.exists():
        private, public = create_keys(cfg.out)
    if cfg.public_copy is not None:
        cfg.public_copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = cfg.public_copy.with_name(f".{cfg.public_copy.name}.tmp")
        tmp.write_bytes(public.read_bytes())
        tmp.replace(cfg.public_copy)
    print(f"key {load_signer(private).key_id}: private {private} (learner only), public {public} (followers)")
