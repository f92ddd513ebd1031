"""Reuse workloads (DESIGN.md §6, seed §24): shared segments, a leader, children that place the
segments elsewhere; segment identities and positions carried explicitly per request.

Public names:

* :class:`Workload` (``segments``, ``leader``, ``children``; ``leader_request()``, ``requests()``,
  ``check()``, ``to_json()``), :class:`ChildSpec`, :class:`SegmentRef`;
* :class:`Request` (``token_ids`` int64[T], ``segments``: :class:`SegmentSpan` per segment use);
* files: :func:`load_workload`, :func:`parse_workload`, :func:`save_workload`;
* generators: :func:`document_qa` (natural-language passages, questions with known answers, in the
  model's chat template) and :func:`synthetic` (random ids, same structure);
* :class:`WorkloadError`, a :class:`kmesh_gpu.KmeshError` naming the field.
"""

from .passages import document_qa
from .files import load_workload, parse_workload, save_workload
from .spec import ChildSpec, Request, SegmentRef, SegmentSpan, Workload, WorkloadError
from .random_ids import synthetic

__all__ = ["Workload", "ChildSpec", "SegmentRef", "Request", "SegmentSpan", "WorkloadError", "load_workload",
           "parse_workload", "save_workload", "document_qa", "synthetic"]
