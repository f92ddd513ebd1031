"""Helpers: build Arrow files that look like KMesh segments, with chosen lies, or in an old format.

craft(...) mirrors kmesh_host.segment.encode_segment but lets any column / the tree parameters /
the IPC write options be overridden, and realigns the payload the same way, so that every
structural check (schema, payload offset) passes and only the chosen lie remains. ``version=1``
writes the version 1 layout (payload ``fixed_size_binary(padded length)``), which the store no
longer writes but still reads: ``craft(kv, tok, pos, fp, version=1)`` is a file as put() made it
before version 2.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from kmesh_host import ModelFingerprint
from kmesh_host.integrity import sha256, tree_digest
from kmesh_host.segment import (FORMAT_NAME, FORMAT_VERSION, PAYLOAD_ALIGNMENT, derive_key, dtype_name,
                                payload_array, payload_bytes, segment_schema)

ROPE = {"base": 10000.0, "rotary_dim": 8, "is_neox_style": True}


def fp16():
    return ModelFingerprint("LlamaForCausalLM", 2, 2, 8, "float16", ROPE)


def kv_tok_pos(T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, T, 2, 8), generator=g).to(torch.float16), torch.arange(T) * 3, torch.arange(T) + 11


def _offset_in(data):
    reader = pa.ipc.open_file(pa.BufferReader(data))
    col = reader.get_batch(0).column(reader.schema.get_field_index("payload"))
    return col.buffers()[-1].address - data.address  # the payload's value bytes, in either version


def craft(kv, tok, pos, fp, *, leaf_size=4096, fanout=64, root=None, rope_json=None, overrides=None,
          rekey=True, options=None, pad_payload=None, chunk_size=4096, align_pad=None, meta_offset=None,
          version=FORMAT_VERSION):
    """Returns (key, bytes, payload offset). ``rekey``: recompute the key from the (possibly
    overridden) fields, so the file is self-consistent; otherwise keep the honest key (a lying file).
    ``version``: the file format version written (1: the old layout)."""
    payload, length = payload_bytes(kv, chunk_size)
    if pad_payload is not None:
        payload = pad_payload
    sha = sha256(payload)
    if root is None:
        root = tree_digest(payload, leaf_size=leaf_size, fanout=fanout)
    name = dtype_name(kv.dtype)
    shape = tuple(int(s) for s in kv.shape)
    tok = np.asarray(tok, dtype="<i8")
    pos = np.asarray(pos, dtype="<i8")
    cols = {
        "format": FORMAT_NAME, "version": version,
        "fingerprint": {"architecture": fp.architecture, "num_layers": fp.num_layers,
                        "num_kv_heads": fp.num_kv_heads, "head_size": fp.head_size, "dtype": fp.dtype,
                        "rope": rope_json if rope_json is not None else fp.rope_json()},
        "dtype": name, "shape": list(shape), "token_ids": tok, "positions": pos,
        "payload_length": length, "chunk_size": chunk_size, "sha256": sha, "tree_root": root,
        "tree_leaf_size": leaf_size, "tree_fanout": fanout,
    }
    honest_key = derive_key(fp, name, shape, tok, pos, length, chunk_size, sha, root, leaf_size, fanout)
    cols.update(overrides or {})
    key = honest_key
    if rekey:
        key = derive_key(ModelFingerprint.from_dict({**cols["fingerprint"], "rope": {}}) if rope_json else fp,
                         cols["dtype"], cols["shape"], cols["token_ids"], cols["positions"], cols["payload_length"],
                         cols["chunk_size"], cols["sha256"], cols["tree_root"], cols["tree_leaf_size"],
                         cols["tree_fanout"])
    cols["key"] = key
    payload_col = payload_array(payload, version)
    pad, offset = 0, 0
    for _ in range(8):
        schema = segment_schema(payload.nbytes, offset if meta_offset is None else meta_offset, version=version)
        arrays = [pa.array([cols[f.name]], type=f.type) for f in schema if f.name not in ("align_pad", "payload")]
        arrays += [pa.array([align_pad if align_pad is not None else bytes(pad)], type=pa.binary()), payload_col]
        batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, schema, options=options) as w:
            w.write_batch(batch)
        data = sink.getvalue()
        if options is not None and options.compression:
            return key, data, None  # layout cannot be aligned: every buffer is compressed
        actual = _offset_in(data)
        if actual == offset and actual % PAYLOAD_ALIGNMENT == 0:
            return key, data, offset
        if actual % PAYLOAD_ALIGNMENT:
            pad += (-actual) % PAYLOAD_ALIGNMENT
        offset = actual + (-actual) % PAYLOAD_ALIGNMENT
    raise RuntimeError("could not align")


def read_outcome(store, key, kv, tok, pos, op="get", check="sha256", *, fp):
    """``"same"`` when ``op`` (get / verify / read_header) gave back exactly the written segment,
    ``"refused"`` for a KmeshError naming ``key``; anything else fails the calling test here."""
    from kmesh_host import KmeshError

    try:
        if op == "get":
            seg = store.get(key, model_fingerprint=fp, check=check)
            assert torch.equal(seg.kv.view(torch.uint8), kv.view(torch.uint8)), "wrong kv returned"
            assert torch.equal(seg.token_ids, tok) and torch.equal(seg.positions, pos), "wrong tokens returned"
            assert seg.key == key and seg.fingerprint == fp
        elif op == "verify":
            assert store.verify(key).key == key
        else:
            h = store.read_header(key)
            assert h.key == key and h.token_ids.tolist() == tok.tolist() and h.positions.tolist() == pos.tolist()
        return "same"
    except KmeshError as exc:
        assert key in str(exc), f"error does not name the segment: {exc!r}"
        return "refused"
