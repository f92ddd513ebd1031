"""Compiled halves of the shared-memory channel (Numba, no GIL): the service's request loop and the
client's call.

A channel is a page of shared memory between one client connection and the service, for the
restores of one GPU registration. The client writes a request into the page and publishes its
sequence number; the service's channel thread, polling the page, copies the request out, checks it,
holds its blocks, builds and uploads the run table, launches the placement, waits for the copy's
completion event, releases the holds and publishes the reply; the client polls for it. Every step
is in this module's compiled functions, with the CUDA driver and libc called by address
(:func:`kmesh_gpu.compiled.ccall`) and the run table built by :func:`kmesh_gpu.compiled.build_runs`
with the constants of the registration's placement plan (:class:`kmesh_gpu.CompiledLaunch`), so no
Python runs per request on either side.

Each side sleeps on an eventfd once it has polled for its spin budget without news, after saying
so in the page (``W_SVC_SLEEP`` / ``W_CLI_SLEEP``); the other side writes that eventfd when it
publishes and sees the flag. The flag is set, then the sequence looked at again (sequentially
consistent atomics on both sides), so a publication is never missed.

Trust: the page is writable by the client at any time. The service copies a request out of it
before looking at any value and checks the copy (item count, token count, rows and their
generations, slots, positions) against its own tables; nothing read from the page is used as an
address. Shared state with the service's Python: the registration's block holders (int64, 0: free)
and the segment rows, both changed only under the registration's spin lock (``lock[0]``), which
the loop holds from its checks until the copy has completed.
"""

from __future__ import annotations

import numba
import numpy as np

from kmesh_gpu.compiled import JIT_OPTIONS as _JIT
from kmesh_gpu.compiled import build_runs as _build_runs
from kmesh_gpu.compiled import ccall as _ccall
from kmesh_gpu.compiled import int64_ptr as _int64_ptr

from ._atomics import fence as _fence
from ._atomics import give, take
from ._atomics import load as _load
from ._atomics import store as _store

# ---------------------------------------------------------------- the page (int64 words)
W_REQ = 0  # client: sequence number of its latest request
W_CLI_SLEEP = 8  # client: 1 while it sleeps on its eventfd for the reply
W_REP = 16  # service: sequence number of the latest request answered
W_CODE = 17  # service: that answer's code (below)
W_SVC_SLEEP = 24  # service: 1 while the channel's thread sleeps on its eventfd
W_STATE = 32  # service: 0 open; 1 closed (nothing published after W_REP will be answered)
W_MAGIC = 40  # client: MAGIC, written when the page is made
HEAD = 64
R_N, R_T, R_FLAGS = HEAD, HEAD + 1, HEAD + 2  # items, tokens, flags (below)
SHIFTED = 1  # flag: every item shifted (RoPE; else none is)
AFTER_EVENT = 2  # flag: the copy waits on the stream for the client's event (its own work on the blocks)
R_ITEMS = HEAD + 8  # per item: row, its generation, its token count
MAX_ITEMS = 64
R_SLOTS = R_ITEMS + 3 * MAX_ITEMS  # then max_tokens slots, then max_tokens new positions
MAGIC = 0x4B4D4C414E450001  # "KMLANE" (the page format), version 1


def page_words(max_tokens: int) -> int:
    return R_SLOTS + 2 * max_tokens


# ---------------------------------------------------------------- reply codes
OK = 0
STALE = 1  # a row was replaced or dropped since the client looked it up: look up again
DECLINED = 2  # not what the channel serves (unordered or skipped slots, runs too short, ...): the socket path decides
BUSY = 3  # a block is held by another operation: the socket path says which
DRIVER = 4  # the driver refused the upload or the launch; nothing of it is still running
CLOSED = 5  # the registration stopped taking work (close), or the channel is stopping
MALFORMED = 6  # counts that do not add up, a row out of range: the client's bug
STUCK = 7  # the copy's completion could not be observed: its blocks stay held (the channel has stopped)

# the loop's returns besides STUCK
IDLE = 100  # polled for the spin budget without a request; W_SVC_SLEEP set: sleep on the eventfd
STOPPED = 101  # asked to stop (st[S_STOP])
# the client's
SLEEP = -1  # no reply within the spin budget; W_CLI_SLEEP set: sleep on the eventfd, then wait again
GONE = -2  # the channel closed and this request will not be answered

