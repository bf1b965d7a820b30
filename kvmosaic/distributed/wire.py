"""The data plane's message format: a typed encoding that can carry data and nothing else.

A message is a msgpack "control" part followed by the raw bytes of its tensors, each padded to
``ALIGN`` so it can be viewed in its dtype without a copy. The control part holds None, bool, int,
float, str, bytes, lists, dicts (keys are strings) and three extension types: a tuple (so calls
and answers come back as they were sent), a torch dtype, and a tensor reference (dtype, shape,
offset into the tensor bytes). Dtypes come from an allow-list, and every reference is checked
against the bytes that arrived before a tensor is made. Unlike pickle, decoding never runs code
or builds any other type: a malformed message is a ``WireError``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import torch

ALIGN = 16
MAX_DIMS = 8
_TUPLE, _DTYPE, _TENSOR = 1, 2, 3
# no bool: a byte other than 0 or 1 read as a bool tensor is undefined behaviour in torch
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
_REF = struct.Struct("<BBQ")  # dtype code, number of dims, offset; then one <q per dim
_DIM = struct.Struct("<q")


class WireError(ValueError):
    """A value the data plane cannot carry (encoding), or a malformed message (decoding)."""


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Encoder:
    """One message's control part, with each tensor replaced by a reference to its bytes."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []  # contiguous, in the order their bytes follow
        self.data_bytes = 0
        self._packer = msgpack.Packer(default=self._extension, use_bin_type=True, strict_types=True)

    def encode(self, obj: Any) -> bytes:
        try:
            return self._packer.pack(obj)
        except (TypeError, ValueError, OverflowError) as exc:
            raise WireError(f"the data plane cannot carry this value: {exc}") from exc

    def _extension(self, obj: Any) -> msgpack.ExtType:
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(_TENSOR, self._reference(obj))
        if type(obj) is tuple:
            # strict_types: a tuple reaches here; its items are packed with the same hook
            return msgpack.ExtType(_TUPLE, msgpack.packb(list(obj), default=self._extension, use_bin_type=True,
                                                         strict_types=True))
        if isinstance(obj, torch.dtype) and obj in _DTYPE_CODE:
            return msgpack.ExtType(_DTYPE, bytes([_DTYPE_CODE[obj]]))
        raise TypeError(f"unsupported type {type(obj).__name__}")

    def _reference(self, tensor: torch.Tensor) -> bytes:
        if tensor.dtype not in _DTYPE_CODE or tensor.dim() > MAX_DIMS or tensor.device.type != "cpu":
            raise TypeError(f"unsupported tensor {tensor.dtype} of {tensor.dim()} dims on {tensor.device}")
        offset = self.data_bytes
        if tensor.numel():
            tensor = tensor.detach().contiguous()
            self.tensors.append(tensor)
            self.data_bytes += padded(tensor.numel() * tensor.element_size())
        head = _REF.pack(_DTYPE_CODE[tensor.dtype], tensor.dim(), offset)
        return head + b"".join(_DIM.pack(n) for n in tensor.shape)


def decode(control: memoryview, data: memoryview) -> Any:
    """The message whose control part and tensor bytes arrived; its tensors are views of ``data``."""
    try:
        return msgpack.unpackb(control, ext_hook=_Decoder(data), raw=False, strict_map_key=True, use_list=True)
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001  (msgpack raises several types on malformed input)
        raise WireError(f"malformed message: {type(exc).__name__}: {exc}") from exc


class _Decoder:
    def __init__(self, data: memoryview) -> None:
        self.data = data

    def __call__(self, code: int, payload: bytes) -> Any:
        if code == _TENSOR:
            return self._tensor(payload)
        if code == _TUPLE:
            return tuple(msgpack.unpackb(payload, ext_hook=self, raw=False, strict_map_key=True, use_list=True))
        if code == _DTYPE and len(payload) == 1 and payload[0] < len(DTYPES):
            return DTYPES[payload[0]]
        raise WireError(f"unknown extension type {code}")

    def _tensor(self, payload: bytes) -> torch.Tensor:
        if len(payload) < _REF.size:
            raise WireError("truncated tensor reference")
        code, ndim, offset = _REF.unpack_from(payload)
        if code >= len(DTYPES) or ndim > MAX_DIMS or len(payload) != _REF.size + ndim * _DIM.size:
            raise WireError("malformed tensor reference")
        shape = [_DIM.unpack_from(payload, _REF.size + i * _DIM.size)[0] for i in range(ndim)]
        dtype, limit = DTYPES[code], self.data.nbytes
        if any(n < 0 or n > limit for n in shape):
            raise WireError(f"tensor shape {shape} out of range")
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = count * dtype.itemsize
        if offset % ALIGN or offset + nbytes > limit:
            raise WireError(f"tensor of {nbytes} bytes at {offset} exceeds the message's {limit}")
        return torch.frombuffer(self.data, dtype=dtype, count=count, offset=offset).reshape(shape)
