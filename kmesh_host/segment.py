"""The KMesh segment file: one Arrow IPC file, one record batch of one row per stored object.

A segment is the KV state of one shared text segment, ``kv`` of shape ``(2, L, T, H, D)`` (K/V,
layers, tokens, KV heads, head size) in the model dtype, or uint8 / float8_e4m3fn holding fp8,
with the segment's token ids and original positions (keys are post-RoPE at those positions).

File layout (``kmesh-segment`` format version 2), readable with plain ``pyarrow.ipc.open_file``:

====================  ==================================  ========================================
column                type                                meaning
====================  ==================================  ========================================
format                string                              ``"kmesh-segment"``
version               uint16                              :data:`FORMAT_VERSION`
key                   string                              content-derived key (see :func:`derive_key`)
fingerprint           struct<architecture, num_layers,    the model that produced the KV
                      num_kv_heads, head_size, dtype,
                      rope (canonical JSON)>
dtype                 string                              torch dtype name of ``kv``
shape                 list<int64>                         ``(2, L, T, H, D)``
token_ids             list<int64>                         ``T`` token ids
positions             list<int64>                         ``T`` original positions
payload_length        int64                               bytes of ``kv`` (before padding)
chunk_size            int32                               the payload is padded to a multiple of it
sha256                fixed_size_binary(32)               SHA-256 of the padded payload
tree_root             fixed_size_binary(32)               kmesh-tree-sha256/v1 root of the padded payload
tree_leaf_size        int32                               its parameters
tree_fanout           int32
align_pad             binary                              zero bytes placing the payload at a
                                                          4096-aligned file offset
payload               large_binary (one value)            ``kv`` bytes, zero padded (last column)
====================  ==================================  ========================================

The schema metadata repeats ``kmesh.format`` and ``kmesh.version`` and records
``kmesh.payload_offset`` and ``kmesh.payload_bytes`` (16 decimal digits each): the payload's byte
offset in the file and its padded length. The payload's bytes are one contiguous range of the file
(the value buffer of the last column); because it starts on a 4096-byte boundary and its length is a
multiple of the chunk size, storage routes read it with O_DIRECT or cuFile straight into its
destination, and read the small metadata around it (head and footer) separately. A payload holds at
most :data:`MAX_PAYLOAD` bytes (2 GiB - 4 KiB).

Version 1 files are still read (never written): the same columns, the payload typed
``fixed_size_binary(padded length)`` and no ``kmesh.payload_bytes``. Arrow's IPC reader refuses that
type from 256 MiB on (the byte width in bits must fit an int32), so version 1 files hold less than
256 MiB; version 2 changed nothing else, and a segment's key is the same in both.

Every metadata field is bound by the key: the key is the SHA-256 of a canonical description of all
of them (digests included), so a reader that recomputes the key detects a changed field; the payload
is bound by its SHA-256 and tree root. Anything a file contains that does not check out raises
:class:`~kmesh_gpu.errors.IntegrityError` naming the segment, never other data than was written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import torch

from kmesh_gpu.errors import FingerprintMismatch, IntegrityError, LayoutError

from .integrity import DEFAULT_FANOUT, DEFAULT_LEAF_SIZE, _byte_view, check_tree_params, sha256, tree_digest

FORMAT_NAME = "kmesh-segment"
#: The version written; every version in :data:`READABLE_VERSIONS` is read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# What a key describes did not change in version 2 (only the payload column's Arrow type did), so
# the key's description keeps saying version 1: one segment, one key, in either file version.
_KEY_VERSION = 1
DEFAULT_CHUNK_SIZE = 4096
MIN_CHUNK_SIZE = 512
#: File alignment of the payload (O_DIRECT and GPUDirect Storage want 4 KiB).
PAYLOAD_ALIGNMENT = 4096
ARROW_MAGIC = b"ARROW1"
_OFFSET_DIGITS = 16
#: The format's limit on the padded payload, 2 GiB - 4 KiB (the most one Linux read(2) or write(2)
#: moves, MAX_RW_COUNT). Version 1 stated it but stopped short of 256 MiB; version 2 reaches it.
MAX_PAYLOAD = (1 << 31) - PAYLOAD_ALIGNMENT
#: The smallest file that can be a segment: a payload of at least one chunk at a nonzero aligned
#: offset, then at least the Arrow footer's length field and the closing magic.
MIN_FILE_SIZE = PAYLOAD_ALIGNMENT + MIN_CHUNK_SIZE + 4 + len(ARROW_MAGIC)

#: dtypes a segment may hold, by the name stored in the file.
SEGMENT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_FP8_NAMES = ("float8_e4m3fn", "uint8")


def dtype_name(dtype) -> str:
    """The stored name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``); strings pass through."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in SEGMENT_DTYPES:
        raise LayoutError(f"dtype: expected one of {sorted(SEGMENT_DTYPES)}, got {dtype!r}")
    return name


