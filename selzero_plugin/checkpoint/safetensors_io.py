"""safetensors files written one tensor at a time and read one tensor at a time.

[Note: streaming safetensors]
``safetensors.torch.save_file`` needs every tensor in memory at once, which is what makes
converters blow up on large checkpoints (DeepSpeed's zero_to_fp32, prior-art pain point 10). A
safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and ``[begin, end)`` byte range, then the raw bytes. When the shapes and dtypes are
known up front, the header can be written first and the tensors appended in header order, each
freed after it is written: that is ``StreamingWriter``. It also hashes the bytes as they go, so
a shard's sha256 costs no second read.

Reading one tensor (``LazyShard``) is a positional read of its byte range into a new tensor:
no mapping. ``safetensors.safe_open`` maps the file, and every page touched stays in the
process's resident set while it is open; on this machine (a Firecracker VM) reading through the
mapping also ran at ~100 MB/s, a read() at memory speed (100 MB of shard: 0.66 s of CPU through
the mapping, about 0.02 s read). ``read_header`` still uses ``safe_open``, whose parser checks
the header (offsets, sizes) before any tensor is read; ``LazyShard`` checks each range it reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["TensorPlan", "StreamingWriter", "LazyShard", "read_header", "sha256_file",
           "DTYPE_CODES", "dtype_from_name", "dtype_name", "SafetensorError"]

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """Worker threads that hash what the writers write (made at the first write)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1),
                                         thread_name_prefix="selzero-sha256")
        return _HASHER
_HASH_BLOCK = 4 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling the manifest uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {name!r}: expected one of "
                         f"{', '.join(dtype_name(d) for d in DTYPE_CODES)}")
    return dtype


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a file, known before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


