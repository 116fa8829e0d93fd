"""Read-only NumPy views of a safetensors file's tensors over one memory map of it: no byte copied until used.

The format is a little-endian ``uint64`` header length, a JSON header giving
each tensor's ``dtype``, ``shape`` and ``data_offsets`` (from the end of the
header), then the data. ``safetensors.safe_open`` checks a file and reads its
header; its slices are copies, made while it holds the GIL, so a shard that
is a transposed part of a tensor would be copied twice (out of the file, then
into its layout). A view lets the device's own transfer (XLA's tiled
transpose on the host) read the file's pages once, straight into the shard.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

from nnx_shard.errors import WeightsMismatchError

# safetensors' dtype names -> NumPy's (little-endian, as the format stores them)
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def file_views(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """``{tensor name: read-only view}`` of every tensor of a safetensors file whose dtype NumPy knows.

    The views keep the file's memory map open; it closes when the last is gone.

    >>> import tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> path = tempfile.mkdtemp() + "/w.safetensors"
    >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    >>> v = file_views(path)["w"]
    >>> v.T.tolist(), v.flags.writeable
    ([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]], False)
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        except (struct.error, ValueError) as e:  # json.JSONDecodeError is a ValueError
            raise WeightsMismatchError(f"{path} is not a readable safetensors file: {e}") from e
        if size == 8 + length:  # no data: nothing to map (a zero-length map is an error)
            return {}
        pages = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    views = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry.get("dtype") not in DTYPES:
            continue
        dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
        begin, end = (8 + length + o for o in entry["data_offsets"])
        shape = tuple(entry["shape"])
        if not 8 + length <= begin <= end <= size or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise WeightsMismatchError(
                f"{path}: tensor {name!r} claims bytes {entry['data_offsets']} for {entry['dtype']} "
                f"{list(shape)}, which do not fit the file's {size - 8 - length} bytes of data"
            )
        views[name] = pages[begin:end].view(dtype).reshape(shape)
    return views