def _canonical(value) -> Any:
    """JSON-able, order-independent form of a RoPE description value."""
    if isinstance(value, Mapping):
        out: dict = {}
        for k, v in sorted(value.items(), key=lambda kv: str(kv[0])):
            if str(k) in out:  # e.g. 1 and "1": one value would be lost, which one by insertion order
                raise LayoutError(f"rope: two keys read {str(k)!r} once stored as strings")
            out[str(k)] = _canonical(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LayoutError(f"rope: values must be finite, got {value!r}")
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise LayoutError(f"rope: expected JSON scalars, lists or mappings, got {type(value).__name__} {value!r}")


def _freeze(value) -> Any:
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return ("__list__",) + tuple(_freeze(v) for v in value)
    return value


def _thaw(value) -> Any:
    if isinstance(value, tuple):
        if value and value[0] == "__list__":
            return [_thaw(v) for v in value[1:]]
        return {k: _thaw(v) for k, v in value}
    return value


@dataclass(frozen=True)
class ModelFingerprint:
    """Which model produced a segment's KV; restoring into another model is refused.

    Attributes:
        architecture: e.g. ``"Qwen2ForCausalLM"``.
        num_layers, num_kv_heads, head_size: the KV geometry ``L``, ``H``, ``D``.
        dtype: the KV dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float8_e4m3fn"``
            or ``"uint8"`` for fp8 held as bytes); a ``torch.dtype`` is accepted and stored by name.
        rope: a description of the RoPE spec (base, rotary_dim, style, scaling ...), given as a
            mapping; stored frozen, compared and digested in canonical (sorted-key JSON) form.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    rope: Any = ()

    def __post_init__(self):
        if not isinstance(self.architecture, str) or not self.architecture:
            raise LayoutError(f"architecture: expected a non-empty string, got {self.architecture!r}")
        try:
            self.architecture.encode("utf-8")  # stored as an Arrow (UTF-8) string
        except UnicodeEncodeError:
            raise LayoutError(f"architecture: not encodable as UTF-8: {self.architecture!r}") from None
        for name in ("num_layers", "num_kv_heads", "head_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise LayoutError(f"{name}: expected a positive integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        rope = self.rope
        if isinstance(rope, tuple):
            rope = _thaw(rope) if rope else {}
        if not isinstance(rope, Mapping):
            raise LayoutError(f"rope: expected a mapping describing the RoPE spec, got {type(rope).__name__}")
        try:
            object.__setattr__(self, "rope", _freeze(_canonical(rope)))
        except RecursionError:
            raise LayoutError("rope: nested too deeply") from None

    def rope_dict(self) -> dict:
        return _thaw(self.rope) if self.rope else {}

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_size": self.head_size, "dtype": self.dtype,
                "rope": self.rope_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelFingerprint":
        if not isinstance(d, Mapping):
            raise LayoutError(f"model_fingerprint: expected a mapping, got {type(d).__name__}")
        try:
            rope = d.get("rope")
            return cls(d["architecture"], d["num_layers"], d["num_kv_heads"], d["head_size"], d["dtype"],
                       {} if rope is None else rope)
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"model_fingerprint: malformed description {dict(d)!r}: {exc}") from exc

    def rope_json(self) -> str:
        return json.dumps(self.rope_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def digest(self) -> str:
        """Stable hex SHA-256 of the canonical description (same on every machine and run)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def differences(self, other: "ModelFingerprint") -> list[str]:
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass
class SegmentHeader:
    """Everything a segment file says except the payload bytes, plus where the payload lies.

    ``payload_offset`` is the payload's byte offset in the file, ``padded_length`` its stored length
    (a multiple of ``chunk_size``); the KV bytes are its first ``payload_length`` bytes.
    """

    key: str
    fingerprint: ModelFingerprint
    dtype: str
    shape: tuple[int, ...]
    token_ids: np.ndarray
    positions: np.ndarray
    payload_length: int
    padded_length: int
    chunk_size: int
    sha256: bytes
    tree_root: bytes
    tree_leaf_size: int
    tree_fanout: int
    payload_offset: int
    file_size: int
    version: int = FORMAT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return SEGMENT_DTYPES[self.dtype]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @functools.cached_property
    def positions_int64(self) -> torch.Tensor:
        """``positions`` as an int64 CPU tensor, made once per header (it shares their memory where
        they already are writeable int64). For readers such as the placement: never write to it."""
        p = self.positions
        return torch.from_numpy(p if p.dtype == np.int64 and p.flags.writeable else p.astype(np.int64))

    @functools.cached_property
    def dense_kv(self) -> bool:
        """The payload's first ``payload_length`` bytes are exactly the KV tensor's (its shape times
        its dtype's size): a view of them needs no other check."""
        return self.payload_length == math.prod(self.shape) * self.torch_dtype.itemsize

    def kv_view(self, payload: torch.Tensor) -> torch.Tensor:
        """``kv`` as a view of a uint8 tensor holding the (padded) payload, on any device."""
        return payload[: self.payload_length].view(self.torch_dtype).view(self.shape)


@dataclass
class Segment:
    """A restored segment. ``kv``: ``(2, L, T, H, D)``; ``token_ids``, ``positions``: ``int64[T]``."""

    kv: torch.Tensor
    token_ids: torch.Tensor
    positions: torch.Tensor
    key: str
    fingerprint: ModelFingerprint


# ----------------------------------------------------------------------------------- schema
def _fingerprint_type() -> pa.DataType:
    return pa.struct([("architecture", pa.string()), ("num_layers", pa.int32()), ("num_kv_heads", pa.int32()),
                      ("head_size", pa.int32()), ("dtype", pa.string()), ("rope", pa.string())])


def segment_schema(padded_length: int, payload_offset: int = 0, *, version: int | None = None) -> pa.Schema:
    """The Arrow schema of a segment file whose payload is ``padded_length`` bytes at file offset
    ``payload_offset``, in format ``version`` (default :data:`FORMAT_VERSION`; 1 for the old layout)."""
    version = FORMAT_VERSION if version is None else version
    payload_type = pa.binary(padded_length) if version == 1 else pa.large_binary()
    fields = [
        ("format", pa.string()), ("version", pa.uint16()), ("key", pa.string()),
        ("fingerprint", _fingerprint_type()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
        ("token_ids", pa.list_(pa.int64())), ("positions", pa.list_(pa.int64())),
        ("payload_length", pa.int64()), ("chunk_size", pa.int32()),
        ("sha256", pa.binary(32)), ("tree_root", pa.binary(32)),
        ("tree_leaf_size", pa.int32()), ("tree_fanout", pa.int32()),
        ("align_pad", pa.binary()), ("payload", payload_type),
    ]
    meta = {b"kmesh.format": FORMAT_NAME.encode(), b"kmesh.version": str(version).encode(),
            b"kmesh.payload_offset": f"{payload_offset:0{_OFFSET_DIGITS}d}".encode()}
    if version != 1:
        meta[b"kmesh.payload_bytes"] = f"{padded_length:0{_OFFSET_DIGITS}d}".encode()
    return pa.schema(fields, metadata=meta)


def payload_array(payload, version: int | None = None) -> pa.Array:
    """The one-value payload column over ``payload``'s bytes (a bytes-like object; not copied)."""
    buf = pa.py_buffer(payload)
    if (FORMAT_VERSION if version is None else version) == 1:
        return pa.FixedSizeBinaryArray.from_buffers(pa.binary(buf.size), 1, [None, buf])
    offsets = pa.py_buffer(np.array([0, buf.size], dtype="<i8"))
    return pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, buf])


