"""The policy's tokenizer, by model name, for turning a trajectory's token ids back into text:
schemas/tokenizers.py's, refusing the raw-id tiny models, which have no text to judge."""

from __future__ import annotations

from schemas.config import ConfigError
from schemas.models import check_model
from schemas.tokenizers import load_tokenizer as schemas_load_tokenizer


def load_tokenizer(name: str, flag: str = "--model"):
    """The tokenizer of model `name`, which must have text to judge."""
    check_model(name, flag)
    tokenizer = schemas_load_tokenizer(name)
    if tokenizer is None:
        raise ConfigError(f"{flag} {name}: raw token ids, no text to judge")
    return tokenizer
