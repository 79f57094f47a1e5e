"""Reader for the IDX format of (Fashion-)MNIST, plain or gzip-compressed, with strict validation."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

# IDX type byte -> numpy dtype (big-endian on disk).
_IDX_DTYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file; corrupt or truncated files raise ``ValueError`` naming the file and the problem."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:
        raise ValueError(f"cannot read IDX file {path}: {exc}") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    header_end = 4 + 4 * ndim
    if len(data) < header_end:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header_end != expected:
        raise ValueError(
            f"{path}: IDX payload has {len(data) - header_end} bytes, header {shape} needs {expected}"
        )
    return np.frombuffer(data, dtype=dtype, offset=header_end).reshape(shape).astype(dtype.newbyteorder("="))
