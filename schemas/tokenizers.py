"""Tokenizers by model name, for every service that turns token ids into text or back.

`ByteTokenizer` is a ChatML tokenizer over raw UTF-8 bytes for the tiny `tiny-llama-bytes` model:
256 byte ids plus four special tokens, no files, no downloads. Real models' tokenizers come from
transformers (imported only when one is asked for): SmolLM2's from its GGUF, or a folder's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from schemas.models import check_model, smollm2_gguf


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) + `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<|pad|>`."""

    special = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>")
    vocab_size = 256 + len(special)
    eos_token_id = 257  # <|im_end|>

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for k, tok in enumerate(self.special):
                if text.startswith(tok, i):
                    ids.append(256 + k)
                    i += len(tok)
                    break
            else:
                j = min((p for p in (text.find(t, i) for t in self.special) if p >= 0), default=len(text))
                ids += text[i:j].encode()
                i = j
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, run = [], bytearray()
        for t in ids:
            if t < 256:
                run.append(t)
                continue
            out.append(run.decode(errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.special[t - 256])
        out.append(run.decode(errors="replace"))
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return 256 + self.special.index(token) if token in self.special else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False) -> str | list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def load_tokenizer(name: str):
    """The tokenizer paired with model `name`; None for the raw-id tiny models (toy envs)."""
    check_model(name)
    if name in ("tiny-llama", "tiny-qwen3-moe"):
        return None
    if name == "tiny-llama-bytes":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    path = smollm2_gguf() if name == "smollm2" else Path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
