"""How a lock-step call travels from a group's leader to its followers (jfire.lockstep): a JSON
header describing the call's structure, then the raw bytes of its arrays. No pickle: a
follower builds only what the header describes (numbers, strings, None, tuples, lists,
dicts, numpy arrays of plain dtypes and the programs' own input tuples, by name from a fixed
list), so a payload can carry data and nothing else. Its authenticity is the store's
signature (jfire.disagg.signed_store), checked before a byte of it is parsed.

    payload = zlib(  len(header) as 8 bytes, little-endian | header JSON | array bytes  )
    header  = {"seq": n, "kind": "decode", "key": node, "inputs": node, "arrays": [[dtype, shape, offset], ...]}

A node is a JSON value: null, true/false, a number or a string stands for itself; anything
else is an object with one tag: {"T": [nodes]} a tuple, {"L": [nodes]} a list, {"D": [[key
node, node], ...]} a dict (keys str or int), {"A": i} array i, {"S": i} a numpy scalar (array i,
0-d), {"N": name, "F": [nodes]} one of `NAMED`.
"""

from __future__ import annotations

import json
import math
import zlib

import numpy as np

from jfire.errors import JfireError
from jfire.program_inputs import Extras
from jfire.sampling import RowSampling
from jfire.speculative.model_drafts import DraftIn

# The programs' input tuples a call may carry, by name: the only types a follower builds.
NAMED = {cls.__name__: cls for cls in (RowSampling, Extras, DraftIn)}
DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32"]
    + ["float64", "bfloat16"]
)
MAX_DEPTH = 32  # the calls nest a few levels; a deeper payload is malformed
HEADER_LEN_BYTES = 8


def encode(seq: int, kind: str, key, inputs) -> bytes:
    """The payload of call number seq. Raises JfireError naming the first part of key or
    inputs that cannot travel (on the leader, before anything is sent)."""
    arrays: list[np.ndarray] = []
    header = {
        "seq": seq,
        "kind": kind,
        "key": _node(key, arrays, "key", 0),
        "inputs": _node(inputs, arrays, "inputs", 0),
    }
    index, offset = [], 0
    for a in arrays:
        index.append([a.dtype.name, list(a.shape), offset])
        offset += a.nbytes
    header["arrays"] = index
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(a.tobytes() for a in arrays)
    return zlib.compress(len(head).to_bytes(HEADER_LEN_BYTES, "little") + head + body, 1)


def _node(x, arrays: list, where: str, depth: int):
    if depth > MAX_DEPTH:
        raise JfireError(f"a lock-step call nests deeper than {MAX_DEPTH} levels at {where}")
    if x is None or isinstance(x, (bool, str)):
        return x
    if type(x) is int or type(x) is float:  # not a subclass: an IntEnum would come back as an int
        return x
    if isinstance(x, np.generic) and not isinstance(x, np.object_):
        arrays.append(_plain(np.asarray(x), where))
        return {"S": len(arrays) - 1}
    if type(x) is np.ndarray:
        arrays.append(_plain(x, where))
        return {"A": len(arrays) - 1}
    if type(x) in NAMED.values():
        fields = [_node(v, arrays, f"{where}.{f}", depth + 1) for f, v in zip(x._fields, x)]
        return {"N": type(x).__name__, "F": fields}
    if type(x) is tuple or type(x) is list:
        items = [_node(v, arrays, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
        return {"T" if type(x) is tuple else "L": items}
    if type(x) is dict:
        pairs = []
        for k, v in x.items():
            if type(k) not in (str, int):
                raise JfireError(f"a lock-step call's dict at {where} has a {type(k).__name__} key: only str and int")
            pairs.append([k, _node(v, arrays, f"{where}[{k!r}]", depth + 1)])
        return {"D": pairs}
    raise JfireError(
        f"a lock-step call carries a {type(x).__module__}.{type(x).__qualname__} at {where}: only None, bool, "
        f"int, float, str, tuples, lists, dicts, numpy arrays and {', '.join(NAMED)} travel to a group's followers"
    )


def _plain(a: np.ndarray, where: str) -> np.ndarray:
    if a.dtype.name not in DTYPES:
        raise JfireError(f"a lock-step call carries an array of dtype {a.dtype} at {where}: not a plain number type")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (which makes a 0-d array 1-d)


def decode(payload: bytes, key_name: str) -> tuple[int, str, object, object]:
    """(seq, kind, key, inputs) of an authentic payload; JfireError naming key_name (the store
    key it came from) if it is malformed."""
    try:
        raw = zlib.decompress(payload)
        size = int.from_bytes(raw[:HEADER_LEN_BYTES], "little")
        header = json.loads(raw[HEADER_LEN_BYTES : HEADER_LEN_BYTES + size])
        body = bytearray(raw[HEADER_LEN_BYTES + size :])  # writable, as the arrays a leader built are
        arrays = [_array(body, entry) for entry in header["arrays"]]
        seq, kind = header["seq"], header["kind"]
        if type(seq) is not int or type(kind) is not str:
            raise ValueError("seq and kind")
        return seq, kind, _build(header["key"], arrays, 0), _build(header["inputs"], arrays, 0)
    except (zlib.error, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise JfireError(f"the lock-step call under {key_name!r} is malformed ({type(e).__name__}: {e})") from None


def _array(body: bytearray, entry) -> np.ndarray:
    dtype_name, shape, offset = entry
    if dtype_name not in DTYPES or not all(type(n) is int and n >= 0 for n in shape) or type(offset) is not int:
        raise ValueError(f"array entry {entry!r}")
    dtype = _dtype(dtype_name)
    count = math.prod(shape)
    if offset < 0 or offset + count * dtype.itemsize > len(body):
        raise ValueError(f"array entry {entry!r} runs past the payload")
    return np.frombuffer(body, dtype, count, offset).reshape(shape)


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def _build(node, arrays: list[np.ndarray], depth: int):
    if depth > MAX_DEPTH:
        raise ValueError(f"nests deeper than {MAX_DEPTH} levels")
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is not dict or len(node) != (2 if "N" in node else 1):
        raise ValueError(f"unknown node {str(node)[:80]}")
    tag, value = next(iter(node.items())) if "N" not in node else ("N", node["N"])
    if tag == "A":
        return arrays[_index(value)]
    if tag == "S":
        return arrays[_index(value)][()]
    if tag in ("T", "L"):
        items = [_build(v, arrays, depth + 1) for v in _list(value)]
        return tuple(items) if tag == "T" else items
    if tag == "D":
        out = {}
        for pair in _list(value):
            k, v = _list(pair)
            if type(k) not in (str, int):
                raise ValueError(f"dict key {k!r}")
            out[k] = _build(v, arrays, depth + 1)
        return out
    if tag == "N":
        cls = NAMED.get(value) if type(value) is str else None
        fields = _list(node["F"])
        if cls is None or len(fields) != len(cls._fields):
            raise ValueError(f"named tuple {str(value)[:80]}")
        return cls(*(_build(v, arrays, depth + 1) for v in fields))
    raise ValueError(f"unknown tag {tag!r}")


def _index(value) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"array index {value!r}")
    return value


def _list(value) -> list:
    if type(value) is not list:
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value