class StreamingWriter:
    """Write a safetensors file whose header is planned first; tensors then come in plan order."""

    def __init__(self, path: str | os.PathLike[str], plan: Sequence[TensorPlan],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for t in plan:
            if t.name in header:
                raise ValueError(f"tensor name {t.name!r} appears twice in the plan")
            header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the reference writer aligns the data to 8 bytes
        self.path = Path(path)
        self._plan = list(plan)
        self._next = 0
        self._hash = hashlib.sha256()
        self._hashing: Future[None] | None = None
        self._bytes = 0
        self._file = open(self.path, "wb")
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data: Any) -> None:
        """Write ``data`` and hash it on a worker thread (hashlib releases the GIL), so that
        hashing a block overlaps with writing it and with making the next one; one block of
        this file is hashed at a time, in order."""
        self._file.write(data)
        self._wait_hashing()
        self._hashing = _hasher().submit(self._hash.update, data)
        self._bytes += memoryview(data).nbytes

    def _wait_hashing(self) -> None:
        if self._hashing is not None:
            pending, self._hashing = self._hashing, None
            pending.result()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor (its name, dtype and shape must match the plan)."""
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: tensor {name!r} is beyond the {len(self._plan)} "
                             "planned")
        t = self._plan[self._next]
        if name != t.name or tensor.dtype != t.dtype or tuple(tensor.shape) != t.shape:
            raise ValueError(f"{self.path}: expected tensor {t.name!r} {dtype_name(t.dtype)} "
                             f"{list(t.shape)} next, got {name!r} {dtype_name(tensor.dtype)} "
                             f"{list(tensor.shape)}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self._emit(flat.view(torch.uint8).numpy())
        self._next += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> tuple[int, str]:
        """Finish (fsync) the file; returns (byte size, sha256 hex)."""
        if self._next != len(self._plan):
            missing = [t.name for t in self._plan[self._next:]]
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} planned tensor(s) never written, "
                             f"first {missing[0]!r}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._wait_hashing()
        return self._bytes, self._hash.hexdigest()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._hashing is not None:
            self._hashing.cancel() or self._hashing.exception()  # (done with it either way)
            self._hashing = None

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, tuple[str, tuple[int, ...]]],
                                                       dict[str, str]]:
    """({name: (dtype code, shape)}, metadata) without reading any tensor data.

    Raises ``SafetensorError`` / ``OSError`` on an unreadable or malformed file."""
    with safe_open(str(path), framework="pt") as f:
        header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                  for k in f.keys()}
        return header, dict(f.metadata() or {})


class LazyShard:
    """Tensors of one safetensors file, read on demand, one positional read each. ``file``: the
    file already open (a load reads through the descriptor it checked, so a file renamed over
    the path meanwhile is never read, [Note: streaming load])."""

    def __init__(self, path: str | os.PathLike[str], *, file: Any = None) -> None:
        self.path = str(path)
        self._file: Any = None
        self._header: dict[str, Any] = {}
        self._data_start = 0
        self._given = file
        self._checked: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] | None = None

    def header(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{name: (dtype code, shape)}, once every entry is checked: a known dtype code, a
        shape and offsets of non-negative integers (JSON numbers with no fraction: 17.0, "17"
        and true are refused, as safetensors' own parser does), each range the size its dtype
        and shape give, the ranges tiling the data in order up to the end of the file."""
        return {name: (code, shape) for name, (code, _, shape, _, _) in self._entries().items()}

    def _entries(self) -> dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]]:
        """The checked header (``header``), parsed once; ``read`` uses these values only."""
        if self._checked is not None:
            return self._checked
        f = self._open()
        out = {}
        for name, info in self._header.items():
            if name == "__metadata__":
                continue
            code = info.get("dtype") if isinstance(info, dict) else None
            shape = info.get("shape") if isinstance(info, dict) else None
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            if not isinstance(code, str) or code not in _DTYPE_OF_CODE \
                    or not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
                raise SafetensorError(f"{self.path}: {name!r} has a malformed entry "
                                      f"({json.dumps(info)[:120]})")
            dtype = _DTYPE_OF_CODE[code]
            begin, end = offsets
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize:
                raise SafetensorError(f"{self.path}: {name!r} spans {end - begin} bytes, its "
                                      "dtype and shape need another size")
            out[name] = (code, dtype, tuple(shape), begin, end)
        at = 0
        for name, entry in sorted(out.items(), key=lambda kv: kv[1][3:]):
            if entry[3] != at:
                raise SafetensorError(f"{self.path}: {name!r} starts at byte {entry[3]}, not {at}")
            at = entry[4]
        if self._data_start + at != os.fstat(f.fileno()).st_size:
            raise SafetensorError(f"{self.path}: the data ends at byte {self._data_start + at}, "
                                  "the file does not")
        self._checked = out
        return out

    def _open(self) -> Any:
        if self._file is None:
            f = self._given if self._given is not None else open(self.path, "rb")
            self._given = None
            f.seek(0)
            try:
                raw = f.read(8)
                if len(raw) != 8:
                    raise SafetensorError(f"{self.path}: shorter than a safetensors header")
                (length,) = struct.unpack("<Q", raw)
                header = json.loads(f.read(length))
                if not isinstance(header, dict):
                    raise SafetensorError(f"{self.path}: the header is not a JSON object")
            except BaseException:
                f.close()
                raise
            self._file, self._header, self._data_start = f, header, 8 + length
        return self._file

    def read(self, name: str) -> torch.Tensor:
        entries = self._entries()  # (checked once)
        if name not in entries:
            raise SafetensorError(f"{self.path}: no tensor {name!r}")
        _, dtype, shape, begin, end = entries[name]
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            f = self._open()
            f.seek(self._data_start + begin)
            got = f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
            if got != end - begin:
                raise SafetensorError(f"{self.path}: {name!r} is cut short ({got} of "
                                      f"{end - begin} bytes); the file is truncated")
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "LazyShard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _naturals(value: Any) -> bool:
    """A list of non-negative ints (not bools, nor floats or strings that look like ints)."""
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def sha256_file(path: str | os.PathLike[str] | Any) -> str:
    """The sha256 of a file: a path, or a file open for binary reading (read from its start)."""
    digest = hashlib.sha256()
    if hasattr(path, "read"):
        path.seek(0)
        while block := path.read(_HASH_BLOCK):
            digest.update(block)
        return digest.hexdigest()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()