def derive_key(fingerprint: ModelFingerprint, dtype: str, shape, token_ids: np.ndarray, positions: np.ndarray,
               payload_length: int, chunk_size: int, sha: bytes, root: bytes, leaf_size: int, fanout: int) -> str:
    """The content-derived segment key: hex SHA-256 over every metadata field and the payload digests."""
    desc = {
        "format": FORMAT_NAME, "version": _KEY_VERSION, "fingerprint": fingerprint.to_dict(), "dtype": dtype,
        "shape": [int(s) for s in shape],
        "token_ids": hashlib.sha256(np.ascontiguousarray(token_ids, dtype="<i8").tobytes()).hexdigest(),
        "positions": hashlib.sha256(np.ascontiguousarray(positions, dtype="<i8").tobytes()).hexdigest(),
        "num_tokens": int(len(token_ids)), "payload_length": int(payload_length), "chunk_size": int(chunk_size),
        "sha256": sha.hex(), "tree_root": root.hex(), "tree_leaf_size": int(leaf_size), "tree_fanout": int(fanout),
    }
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def is_key(key) -> bool:
    return isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)


# ----------------------------------------------------------------------------------- encode
def _as_int64_vector(name: str, value, n: int) -> np.ndarray:
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))  # same values, native byte order
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise LayoutError(f"{name}: expected int64[T={n}], got {type(value).__name__} ({exc})") from None
    if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1 or t.numel() != n:
        raise LayoutError(f"{name}: expected int64[T={n}], got {str(t.dtype).removeprefix('torch.')}"
                          f"{list(t.shape)}")
    return t.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=True)