# ---------------------------------------------------------------- the loop's state (int64, service-private)
S_STOP, S_OPEN, S_SEEN, S_SERVED, S_STUCK, S_NSTUCK, S_SPIN_NS, S_EFD_CLI, S_OP, S_DECLINED, S_RC = range(11)
STATE_WORDS = 16
# rows: one per original the channel may read
G_VALID, G_GEN, G_KV, G_COUNT, G_POS = range(5)
ROW_WORDS = 5
# fns: addresses of the functions called
F_COPY_HTOD, F_RECORD, F_LAUNCH, F_QUERY, F_WRITE, F_CLOCK, F_WAIT = range(7)
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_CLOCK_MONOTONIC = 1


@numba.njit(**_JIT)
def _now_ns(fns, ts):
    _ccall(fns[F_CLOCK], (np.int32(_CLOCK_MONOTONIC), ts.ctypes.data))
    return ts[0] * 1_000_000_000 + ts[1]


@numba.njit(**_JIT)
def set_row(lock, rows, r, gen, kv, count, pos):
    """Under ``lock``: row ``r`` names the original at device address ``kv`` with ``count`` tokens
    whose old positions are the host int64 values at ``pos``; ``gen`` 0 drops the row."""
    take(lock)
    rows[r, G_VALID] = 0
    rows[r, G_GEN] = gen
    rows[r, G_KV] = kv
    rows[r, G_COUNT] = count
    rows[r, G_POS] = pos
    if gen != 0:
        rows[r, G_VALID] = 1
    give(lock)


# ---------------------------------------------------------------- the service's loop
@numba.njit(**_JIT)
def _release_blocks(holders, blocks, nb, op_id):
    for i in range(nb):
        b = blocks[i]
        if holders[b] == op_id:
            holders[b] = 0


