"""The connector's own small files beside the segment store: segment names and request receipts.

Under ``<store_root>/vllm-connector/``:

* ``names/<namespace>/<h>.json`` — ``{"namespace", "name", "key"}``: the segment a leader saved
  under a name (the last leader to save a name wins). Children's names are resolved here, on the
  scheduler side, without reading any segment.
* ``receipts/<engine_id>/<h>.json`` — what the worker did for one request (the keys it saved, how
  a reuse went). The worker writes a request's receipt before the step's output leaves it; the
  scheduler reads and removes it in ``request_finished``. A file (not the step's worker metadata)
  because vLLM calls ``request_finished`` for a request that ends in the step of its prefill
  before it hands the scheduler side that step's worker metadata.

``<h>`` is a SHA-256 of the name (or request id), so any string is a valid name; each file holds
the string it belongs to and is checked on reading. Writes go to a temporary file that is renamed
into place, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from .config import ConnectorError


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _write_atomic(path: Path, data: dict, *, durable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConnectorError(f"{path}: unreadable connector record: {exc}") from exc
    return data if isinstance(data, dict) else None


class ConnectorRecords:
    """Names and receipts of one engine (``engine_id``: vLLM's, the same in the scheduler and the
    worker process) in one ``namespace`` under ``store_root``. Safe across processes (each write
    is one rename)."""

    def __init__(self, store_root, *, namespace: str, engine_id: str):
        self.root = Path(store_root) / "vllm-connector"
        self.namespace = namespace
        self._names = self.root / "names" / _digest(namespace)
        self._receipts = self.root / "receipts" / _digest(engine_id)

    # ------------------------------------------------------------------ names
    def bind(self, name: str, key: str) -> None:
        """``name`` now means segment ``key`` (replacing an earlier binding)."""
        _write_atomic(self._names / f"{_digest(name)}.json",
                      {"namespace": self.namespace, "name": name, "key": key}, durable=True)

    def lookup(self, name: str) -> str | None:
        """The key bound to ``name`` in this namespace, or None."""
        d = _read(self._names / f"{_digest(name)}.json")
        if d is None or d.get("name") != name or d.get("namespace") != self.namespace:
            return None
        key = d.get("key")
        return key if isinstance(key, str) else None

    # ------------------------------------------------------------------ receipts
    def write_receipt(self, request_id: str, receipt: dict) -> None:
        """Record what the worker did for ``request_id`` (replaces an earlier receipt)."""
        _write_atomic(self._receipts / f"{_digest(request_id)}.json", {"request_id": request_id, **receipt},
                      durable=False)

    def take_receipt(self, request_id: str) -> dict | None:
        """The receipt of ``request_id`` (removed), or None when the worker wrote none."""
        path = self._receipts / f"{_digest(request_id)}.json"
        d = _read(path)
        if d is None:
            return None
        path.unlink(missing_ok=True)
        if d.pop("request_id", None) != request_id:
            return None
        return d