def _check_kv(kv, fingerprint: ModelFingerprint) -> torch.Tensor:
    if not isinstance(kv, torch.Tensor):
        raise LayoutError(f"kv: expected a torch.Tensor of shape (2, L, T, H, D), got {type(kv).__name__}")
    name = dtype_name(kv.dtype) if str(kv.dtype).removeprefix("torch.") in SEGMENT_DTYPES else None
    if name is None:
        raise LayoutError(f"kv: dtype {kv.dtype} is not one of {sorted(SEGMENT_DTYPES)}")
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise LayoutError(f"kv: expected shape (2, L, T, H, D), got {tuple(kv.shape)}")
    _, L, T, H, D = kv.shape
    want = (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_size)
    if (L, H, D) != want or T == 0:
        raise LayoutError(f"kv: shape {tuple(kv.shape)} does not match the model fingerprint "
                          f"(L, H, D) = {want} (or has no tokens)")
    fp8_ok = fingerprint.dtype in _FP8_NAMES and name in _FP8_NAMES
    if name != fingerprint.dtype and not fp8_ok:
        raise LayoutError(f"kv: dtype {name} does not match the model fingerprint's {fingerprint.dtype}")
    return kv


def payload_bytes(kv: torch.Tensor, chunk_size: int) -> tuple[np.ndarray, int]:
    """``(padded uint8 array, unpadded length)`` of ``kv``'s bytes in C order, on the host.

    A contiguous CPU ``kv`` whose length is already a multiple of ``chunk_size`` is viewed, not
    copied (read it only); anything else is copied once into a zero-padded array.
    """
    src = kv.detach()
    length = src.numel() * src.element_size()
    padded = -(-length // chunk_size) * chunk_size
    if src.device.type == "cpu" and src.is_contiguous() and length == padded:
        return src.view(torch.uint8).reshape(-1).numpy(), length
    out = np.zeros(padded, dtype=np.uint8)
    torch.from_numpy(out[:length]).view(src.dtype).view(src.shape).copy_(src)
    return out, length


def encode_segment(kv: torch.Tensor, token_ids, positions, *, model_fingerprint: ModelFingerprint,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, leaf_size: int = DEFAULT_LEAF_SIZE,
                   fanout: int = DEFAULT_FANOUT) -> tuple[str, pa.Buffer]:
    """Encode one segment; returns ``(key, file bytes)``.

    Args:
        kv: ``(2, L, T, H, D)`` tensor (any device) in the fingerprint's dtype, at most
            :data:`MAX_PAYLOAD` bytes once padded (LayoutError before anything is copied).
        token_ids, positions: ``int64[T]`` (int32 accepted).
        model_fingerprint: the model that produced ``kv``; its L, H, D and dtype are checked.
        chunk_size: the payload is zero padded to a multiple of it (a power of two >= 512).
    """
    if not isinstance(model_fingerprint, ModelFingerprint):
        raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < MIN_CHUNK_SIZE
            or chunk_size & (chunk_size - 1) or chunk_size > PAYLOAD_ALIGNMENT * 256):
        raise LayoutError(f"chunk_size: expected a power of two in [512, 1 MiB], got {chunk_size}")
    kv = _check_kv(kv, model_fingerprint)
    padded = -(-kv.numel() * kv.element_size() // chunk_size) * chunk_size
    if padded > MAX_PAYLOAD:
        raise LayoutError(f"kv: {tuple(kv.shape)} {dtype_name(kv.dtype)} pads to {padded} bytes, over the "
                          f"segment format's limit of {MAX_PAYLOAD} (2 GiB - 4 KiB); split it into segments")
    T = kv.shape[2]
    tok = _as_int64_vector("token_ids", token_ids, T)
    pos = _as_int64_vector("positions", positions, T)
    payload, length = payload_bytes(kv, chunk_size)
    sha = sha256(payload)
    root = tree_digest(payload, leaf_size=leaf_size, fanout=fanout)
    name = dtype_name(kv.dtype)
    shape = tuple(int(s) for s in kv.shape)
    key = derive_key(model_fingerprint, name, shape, tok, pos, length, chunk_size, sha, root, leaf_size, fanout)
    fp = model_fingerprint
    columns = {
        "format": [FORMAT_NAME], "version": [FORMAT_VERSION], "key": [key],
        "fingerprint": [{"architecture": fp.architecture, "num_layers": fp.num_layers,
                         "num_kv_heads": fp.num_kv_heads, "head_size": fp.head_size, "dtype": fp.dtype,
                         "rope": fp.rope_json()}],
        "dtype": [name], "shape": [list(shape)], "token_ids": [tok], "positions": [pos],
        "payload_length": [length], "chunk_size": [chunk_size], "sha256": [sha], "tree_root": [root],
        "tree_leaf_size": [leaf_size], "tree_fanout": [fanout],
    }
    return key, _aligned_file(columns, payload, key)


def _aligned_file(columns: dict, payload: np.ndarray, key: str) -> pa.Buffer:
    """The Arrow file of one segment with its payload at a PAYLOAD_ALIGNMENT-aligned offset.

    The payload offset shifts by exactly the change in align_pad, and the offset metadata has a
    fixed width; a few rounds settle it. They run on a one-chunk stand-in: the payload is the last
    buffer of the body and its length is written in fixed-width fields only, so it moves nothing
    before it. The real payload is then written once (and checked where it landed, like every round).
    """
    padded = payload.nbytes
    real = payload_array(payload)
    body = payload_array(np.zeros(min(padded, MIN_CHUNK_SIZE), dtype=np.uint8))
    pad, offset = 0, 0
    for _ in range(8):
        schema = segment_schema(padded, offset)
        arrays = [pa.array(columns[f.name], type=f.type) for f in schema if f.name not in ("align_pad", "payload")]
        arrays += [pa.array([bytes(pad)], type=pa.binary()), body]
        batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema) as writer:
            writer.write_batch(batch)
        data = sink.getvalue()
        actual = _payload_offset_in(data)
        if actual == offset and actual % PAYLOAD_ALIGNMENT == 0:
            if body is real:
                return data
            body = real
            continue
        if actual % PAYLOAD_ALIGNMENT:
            pad += (-actual) % PAYLOAD_ALIGNMENT
        offset = actual + (-actual) % PAYLOAD_ALIGNMENT
    raise IntegrityError(f"segment {key}: could not align the payload in the Arrow file (pyarrow {pa.__version__})")