@numba.njit(**_JIT)
def _serve_one(page, flags, st, rows, holders, lock, fns, host, hostaddr, devaddr, stream, event, client_event,
               layer_base, params, kernel, template, has_rope, blocks, items, starts, ptrs, args):
    """One request, copied out of the page (``flags``: as read by the caller, which chose the
    constants by it); returns its code (``STUCK``: ``st[S_NSTUCK]`` blocks of ``blocks`` stay held)."""
    n = page[R_N]
    T = page[R_T]
    max_tokens = (page.shape[0] - R_SLOTS) // 2
    L = layer_base.shape[0]
    if n < 1 or n > MAX_ITEMS or T < 1 or T > max_tokens or T > blocks.shape[0] or flags < 0 \
            or flags > SHIFTED + AFTER_EVENT:
        return MALFORMED
    rope = (flags & SHIFTED) != 0
    if (flags & AFTER_EVENT) != 0 and client_event == 0:
        return MALFORMED
    if rope and not has_rope:
        return DECLINED
    # the host region: [layer bases L | old positions T | new positions T | slots T | runs 7T]
    need = L + 10 * T
    if need > host.shape[0]:
        return MALFORMED
    for i in range(3 * n):
        items[i] = page[R_ITEMS + i]
    sl_at = L + 2 * T
    for t in range(T):
        host[sl_at + t] = page[R_SLOTS + t]
    if rope:
        for t in range(T):
            host[L + T + t] = page[R_SLOTS + max_tokens + t]
    total = 0
    nrows = rows.shape[0]
    for i in range(n):
        r, c = items[3 * i], items[3 * i + 2]
        if r < 0 or r >= nrows or c < 1:
            return MALFORMED
        starts[i] = total
        total += c
    starts[n] = total
    if total != T:
        return MALFORMED
    S, N, P = params[3], params[1], params[4]
    take(lock)
    if st[S_OPEN] == 0:
        give(lock)
        return CLOSED
    for i in range(n):
        r = items[3 * i]
        if rows[r, G_VALID] != 1 or rows[r, G_GEN] != items[3 * i + 1] or rows[r, G_COUNT] != items[3 * i + 2]:
            give(lock)
            return STALE
        ptrs[i] = rows[r, G_KV]
        if rope:
            c = items[3 * i + 2]
            host[L + starts[i]:L + starts[i] + c] = numba.carray(_int64_ptr(rows[r, G_POS]), (c,))
    # slots: every token placed, strictly increasing over the request (so distinct), in range
    nb = 0
    prev = -1
    for t in range(T):
        s = host[sl_at + t]
        if s <= prev or s >= S:
            give(lock)
            return DECLINED
        b = s // N
        if nb == 0 or blocks[nb - 1] != b:
            blocks[nb] = b
            nb += 1
        prev = s
    if rope:
        for t in range(L, L + 2 * T):
            p = host[t]
            if p < 0 or p >= P:
                give(lock)
                return DECLINED
    op_id = st[S_OP]
    for i in range(nb):
        if holders[blocks[i]] != 0:
            give(lock)
            return BUSY
    for i in range(nb):
        holders[blocks[i]] = op_id
    host[:L] = layer_base
    runs_at = L + 3 * T
    pos = host[L:L + 2 * T] if rope else host[:0]
    # slots proven distinct above; runs too short on average come back as a code (the per-token
    # kernel of the socket path is faster for them)
    R = _build_runs(host[sl_at:runs_at], starts[:n + 1], ptrs[:n], params, False, pos,
                    host[runs_at:runs_at + 7 * T].reshape((T, 7)))
    if R <= 0:
        _release_blocks(holders, blocks, nb, op_id)
        give(lock)
        return DECLINED
    if (flags & AFTER_EVENT) != 0:  # the client's earlier work on these blocks comes first
        rc = _ccall(fns[F_WAIT], (stream, client_event, np.uint32(0)))
        if rc != 0:
            st[S_RC] = rc
            _release_blocks(holders, blocks, nb, op_id)
            give(lock)
            return DRIVER
    rc = _ccall(fns[F_COPY_HTOD], (devaddr, hostaddr, (runs_at + 7 * R) * 8, stream))
    if rc != 0:
        st[S_RC] = rc
        _release_blocks(holders, blocks, nb, op_id)
        give(lock)
        return DRIVER
    # as kmesh_gpu's compiled placement: enough warps to fill the GPU before a warp takes several layers
    function, per_run, units, count = kernel[0], kernel[1], kernel[2], kernel[3]
    groups = min(L, max(1, -(-units // (per_run * R))))
    lg = -(-L // groups)
    warps = per_run * R * (-(-L // lg))
    args[:count] = template[:count]
    args[0], args[1], args[2], args[3], args[4], args[6] = devaddr + 8 * runs_at, devaddr + 8 * L, devaddr, R, T, lg
    base = args.ctypes.data
    for i in range(count):
        args[count + i] = base + 8 * i
    u32 = np.uint32
    launched = _ccall(fns[F_LAUNCH], (function, u32(-(-warps // 8)), u32(1), u32(1), u32(256), u32(1), u32(1),
                                      u32(0), stream, base + 8 * count, np.int64(0)))
    code = OK
    if launched != 0:  # the upload is queued: its completion is waited for all the same
        st[S_RC] = launched
        code = DRIVER
    rc = _ccall(fns[F_RECORD], (event, stream))
    if rc == 0:
        rc = _ccall(fns[F_QUERY], (event,))
        while rc == _NOT_READY:
            rc = _ccall(fns[F_QUERY], (event,))
    if rc != 0:  # nothing proves the copy finished: its blocks stay held
        st[S_RC] = rc
        st[S_NSTUCK] = nb
        st[S_STUCK] = 1
        give(lock)
        return STUCK
    _release_blocks(holders, blocks, nb, op_id)
    give(lock)
    return code


@numba.njit(**_JIT)
def serve(page, st, rows, holders, lock, fns, host, hostaddr, devaddr, stream, event, client_event, layer_base,
          params_r, kernel_r, template_r, params_p, kernel_p, template_p, has_rope, blocks, scratch, args, one, ts):
    """Answer the page's requests until asked to stop (:data:`STOPPED`), idle past the spin budget
    (:data:`IDLE`, ``W_SVC_SLEEP`` set) or stuck (:data:`STUCK`, answered)."""
    _store(page, W_SVC_SLEEP, 0)
    last = st[S_SEEN]
    idle_since = _now_ns(fns, ts)
    items = scratch[:3 * MAX_ITEMS]
    starts = scratch[3 * MAX_ITEMS:4 * MAX_ITEMS + 1]
    ptrs = scratch[4 * MAX_ITEMS + 1:5 * MAX_ITEMS + 1]
    while True:
        if _load(st, S_STOP) != 0:
            return STOPPED
        seq = _load(page, W_REQ)
        if seq == last:
            if _now_ns(fns, ts) - idle_since > st[S_SPIN_NS]:
                _store(page, W_SVC_SLEEP, 1)
                _fence()
                if _load(page, W_REQ) == last and _load(st, S_STOP) == 0:
                    return IDLE
                _store(page, W_SVC_SLEEP, 0)
            continue
        last = seq
        st[S_SEEN] = seq
        flags = page[R_FLAGS]
        if (flags & SHIFTED) != 0:
            code = _serve_one(page, flags, st, rows, holders, lock, fns, host, hostaddr, devaddr, stream, event,
                              client_event, layer_base, params_r, kernel_r, template_r, has_rope, blocks, items,
                              starts, ptrs, args)
        else:
            code = _serve_one(page, flags, st, rows, holders, lock, fns, host, hostaddr, devaddr, stream, event,
                              client_event, layer_base, params_p, kernel_p, template_p, has_rope, blocks, items,
                              starts, ptrs, args)
        if code == OK:
            st[S_SERVED] += 1
        elif code != STUCK:
            st[S_DECLINED] += 1
        _store(page, W_CODE, code)
        _store(page, W_REP, seq)
        _fence()
        if _load(page, W_CLI_SLEEP) != 0:
            _ccall(fns[F_WRITE], (np.int32(st[S_EFD_CLI]), one.ctypes.data, np.int64(8)))
        if code == STUCK:
            return STUCK
        idle_since = _now_ns(fns, ts)


# ---------------------------------------------------------------- the client's call
@numba.njit(**_JIT)
def send(page, items, n, T, flags, srcs, seq, fns, efd, one):
    """Write a request (``items``: n x (row, generation, count); ``srcs``: the addresses of each
    item's int64 slots, then of its new positions with ``SHIFTED`` in ``flags``) and publish it as ``seq``;
    wakes the service when it sleeps. Returns 0, or -1 when it does not fit the page."""
    max_tokens = (page.shape[0] - R_SLOTS) // 2
    if n < 1 or n > MAX_ITEMS or T < 1 or T > max_tokens:
        return -1
    page[R_N] = n
    page[R_T] = T
    page[R_FLAGS] = flags
    off = 0
    for i in range(n):
        page[R_ITEMS + 3 * i] = items[3 * i]
        page[R_ITEMS + 3 * i + 1] = items[3 * i + 1]
        c = items[3 * i + 2]
        page[R_ITEMS + 3 * i + 2] = c
        if c < 1 or off + c > T:
            return -1
        page[R_SLOTS + off:R_SLOTS + off + c] = numba.carray(_int64_ptr(srcs[i]), (c,))
        if (flags & SHIFTED) != 0:
            at = R_SLOTS + max_tokens + off
            page[at:at + c] = numba.carray(_int64_ptr(srcs[n + i]), (c,))
        off += c
    if off != T:
        return -1
    _store(page, W_CLI_SLEEP, 0)
    _store(page, W_REQ, seq)
    _fence()
    if _load(page, W_SVC_SLEEP) != 0:
        _ccall(fns[F_WRITE], (np.int32(efd), one.ctypes.data, np.int64(8)))
    return 0


@numba.njit(**_JIT)
def wait(page, seq, fns, spin_ns, ts):
    """The reply code of request ``seq``; :data:`SLEEP` after ``spin_ns`` without it
    (``W_CLI_SLEEP`` set), :data:`GONE` when the channel closed without answering it."""
    start = _now_ns(fns, ts)
    _store(page, W_CLI_SLEEP, 0)
    while True:
        if _load(page, W_REP) == seq:
            return _load(page, W_CODE)
        if _load(page, W_STATE) != 0:
            if _load(page, W_REP) == seq:
                return _load(page, W_CODE)
            return GONE
        if _now_ns(fns, ts) - start > spin_ns:
            _store(page, W_CLI_SLEEP, 1)
            _fence()
            if _load(page, W_REP) == seq or _load(page, W_STATE) != 0:
                _store(page, W_CLI_SLEEP, 0)
                continue
            return SLEEP
