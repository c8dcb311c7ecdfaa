"""The policy's tokenizer, by model name, for turning a trajectory's token ids back into text.

Built in: `smollm2` (the tokenizer inside its GGUF), `tiny-llama-bytes` (UTF-8 bytes; special
tokens above 255 are dropped), a transformers folder, or a `.gguf` file. `consumers` may not import
`producers`, where the full byte tokenizer lives; decoding is all a judge needs of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from schemas.config import ConfigError
from schemas.models import check_model, smollm2_gguf


class ByteText:
    """Decoding of the byte tokenizer's ids: ids 0..255 are UTF-8 bytes."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def load_tokenizer(name: str, flag: str = "--model"):
    check_model(name, flag)
    if name == "tiny-llama-bytes":
        return ByteText()
    if name in ("tiny-llama", "tiny-qwen3-moe"):
        raise ConfigError(f"{flag} {name}: raw token ids, no text to judge")
    from transformers import AutoTokenizer  # only judges of real models pay for the import

    path = smollm2_gguf() if name == "smollm2" else Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