def _payload_offset_in(data: pa.Buffer) -> int:
    reader = pa.ipc.open_file(pa.BufferReader(data))
    column = reader.get_batch(0).column(reader.schema.get_field_index("payload"))
    return column.buffers()[-1].address - data.address  # the value bytes: last buffer in either version


# ----------------------------------------------------------------------------------- decode
def _fail(name: str, why: str, exc: BaseException | None = None) -> IntegrityError:
    err = IntegrityError(f"segment {name}: {why}")
    if exc is not None:
        err.__cause__ = exc
    return err


def _digits(meta: Mapping, name: bytes) -> int | None:
    """The fixed-width decimal metadata value ``name`` (None when missing or malformed)."""
    text = meta.get(name, b"")
    return int(text) if len(text) == _OFFSET_DIGITS and text.isdigit() else None


def _version_of(meta: Mapping, name: str) -> int:
    """The format version a segment schema's metadata states; IntegrityError unless readable here."""
    version = meta.get(b"kmesh.version", b"?")
    readable = {str(v).encode(): v for v in READABLE_VERSIONS}
    if version not in readable:
        raise _fail(name, f"segment format version {version.decode(errors='replace')!r}; this reader "
                          f"understands versions {', '.join(map(str, READABLE_VERSIONS))}")
    return readable[version]


