"""Weight updates on the wire: the payload a `Weights` announcement points to (at its `uri`) or
carries (`payload`), encoded by the learner and decoded, applied and verified by every producer.

A payload is a safetensors file, so any reader can open it: its `__metadata__["sao"]` (JSON) names
the `base` version it applies onto (-1: an anchor, the whole state) and, for every tensor of the
resulting state, its dtype, shape, checksum and encoding:

- `whole`: the entry of that name holds the tensor;
- `xor`: two U8 entries, `NAME:mask` (np.packbits of "this element changed", zstd) and `NAME:xor`
  (new ^ old bits of the changed elements, zstd: sign and exponent rarely change, so half the
  bytes are zeros);
- `same`: unchanged since the base, not sent.

Elements compare by their bit pattern in the published dtype, so an element whose bf16 value did
not change is not sent, and reconstruction is exact. A checksum is blake3 of a tensor's bytes
(2x sha256's speed on this machine); a state's `digest` is blake3 over every tensor's name, dtype,
shape and checksum, so it names the resulting weights whatever encoding carried them. Decoding is
strict and bounded like the message codec (SchemaError naming the tensor): offsets inside the
payload, sizes consistent, decompression into buffers of the expected size only.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import BinaryIO

import blake3
import cramjam
import numpy as np
import torch

from schemas.fields import SchemaError

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""safetensors dtype names and their widths in bytes."""
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound
CHUNK = 1 << 22  # elements compared at a time: bounds the temporaries of a huge embedding
ZSTD_LEVEL = 1  # level 3 buys < 1 % on masks and xor bytes at 1.3x the time


@dataclass(eq=False)
class Tensor:
    """One tensor as raw bits: safetensors dtype, shape, and a 1-D array of unsigned integers of the
    dtype's width (a view over a payload or a snapshot; never written to)."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @cached_property
    def checksum(self) -> str:
        return blake3.blake3(self.bits.view(np.uint8)).hexdigest(length=16)

    @property
    def numel(self) -> int:
        return self.bits.size


State = dict[str, Tensor]


def tensor(dtype: str, shape: tuple[int, ...], data) -> Tensor:
    """A Tensor over the bytes of `data` (any buffer, no copy)."""
    return Tensor(dtype, tuple(shape), np.frombuffer(data, np.uint8).view(_BITS[ITEMSIZE[dtype]]))


_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {v: k for k, v in _TORCH.items()}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views of the bits
_NP_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def from_torch(t: torch.Tensor) -> Tensor:
    """A host tensor's bits, without a copy (of a contiguous tensor)."""
    flat = t.contiguous().reshape(-1).view(_INTS[t.element_size()]).numpy()
    return Tensor(_NAMES[t.dtype], tuple(t.shape), flat.view(_BITS[t.element_size()]))


def to_torch(t: Tensor) -> torch.Tensor:
    """`t` as a torch tensor: a view of its bits, or a copy of them where they are read-only (a
    payload's), which torch cannot view."""
    ints = np.array(t.bits, copy=not t.bits.flags.writeable).view(_NP_INTS[t.bits.itemsize])
    return torch.from_numpy(ints).view(_TORCH[t.dtype]).reshape(t.shape)


def digest(state: State) -> str:
    """blake3 over (name, dtype, shape, checksum) of every tensor, in order: the announcement's `digest`."""
    h = blake3.blake3()
    for name, t in state.items():
        h.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0{t.checksum}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------- payloads


@dataclass(kw_only=True)
class Payload:
    """A safetensors file's parts: entries (name, dtype, shape, bytes) and the `sao` metadata."""

    base: int
    """-1: an anchor; else the version this delta applies onto."""
    entries: list[tuple[str, str, tuple[int, ...], np.ndarray]]
    tensors: dict[str, list]
    """name → [dtype, shape, checksum, encoding] of every tensor of the resulting state."""
    extra: dict = field(default_factory=dict)
    """Plain data travelling with the weights (the LoRA scale)."""

    @cached_property
    def header(self) -> bytes:
        header, offset = {}, 0
        for name, dtype, shape, data in self.entries:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
            offset += data.nbytes
        meta = {"base": self.base, "tensors": self.tensors, "extra": self.extra}
        header["__metadata__"] = {"sao": json.dumps(meta, separators=(",", ":"))}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    @property
    def num_bytes(self) -> int:
        return len(self.header) + sum(data.nbytes for *_, data in self.entries)

    def chunks(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for *_, data in self.entries:
            yield memoryview(np.ascontiguousarray(data)).cast("B")

    def write(self, f: BinaryIO) -> None:
        for chunk in self.chunks():
            f.write(chunk)

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks())


