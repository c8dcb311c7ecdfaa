"""`sao keys`: a new Ed25519 key pair for signing weight announcements (schemas/signing.py).

The learner signs with the private key (`sao learner --weights.signing-key DIR/learner.key`; keep
it where only the learner can read it); producers, `sao serve` and `sao eval` load only what it
signed (`--weights.trusted-keys DIR/learner.pub`, `sao eval --trusted-keys`). To rotate: make a new
pair, give followers both public keys (`--weights.trusted-keys old.pub,new.pub`), restart the
learner on the new private key, then drop the old public key from the followers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.config import ConfigError
from schemas.signing import PRIVATE_FILE, create_keys, load_signer


@dataclass(kw_only=True)
class KeysConfig:
    out: Path = Path("keys")
    """Folder for learner.key (private, mode 0600) and learner.pub (public)."""
    force: bool = False
    """Replace a key pair already there (followers must then trust the new public key)."""


def run(cfg: KeysConfig) -> None:
    if (cfg.out / PRIVATE_FILE).exists() and not cfg.force:
        raise ConfigError(f"--out {cfg.out}: holds a key pair already; --force replaces it")
    private, public = create_keys(cfg.out)
    print(f"key {load_signer(private).key_id}: private {private} (learner only), public {public} (followers)")