def read_schema_head(head, name: str, file_size: int) -> tuple[int, int]:
    """``(payload_offset, padded_length)`` from the first bytes of a segment file.

    ``head`` holds at least the file's first few KiB (the Arrow magic and the schema message).
    Raises IntegrityError for anything that is not a KMesh segment file of a readable version.
    """
    view = memoryview(head)
    if file_size == 0:
        raise _fail(name, "file is empty")
    if file_size < 16 or bytes(view[:6]) != ARROW_MAGIC:
        raise _fail(name, "not an Arrow IPC file (bad magic or truncated)")
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(bytes(view[8:])))
    except (pa.ArrowException, OSError, ValueError, IndexError) as exc:
        raise _fail(name, f"unreadable Arrow schema ({exc})", exc) from exc
    meta = schema.metadata or {}
    if meta.get(b"kmesh.format") != FORMAT_NAME.encode():
        raise _fail(name, "not a KMesh segment file (a foreign Arrow file: no kmesh.format metadata)")
    version = _version_of(meta, name)
    offset = _digits(meta, b"kmesh.payload_offset")
    if offset is None:
        raise _fail(name, "malformed kmesh.payload_offset metadata")
    idx = schema.get_field_index("payload")
    ptype = schema.field(idx).type if idx >= 0 else None
    if idx < 0 or idx != len(schema) - 1:
        raise _fail(name, "schema has no trailing payload column")
    if version == 1:
        if not pa.types.is_fixed_size_binary(ptype):
            raise _fail(name, "version 1 schema has no trailing fixed-size binary payload column")
        padded = ptype.byte_width
    else:
        if not pa.types.is_large_binary(ptype):
            raise _fail(name, f"version {version} schema has no trailing large_binary payload column")
        padded = _digits(meta, b"kmesh.payload_bytes")
        if padded is None:
            raise _fail(name, "malformed kmesh.payload_bytes metadata")
    if not 0 < padded <= MAX_PAYLOAD:
        raise _fail(name, f"a payload of {padded} bytes; the format holds 1 to {MAX_PAYLOAD}")
    if offset <= 0 or offset + padded > file_size:
        raise _fail(name, f"payload [{offset}, {offset + padded}) lies outside the {file_size}-byte file "
                          "(truncated?)")
    return offset, padded


def _tree_params_ok(leaf_size, fanout) -> bool:
    try:
        check_tree_params(leaf_size, fanout)
    except IntegrityError:
        return False
    return True


def _fb_field(buf: memoryview, table: int, index: int) -> int:
    """Absolute position of field ``index`` of the flatbuffer table at ``table`` (0 if absent)."""
    vtable = table - int.from_bytes(buf[table: table + 4], "little", signed=True)
    vt_size = int.from_bytes(buf[vtable: vtable + 2], "little")
    if 4 + 2 * index + 2 > vt_size:
        return 0
    rel = int.from_bytes(buf[vtable + 4 + 2 * index: vtable + 6 + 2 * index], "little")
    return table + rel if rel else 0


def _fb_deref(buf: memoryview, pos: int) -> int:
    return pos + int.from_bytes(buf[pos: pos + 4], "little")


def _batch_is_compressed(file_image: pa.Buffer, name: str) -> bool:
    """Whether the file's record batch (the footer's first block) declares body compression.

    Called after ``pa.ipc.open_file`` accepted the footer (Arrow verified its flatbuffer)."""
    try:
        data = memoryview(file_image).cast("B")
        size = len(data)
        footer_len = int.from_bytes(data[size - 10: size - 6], "little", signed=True)
        footer = data[size - 10 - footer_len: size - 10]
        root = _fb_deref(footer, 0)
        batches = _fb_field(footer, root, 3)                    # Footer.recordBatches: [Block]
        vec = _fb_deref(footer, batches)
        block_offset = int.from_bytes(footer[vec + 4: vec + 12], "little", signed=True)  # Block.offset
        message = pa.ipc.read_message(pa.BufferReader(file_image.slice(block_offset)))
        meta = memoryview(message.metadata).cast("B")
        header = _fb_field(meta, _fb_deref(meta, 0), 2)        # Message.header: RecordBatch
        return _fb_field(meta, _fb_deref(meta, header), 3) != 0  # RecordBatch.compression
    except (pa.ArrowException, OSError, EOFError, ValueError, IndexError, TypeError) as exc:
        raise _fail(name, f"corrupt Arrow footer or message ({type(exc).__name__}: {exc})", exc) from exc