def anchor(state: State, extra: dict | None = None) -> Payload:
    """Every tensor whole."""
    return Payload(base=-1, entries=[(n, t.dtype, t.shape, t.bits) for n, t in state.items()],
                   tensors={n: [t.dtype, list(t.shape), t.checksum, "whole"] for n, t in state.items()},
                   extra=extra or {})


def delta(new: State, old: State, base: int, extra: dict | None = None) -> tuple[Payload, State]:
    """The changes from `old` (version `base`) to `new`, and the resulting state, which reuses
    `old`'s Tensor objects where nothing changed (their checksums are not computed again)."""
    entries, tensors, result = [], {}, {}
    for name, t in new.items():
        o = old.get(name)
        if o is None or (o.dtype, o.shape) != (t.dtype, t.shape):
            changed, xor = None, None
        else:
            changed, xor = _changes(t.bits, o.bits)
        if changed is not None and not xor.size:
            result[name] = o
            tensors[name] = [o.dtype, list(o.shape), o.checksum, "same"]
            continue
        result[name] = t
        sparse = None
        if changed is not None and 2 * xor.size < t.numel:  # else whole is surely smaller
            sparse = (_zstd(changed), _zstd(xor.view(np.uint8)))
        if sparse is not None and sum(b.nbytes for b in sparse) < t.bits.nbytes:
            entries += [(f"{name}:mask", "U8", (sparse[0].nbytes,), sparse[0]),
                        (f"{name}:xor", "U8", (sparse[1].nbytes,), sparse[1])]
            tensors[name] = [t.dtype, list(t.shape), t.checksum, "xor"]
        else:
            entries.append((name, t.dtype, t.shape, t.bits))
            tensors[name] = [t.dtype, list(t.shape), t.checksum, "whole"]
    return Payload(base=base, entries=entries, tensors=tensors, extra=extra or {}), result


