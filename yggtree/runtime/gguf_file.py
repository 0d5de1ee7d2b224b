"""A GGUF file's metadata and tensors, read without parsing what the runtime never reads.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array: the
tokenizer's ~100k strings (vocabulary and merges) cost ~2 s of every open on a 2-core machine,
a first run's largest single wait before its first token. The runtime reads the scalars (the
architecture's hyperparameters, the special token ids) and the tensors, and ships or converts
the tokenizer elsewhere (runtime/loading.py), so :func:`read_gguf` walks the header once,
steps over string arrays by their lengths (kept as :class:`Strings`, a count), and maps the
tensors' bytes from the file. The format's constants (value types, block sizes) are the
``gguf`` package's.

GGUF layout (v2, v3; little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value (an array: its
element type u32, count u64, elements; a string: length u64, UTF-8 bytes); each tensor a string
name, u32 dims, u64 dims (fastest first), u32 GGML type, u64 offset from the data start, which
is the end of the tensor table rounded up to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import YggError

# struct formats of the scalar value types, by gguf.GGUFValueType name
_SCALARS = {"UINT8": "<B", "INT8": "<b", "UINT16": "<H", "INT16": "<h", "UINT32": "<I", "INT32": "<i",
            "FLOAT32": "<f", "BOOL": "<?", "UINT64": "<Q", "INT64": "<q", "FLOAT64": "<d"}
# the numpy dtype of a tensor stored unquantized, by gguf.GGMLQuantizationType name (the rest, BF16
# among them, are rows of bytes: blocks)
_PLAIN = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
          "F64": np.float64}


@dataclass(frozen=True)
class Strings:
    """A metadata array of strings, not decoded: how many it holds."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dim first (a weight [in, out])
    kind: object  # gguf.GGMLQuantizationType
    # unquantized: [prod(shape[1:]), shape[0]] in its dtype; quantized: [prod(shape[1:]), bytes a row] uint8
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    fields: dict  # key -> int | float | bool | str | list (numeric arrays) | Strings
    tensors: tuple[GGUFTensor, ...]

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        from gguf import GGUFValueType as V

        self.buf, self.at = buf, 0
        self.scalars = {int(V[name]): fmt for name, fmt in _SCALARS.items()}
        self.STRING, self.ARRAY = int(V.STRING), int(V.ARRAY)

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, kind: int):
        if kind == self.STRING:
            return self.string()
        if kind in self.scalars:
            return self.unpack(self.scalars[kind])
        if kind != self.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, n = self.unpack("<I"), self.unpack("<Q")
        if elem == self.STRING:  # stepped over, length by length
            for _ in range(n):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
            return Strings(n)
        if elem in self.scalars:
            fmt = self.scalars[elem]
            size = struct.calcsize(fmt)
            out = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.at))
            self.at += n * size
            return out
        return [self.value(elem) for _ in range(n)]  # arrays of arrays: rare and small


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file at ``path`` (tensor data mapped from the file,
    read-only). YggError with one line naming the file for anything that is not a whole
    little-endian GGUF v2/v3 file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise YggError(f"cannot read GGUF file {path}: {e}") from None
    try:
        c = _Cursor(memoryview(mm))
        if bytes(mm[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = c.unpack("<4xI")
        if version in (2 << 24, 3 << 24):
            raise ValueError("a big-endian GGUF file (read: little-endian)")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (read: 2 and 3, little-endian)")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        fields = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
            infos.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
        align = int(fields.get("general.alignment", 32))
        if align <= 0:
            raise ValueError(f"alignment {align}")
        start = (c.at + align - 1) // align * align
        tensors = []
        for name, dims, kind, offset in infos:
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
            rows = int(np.prod(dims[1:], dtype=np.int64))
            nbytes = rows * dims[0] // block * size
            at = start + offset
            if at + nbytes > mm.shape[0] or dims[0] % block:
                raise ValueError(f"tensor {name} runs past the end of the file or splits a block")
            raw = mm[at : at + nbytes]
            data = raw.view(_PLAIN[qtype.name]) if qtype.name in _PLAIN else raw
            tensors.append(GGUFTensor(name, dims, qtype, data.reshape(rows, -1)))
        return GGUFFile(fields, tuple(tensors))
    except struct.error:
        raise YggError(f"cannot read GGUF file {path}: it ends inside its header (a truncated file?)") from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise YggError(f"cannot read GGUF file {path}: {e}") from None