def decode_header(file_image: pa.Buffer, name: str, *, payload_offset: int, padded_length: int) -> SegmentHeader:
    """Parse and check a segment file's metadata.

    ``file_image``: a buffer of the whole file's size whose bytes outside
    ``[payload_offset, payload_offset + padded_length)`` are the file's (the payload region may be
    anything: the routes leave it unread). Checks the schema, every field's consistency, the
    recomputed key and the payload's position; not the payload digests.
    """
    size = file_image.size
    try:
        reader = pa.ipc.open_file(pa.BufferReader(file_image))
        if reader.num_record_batches != 1:
            raise _fail(name, f"expected one record batch, found {reader.num_record_batches}")
        if _batch_is_compressed(file_image, name):
            # Decompression would allocate whatever sizes the file declares (a few KiB can ask for GiBs)
            raise _fail(name, "compressed Arrow body (KMesh segments are never compressed)")
        batch = reader.get_batch(0)
        version = _version_of(reader.schema.metadata or {}, name)
        expected = segment_schema(padded_length, payload_offset, version=version)
        if not batch.schema.equals(expected, check_metadata=False) or \
                not reader.schema.equals(expected, check_metadata=True):
            raise _fail(name, "schema does not match the kmesh-segment schema")
        if batch.num_rows != 1:
            raise _fail(name, f"expected one row, found {batch.num_rows}")
        batch.validate(full=True)
        payload_col = batch.column(len(expected) - 1)
        if payload_col.null_count:
            raise _fail(name, "null payload")
        if version == 1:
            values = payload_col.buffers()[1].address + payload_col.offset * padded_length
        else:
            # one value of padded_length bytes: its value buffer, whole, is the payload
            start = payload_col.offset
            bounds = np.frombuffer(payload_col.buffers()[1], dtype="<i8")[start: start + 2].tolist()
            data = payload_col.buffers()[2]
            if bounds != [0, padded_length] or data.size != padded_length:
                raise _fail(name, f"payload column holds {bounds} of {data.size} bytes, metadata says "
                                  f"{padded_length}")
            values = data.address
        actual_offset = values - file_image.address
        row = {f.name: batch.column(i)[0].as_py() for i, f in enumerate(expected)
               if f.name not in ("payload", "align_pad")}
    except IntegrityError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, OverflowError) as exc:
        raise _fail(name, f"corrupt Arrow metadata ({type(exc).__name__}: {exc})", exc) from exc
    if actual_offset != payload_offset:
        raise _fail(name, f"payload at file offset {actual_offset}, metadata says {payload_offset}")
    nulls = [k for k, v in row.items() if v is None or (isinstance(v, dict) and None in v.values())
             or (isinstance(v, list) and None in v)]
    if nulls:
        raise _fail(name, f"null values in fields {nulls}")
    try:
        fp_row = dict(row["fingerprint"])
        fp_row["rope"] = json.loads(fp_row["rope"])
        fingerprint = ModelFingerprint.from_dict(fp_row)
        dtype = dtype_name(row["dtype"])
    except (LayoutError, TypeError, ValueError, KeyError, RecursionError) as exc:
        raise _fail(name, f"malformed fingerprint or dtype ({type(exc).__name__}: {str(exc)[:200]})", exc) from exc
    shape = tuple(row["shape"] or ())
    tok = np.asarray(row["token_ids"] or [], dtype="<i8")
    pos = np.asarray(row["positions"] or [], dtype="<i8")
    length, chunk = row["payload_length"], row["chunk_size"]
    checks = [
        (row["format"] == FORMAT_NAME and row["version"] == version, "format/version fields"),
        (len(shape) == 5 and shape[0] == 2 and all(s > 0 for s in shape), f"shape {shape}"),
        (len(shape) == 5 and shape[1:2] + shape[3:] == (fingerprint.num_layers, fingerprint.num_kv_heads,
                                                        fingerprint.head_size), "shape vs fingerprint"),
        (len(shape) == 5 and len(tok) == shape[2] == len(pos), "token_ids/positions length vs shape"),
        (isinstance(chunk, int) and chunk >= MIN_CHUNK_SIZE and chunk & (chunk - 1) == 0, f"chunk_size {chunk}"),
        (len(shape) == 5 and length == math.prod(shape) * SEGMENT_DTYPES[dtype].itemsize, "payload_length"),
        (isinstance(chunk, int) and chunk > 0 and padded_length == -(-length // chunk) * chunk, "padded length"),
        (_tree_params_ok(row["tree_leaf_size"], row["tree_fanout"]), "tree parameters"),
    ]
    for ok, what in checks:
        if not ok:
            raise _fail(name, f"inconsistent metadata: {what}")
    key = derive_key(fingerprint, dtype, shape, tok, pos, length, chunk, row["sha256"], row["tree_root"],
                     row["tree_leaf_size"], row["tree_fanout"])
    if key != row["key"]:
        raise _fail(name, "metadata does not match its key (a field was altered)")
    return SegmentHeader(key=key, fingerprint=fingerprint, dtype=dtype, shape=shape, token_ids=tok, positions=pos,
                         payload_length=length, padded_length=padded_length, chunk_size=chunk,
                         sha256=row["sha256"], tree_root=row["tree_root"], tree_leaf_size=row["tree_leaf_size"],
                         tree_fanout=row["tree_fanout"], payload_offset=payload_offset, file_size=size,
                         version=version)


def check_fingerprint(header: SegmentHeader, model_fingerprint: ModelFingerprint) -> None:
    # the fingerprint object this header last passed with (fingerprints are immutable): a
    # restore's resident objects are checked on every call, by the same caller's object
    passed = header.__dict__.get("_fingerprint_passed")
    if passed is not None and passed is model_fingerprint:  # never None: a header no fingerprint passed
        return
    if not isinstance(model_fingerprint, ModelFingerprint):
        raise LayoutError(f"model_fingerprint: expected a ModelFingerprint, got {type(model_fingerprint).__name__}")
    if header.fingerprint != model_fingerprint:
        diff = "; ".join(header.fingerprint.differences(model_fingerprint)) or "digest differs"
        raise FingerprintMismatch(f"segment {header.key}: saved by a different model ({diff})")
    header.__dict__["_fingerprint_passed"] = model_fingerprint


def check_payload(header: SegmentHeader, payload, *, sha: bool = True, tree: bool = False) -> None:
    """Check the padded payload bytes on the host against the header's digests."""
    view = _byte_view(payload)  # bytes-like, numpy or CPU tensor; LayoutError for anything else
    if view.nbytes != header.padded_length:
        raise _fail(header.key, f"payload is {view.nbytes} bytes, expected {header.padded_length}")
    if sha and sha256(view) != header.sha256:
        raise _fail(header.key, "payload SHA-256 mismatch (corrupt data)")
    if tree and tree_digest(view, leaf_size=header.tree_leaf_size, fanout=header.tree_fanout) != header.tree_root:
        raise _fail(header.key, "payload kmesh-tree-sha256 root mismatch (corrupt data)")


def segment_from_payload(header: SegmentHeader, payload: torch.Tensor) -> Segment:
    """A :class:`Segment` whose ``kv`` views ``payload`` (uint8, padded; the caller gives it up)."""
    return Segment(kv=header.kv_view(payload), token_ids=torch.from_numpy(header.token_ids.astype(np.int64)),
                   positions=torch.from_numpy(header.positions.astype(np.int64)), key=header.key,
                   fingerprint=header.fingerprint)


__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "DEFAULT_CHUNK_SIZE", "MIN_CHUNK_SIZE",
    "PAYLOAD_ALIGNMENT", "MAX_PAYLOAD", "MIN_FILE_SIZE", "ModelFingerprint", "Segment", "SegmentHeader",
    "segment_schema", "payload_array", "encode_segment", "decode_header", "read_schema_head", "derive_key",
    "check_fingerprint", "check_payload", "segment_from_payload", "dtype_name", "is_key",
]