def _changes(new: np.ndarray, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(np.packbits of new != old, (new ^ old) where they differ), a CHUNK of elements at a time."""
    masks, xors = [], []
    for i in range(0, new.size, CHUNK):
        a, b = new[i:i + CHUNK], old[i:i + CHUNK]
        diff = a != b
        masks.append(np.packbits(diff))
        xors.append(np.bitwise_xor(a[diff], b[diff]))
    return np.concatenate(masks or [np.zeros(0, np.uint8)]), np.concatenate(xors or [new[:0]])


def _zstd(data: np.ndarray) -> np.ndarray:
    return np.frombuffer(bytes(cramjam.zstd.compress(memoryview(data).cast("B"), level=ZSTD_LEVEL)), np.uint8)


# ---------------------------------------------------------------------------- decoding


def decode(data) -> tuple[Payload, dict[str, memoryview]]:
    """A payload's parts from its bytes (bytes, memoryview or an mmap), checked, and each entry's
    bytes as a view into `data`. Raises SchemaError naming what is wrong."""
    buf = memoryview(data).cast("B")
    if len(buf) < 8:
        raise SchemaError("payload", f"{len(buf)} bytes: not a safetensors file")
    (size,) = struct.unpack("<Q", buf[:8])
    if size > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise SchemaError("payload", f"header of {size} bytes in a payload of {len(buf)}")
    try:
        header = json.loads(bytes(buf[8:8 + size]))
        meta = json.loads(header.pop("__metadata__", {}).get("sao", "null"))
    except (ValueError, TypeError, AttributeError) as e:
        raise SchemaError("payload", f"header is not safetensors JSON with sao metadata: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("base"), int) or meta["base"] < -1:
        raise SchemaError("payload", "no sao metadata with an integer base >= -1")
    entries, start = [], 8 + size
    for name, e in header.items():
        dtype, shape = _entry(name, e)
        lo, hi = e["data_offsets"]
        if not 0 <= lo <= hi <= len(buf) - start or hi - lo != math.prod(shape) * ITEMSIZE[dtype]:
            raise SchemaError(name, f"data_offsets {lo}..{hi} do not fit {dtype}{list(shape)} in the payload")
        entries.append((name, dtype, shape, buf[start + lo:start + hi]))
    tensors, extra = meta.get("tensors"), meta.get("extra", {})
    if not isinstance(tensors, dict) or not isinstance(extra, dict):
        raise SchemaError("payload", "sao metadata needs a tensors map and an extra map")
    found = {name: (dtype, shape) for name, dtype, shape, _ in entries}
    expected = {}
    for name, spec in tensors.items():
        expected |= _expected_entries(name, spec, meta["base"])
    for name, (dtype, shape) in expected.items():
        if name not in found:
            raise SchemaError(name, "missing entry")
        if dtype is not None and found[name] != (dtype, shape):
            raise SchemaError(name, f"entry is {found[name][0]}{list(found[name][1])}, listed {dtype}{list(shape)}")
    if stray := found.keys() - expected.keys():
        raise SchemaError(sorted(stray)[0], "entry of no listed tensor")
    return (Payload(base=meta["base"], entries=entries, tensors=tensors, extra=extra),
            {name: view for name, _, _, view in entries})


def _entry(name: str, e) -> tuple[str, tuple[int, ...]]:
    if not (isinstance(e, dict) and e.get("dtype") in ITEMSIZE and isinstance(e.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2 and all(isinstance(x, int) for x in e["data_offsets"])):
        raise SchemaError(name, "entry needs a known dtype, a shape of sizes >= 0 and two data offsets")
    return e["dtype"], tuple(e["shape"])


def _expected_entries(name: str, spec, base: int) -> dict[str, tuple]:
    """The entries tensor `name`'s spec needs: name → (dtype, shape), None for opaque U8 blobs."""
    if not (isinstance(spec, list) and len(spec) == 4 and spec[0] in ITEMSIZE and isinstance(spec[1], list)
            and all(isinstance(d, int) and d >= 0 for d in spec[1]) and isinstance(spec[2], str)
            and len(spec[2]) == 32 and spec[3] in ("whole", "xor", "same")):
        raise SchemaError(name, "tensor spec must be [dtype, shape, 32-hex checksum, whole|xor|same]")
    if base < 0 and spec[3] != "whole":
        raise SchemaError(name, f"an anchor holds every tensor whole, not {spec[3]!r}")
    return {"whole": {name: (spec[0], tuple(spec[1]))},
            "xor": {f"{name}:mask": (None, None), f"{name}:xor": (None, None)}, "same": {}}[spec[3]]


def apply(payload: Payload, views: dict[str, memoryview], base: State | None) -> State:
    """The state `payload` describes: an anchor's tensors (views into the payload), or `base` with
    the delta applied (new arrays only for changed tensors). Every tensor is checked against its
    listed checksum; nothing of `base` is modified. Raises SchemaError naming the first tensor
    that does not verify."""
    if payload.base >= 0 and base is None:
        raise SchemaError("base", f"a delta onto version {payload.base} needs that version's state")
    state = {}
    for name, (dtype, shape, checksum, encoding) in payload.tensors.items():
        shape = tuple(shape)
        if encoding == "whole":
            t = tensor(dtype, shape, views[name])
        else:
            old = base.get(name)
            if old is None or (old.dtype, old.shape) != (dtype, shape):
                raise SchemaError(name, f"the base holds no {dtype}{list(shape)} tensor of this name")
            t = old if encoding == "same" else _unxor(old, views[f"{name}:mask"], views[f"{name}:xor"], name)
        if t.checksum != checksum:
            raise SchemaError(name, f"checksum {t.checksum} after applying the update, listed {checksum}")
        state[name] = t
    return state


def _unxor(old: Tensor, mask_z: memoryview, xor_z: memoryview, name: str) -> Tensor:
    n = old.numel
    mask = np.empty((n + 7) // 8, np.uint8)
    _unzstd(mask_z, mask, name + ":mask")
    k = int(np.bitwise_count(mask).sum())  # trailing pad bits are zeros: packbits wrote them
    xor = np.empty(k, old.bits.dtype)
    _unzstd(xor_z, xor.view(np.uint8), name + ":xor")
    bits, used = old.bits.copy(), 0
    for i in range(0, n, CHUNK):
        changed = np.unpackbits(mask[i // 8:(i + CHUNK) // 8], count=min(CHUNK, n - i)).view(bool)
        j = used + int(changed.sum())
        bits[i:i + CHUNK][changed] ^= xor[used:j]
        used = j
    if used != k:
        raise SchemaError(name + ":mask", "bits set past the tensor's end")
    return Tensor(old.dtype, old.shape, bits)


def _unzstd(data: memoryview, out: np.ndarray, name: str) -> None:
    """Decompress into `out`, which must be filled exactly (a bomb or a short stream is refused)."""
    try:
        written = cramjam.zstd.decompress_into(bytes(data), out) if out.size else 0
    except cramjam.DecompressionError as e:
        raise SchemaError(name, f"not a zstd stream of {out.nbytes} bytes: {e}") from None
    if written != out.nbytes:
        raise SchemaError(name, f"{written} bytes decompressed, expected {out.nbytes}")
