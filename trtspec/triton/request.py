"""One request to a trtspec text endpoint, encoded as triton/backend/contract.py declares it.

Every client of the deployment (`trtspec verify --url`: triton/client.py; the OpenAI front:
openai/triton.py) builds its request here: the Triton type and dims of each input come from
the contract's table, so a client never sends a value under a type the server does not
declare, and an INT32 out of range is refused here rather than wrapped by numpy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trtspec.errors import RequestError
from trtspec.triton.backend.contract import BLS_INPUTS, Tensor

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INPUTS: dict[str, Tensor] = {t.name: t for t in BLS_INPUTS}

# contract data type -> (numpy dtype, Triton's wire name)
_TYPES: dict[str, tuple[type, str]] = {
    "TYPE_STRING": (np.object_, "BYTES"),
    "TYPE_BOOL": (np.bool_, "BOOL"),
    "TYPE_UINT8": (np.uint8, "UINT8"),
    "TYPE_INT32": (np.int32, "INT32"),
    "TYPE_INT64": (np.int64, "INT64"),
    "TYPE_UINT64": (np.uint64, "UINT64"),
    "TYPE_FP16": (np.float16, "FP16"),
    "TYPE_FP32": (np.float32, "FP32"),
}


def wire_type(name: str) -> str:
    """Triton's name (BYTES, INT32, ...) for the type the contract gives input ``name``."""
    return _TYPES[_tensor(name).data_type][1]


def encode(values: Mapping[str, object]) -> dict[str, np.ndarray]:
    """One prompt's inputs (batch 1) as arrays: a value -> [1, 1], a list for an input of dims
    [-1] (stop_words, ...) -> [1, n]; text as UTF-8 bytes. RequestError for a name the
    contract lacks or an INT32 value beyond int32."""
    return {name: _array(name, value) for name, value in values.items()}


def infer_inputs(values: Mapping[str, object]) -> list:
    """``encode(values)`` as tritonclient InferInputs (the gRPC client's and the asyncio one's)."""
    import tritonclient.grpc as grpcclient

    out = []
    for name, arr in encode(values).items():
        tensor = grpcclient.InferInput(name, list(arr.shape), wire_type(name))
        tensor.set_data_from_numpy(arr)
        out.append(tensor)
    return out


def _tensor(name: str) -> Tensor:
    t = INPUTS.get(name)
    if t is None:
        raise RequestError(f"{name} is not an input of the tensorrt_llm_bls contract (triton/backend/contract.py)")
    return t


def _array(name: str, value) -> np.ndarray:
    t = _tensor(name)
    dtype = _TYPES[t.data_type][0]
    row = list(value) if isinstance(value, (list, tuple)) else [value]
    if dtype is np.object_:
        row = [v.encode() if isinstance(v, str) else v for v in row]
    if dtype is np.int32:
        for v in row:
            if not INT32_MIN <= int(v) <= INT32_MAX:  # numpy would wrap it to another number
                raise RequestError(f"{name} must be at most {INT32_MAX} (got {v})")
    return np.array([row], dtype=dtype)
