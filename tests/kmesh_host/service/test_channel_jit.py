"""The channel's compiled loop and client call on the CPU, with stand-in driver functions.

The loop (``_channel_jit.serve``) calls the driver by address; here those addresses are ctypes
callbacks that copy the table into host memory standing in for the device, record what a launch
was given and answer event queries as a test scripts them. What is checked: the uploaded run table
equals the reference builder's for the same request, the request's blocks are held (with the
channel's operation id) while its copy is in flight and free after, and every request the channel must
not serve is answered with its code, nothing uploaded and no block held (or, when the completion
cannot be observed, its blocks kept held). The page's sleep and wake protocol and the service's
checks of a client's page run for real (memfd, eventfds, libc). The GPU tests
(``test_channel_gpu.py``) run the same loop against the driver.
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time

import numpy as np
import pytest

from kmesh_gpu.compiled import build_runs
from kmesh_gpu.errors import ProtocolError, ServiceError
from tests.kmesh_host.service.helpers import wait_for

channel = pytest.importorskip("kmesh_host.service.channel")
if channel.jit() is None:  # Numba is a dependency of the package: this is not expected
    pytest.fail("the channel's compiled functions do not compile here")
J, A = channel.jit()

MAX_T = 96
L = 3
OP = 77
# run builder constants (_host_tables.PARAMS): row bytes, block size N, longest run, slots S, positions P,
# K block/token strides and offset, V block/token strides and offset
PARAMS = np.array([256, 8, 8, 128, 1000, 100, 1, 0, 100, 1, 50], dtype=np.int64)
KV_ADDR = (1 << 20, 1 << 21, 1 << 22)
CLIENT_EVENT = 4321  # the client's interprocess event, as the channel opened it


class Driver:
    """Stand-ins for cuMemcpyHtoDAsync, cuEventRecord, cuLaunchKernel and cuEventQuery."""

    def __init__(self, holders):
        self.holders = holders
        self.copies, self.launches, self.held_while_copying = [], [], []
        self.query_codes: list[int] = []  # answered in order, then 0
        self.ready_when = None  # a condition: "not ready" (600) is answered until it holds
        self.copy_rc = self.launch_rc = self.record_rc = 0
        C = ctypes.CFUNCTYPE
        self._cb = [
            C(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)(self._copy),
            C(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(lambda event, stream: self.record_rc),
            C(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
              ctypes.c_void_p)(self._launch),
            C(ctypes.c_int, ctypes.c_void_p)(self._query),
            C(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)(self._wait)]
        libc = channel.functions(False)
        self.waits: list = []
        self.wait_rc = 0
        addr = [ctypes.cast(c, ctypes.c_void_p).value for c in self._cb]
        self.fns = np.array(addr[:4] + [int(libc[4]), int(libc[5]), addr[4]], dtype=np.int64)
        self.fns.setflags(write=False)

    def _copy(self, dst, src, nbytes, stream):
        if self.copy_rc:
            return self.copy_rc
        ctypes.memmove(dst, src, nbytes)
        self.copies.append(nbytes)
        return 0

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        if self.launch_rc:
            return self.launch_rc
        pp = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        self.launches.append((fn, gx, bx, [ctypes.cast(pp[i], ctypes.POINTER(ctypes.c_int64))[0] for i in range(8)]))
        return 0

    def _wait(self, stream, event, flags):
        self.waits.append((event, len(self.copies)))  # (before the table's upload)
        return self.wait_rc

    def _query(self, event):
        self.held_while_copying.append(self.holders.copy())
        if self.ready_when is not None and not self.ready_when():
            return 600
        return self.query_codes.pop(0) if self.query_codes else 0


class Channel:
    """A page, the loop's state and tables, and a thread running the loop as ServiceChannel does."""

    def __init__(self, spin_s: float = 0.05, rows: int = 8):
        self.page, fd = channel.Page.create(MAX_T)
        os.close(fd)
        self.efd_svc, self.efd_cli = channel.new_eventfd(), channel.new_eventfd()
        self.st = np.zeros(J.STATE_WORDS, dtype=np.int64)
        self.st[J.S_OPEN], self.st[J.S_SPIN_NS], self.st[J.S_EFD_CLI], self.st[J.S_OP] = 1, int(spin_s * 1e9), \
            self.efd_cli, OP
        self.rows = np.zeros((rows, J.ROW_WORDS), dtype=np.int64)
        self.holders = np.zeros(int(PARAMS[3] // PARAMS[1]), dtype=np.int64)
        self.lock = np.zeros(1, dtype=np.int64)
        self.host = np.zeros(L + 10 * MAX_T, dtype=np.int64)
        self.dev = np.zeros_like(self.host)
        self.layer_base = np.array([1000, 2000, 3000], dtype=np.int64)
        self.layer_base.setflags(write=False)
        self.kernel = np.array([555, 1, 64, 8], dtype=np.int64)
        self.kernel.setflags(write=False)
        self.template = np.zeros(16, dtype=np.int64)
        self.template[5] = L
        self.template.setflags(write=False)
        self.blocks = np.zeros(MAX_T, dtype=np.int64)
        self.scratch = np.zeros(5 * J.MAX_ITEMS + 1, dtype=np.int64)
        self.args = np.zeros(16, dtype=np.int64)
        self.one, self.ts = np.ones(1, dtype=np.int64), np.zeros(2, dtype=np.int64)
        self.drv = Driver(self.holders)
        # rows 0, 1, 2: originals of 16, 8 and 4 tokens (generations 10, 11, 12)
        self.positions = [np.arange(100 * i, 100 * i + c, dtype=np.int64) for i, c in enumerate((16, 8, 4))]
        for i, p in enumerate(self.positions):
            J.set_row(self.lock, self.rows, i, 10 + i, KV_ADDR[i], len(p), p.ctypes.data)
        self.codes: list[int] = []
        self.sleeps = 0
        self.client = channel.ClientChannel(1, OP, self.page, self.efd_svc, self.efd_cli)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        args = (self.page.words, self.st, self.rows, self.holders, self.lock, self.drv.fns, self.host,
                self.host.ctypes.data, self.dev.ctypes.data, 0, 0, CLIENT_EVENT, self.layer_base, PARAMS, self.kernel, self.template,
                PARAMS, self.kernel, self.template, True, self.blocks, self.scratch, self.args, self.one, self.ts)
        try:
            while True:
                code = J.serve(*args)
                self.codes.append(code)
                if code != J.IDLE:
                    break
                self.sleeps += 1
                channel.sleep_on(self.efd_svc, 0.25)
        finally:
            A.put(self.page.words, J.W_STATE, 1)
            channel.wake(self.efd_cli)

    def request(self, items, slots, news=None, *, timeout=60.0, after_event=False):
        """``items``: (row, generation, count) per item; ``slots``/``news``: one int64 array per item."""
        c = self.client
        n = len(items)
        for i, it in enumerate(items):
            c.items[3 * i:3 * i + 3] = it
            c.srcs[i] = slots[i].ctypes.data
            if news is not None:
                c.srcs[n + i] = news[i].ctypes.data
        T = sum(len(s) for s in slots)
        flags = (J.SHIFTED if news is not None else 0) | (J.AFTER_EVENT if after_event else 0)
        return c.call(n, T, flags, time.monotonic() + timeout)

    def stop(self):
        A.put(self.st, J.S_STOP, 1)
        channel.wake(self.efd_svc)
        self.thread.join(10)
        assert not self.thread.is_alive()

    def close(self):
        if self.thread.is_alive():
            self.stop()
        self.client.close()


@pytest.fixture
def ln():
    x = Channel()
    yield x
    x.close()


def _reference(channel_, items, slots, news):
    """The run table the loop must upload: ``_host_tables._build`` over the same inputs."""
    T = sum(len(s) for s in slots)
    starts = np.zeros(len(items) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([it[2] for it in items])
    ptrs = np.array([channel_.rows[it[0], J.G_KV] for it in items], dtype=np.int64)
    sl = np.concatenate(slots)
    pos = np.concatenate([channel_.positions[it[0]][:it[2]] for it in items] + list(news)) if news else \
        np.zeros(0, dtype=np.int64)
    out = np.zeros((T, 7), dtype=np.int64)
    R = build_runs(sl, starts, ptrs, PARAMS, True, pos, out)
    assert R > 0
    head = np.concatenate((channel_.layer_base, pos if news else np.zeros(2 * T, dtype=np.int64), sl))
    return R, head, out[:R]


def _i64(*xs):
    return [np.asarray(x, dtype=np.int64) for x in xs]


@pytest.mark.parametrize("shifted", [True, False])
def test_a_request_is_tabulated_uploaded_launched_and_its_blocks_held_until_completion(ln, shifted):
    items = [(0, 10, 16), (2, 12, 4)]
    slots = _i64(np.arange(16, 32), np.arange(40, 44))
    news = _i64(np.arange(500, 516), np.arange(600, 604)) if shifted else None
    ln.drv.query_codes = [600, 600]  # not ready twice: the loop polls on
    assert ln.request(items, slots, news) == J.OK
    R, head, runs = _reference(ln, items, slots, news)
    T = 20
    got = ln.dev[:L + 3 * T + 7 * R]
    if shifted:
        assert np.array_equal(got[:L + 3 * T], head)
    else:
        assert np.array_equal(got[:L], head[:L]) and np.array_equal(got[L + 2 * T:L + 3 * T], head[L + 2 * T:])
    assert np.array_equal(got[L + 3 * T:].reshape(R, 7), runs)
    assert ln.drv.copies == [(L + 3 * T + 7 * R) * 8]
    fn, grid, block, args = ln.drv.launches[0]
    base = ln.dev.ctypes.data
    assert fn == 555 and block == 256 and args[:5] == [base + 8 * (L + 3 * T), base + 8 * L, base, R, T]
    # blocks 2, 3 (slots 16..31) and 5 (40..43) held by the channel's operation at every query, free after
    assert len(ln.drv.held_while_copying) == 3
    for h in ln.drv.held_while_copying:
        assert np.flatnonzero(h).tolist() == [2, 3, 5] and set(h[[2, 3, 5]].tolist()) == {OP}
    assert not ln.holders.any()
    assert ln.st[J.S_SERVED] == 1 and ln.st[J.S_DECLINED] == 0


def test_a_request_after_the_clients_work_waits_for_its_event_before_the_upload(ln):
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8)), after_event=True) == J.OK
    assert ln.drv.waits == [(CLIENT_EVENT, 0)] and len(ln.drv.copies) == 1
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.OK  # no work queued: no wait
    assert len(ln.drv.waits) == 1
    ln.drv.wait_rc = 1  # the driver refuses the wait: nothing queued, nothing held
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8)), after_event=True) == J.DRIVER
    assert len(ln.drv.copies) == 2 and not ln.holders.any()


def _refused(ln, code, items, slots, news=None):
    before = ln.holders.copy()
    assert ln.request(items, slots, news) == code
    assert ln.drv.copies == [] and ln.drv.launches == []
    assert np.array_equal(ln.holders, before)


def test_stale_rows_are_refused(ln):
    _refused(ln, J.STALE, [(2, 11, 4)], _i64([0, 1, 2, 3]))  # another generation
    _refused(ln, J.STALE, [(0, 10, 4)], _i64([0, 1, 2, 3]))  # another token count than the row's
    J.set_row(ln.lock, ln.rows, 2, 0, 0, 0, 0)  # dropped
    _refused(ln, J.STALE, [(2, 12, 4)], _i64([0, 1, 2, 3]))


def test_malformed_requests_are_refused(ln):
    _refused(ln, J.MALFORMED, [(8, 1, 4)], _i64([0, 1, 2, 3]))  # no such row
    _refused(ln, J.MALFORMED, [(-1, 1, 4)], _i64([0, 1, 2, 3]))
    page = ln.page.words
    c = ln.client
    c.items[:3] = (2, 12, 4)
    c.srcs[0] = _i64([0, 1, 2, 3])[0].ctypes.data
    for n, T in ((0, 4), (J.MAX_ITEMS + 1, 4), (1, MAX_T + 1), (1, 0)):
        # written straight into the page (the client's send refuses these)
        page[J.R_N], page[J.R_T], page[J.R_FLAGS] = n, T, 0
        c.seq += 1
        A.put(page, J.W_REQ, c.seq)
        assert J.wait(page, c.seq, c.fns, int(60e9), c.ts) == J.MALFORMED
    page[J.R_N], page[J.R_T], page[J.R_FLAGS] = 1, 4, 4  # unknown flags
    c.seq += 1
    A.put(page, J.W_REQ, c.seq)
    assert J.wait(page, c.seq, c.fns, int(60e9), c.ts) == J.MALFORMED
    assert not ln.holders.any() and ln.drv.copies == []


def test_the_client_refuses_to_publish_what_does_not_add_up(ln):
    c = ln.client
    before = int(ln.page.words[J.W_REQ])
    c.srcs[0] = _i64(np.arange(0, 8))[0].ctypes.data
    for items, T in (((1, 11, 0), 8), ((1, 11, -3), 8), ((1, 11, 8), 4), ((1, 11, 8), MAX_T + 1)):
        c.items[:3] = items
        assert J.send(ln.page.words, c.items, 1, T, 0, c.srcs, c.seq + 1, c.fns, c.efd_svc, c.one) == -1
    assert int(ln.page.words[J.W_REQ]) == before  # nothing published


def test_what_the_channel_does_not_serve_is_declined(ln):
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([3, 2, 1, 0]))  # not increasing
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([0, 1, 1, 2]))  # repeated
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([-1, 1, 2, 3]))  # a skipped token
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([125, 126, 127, 128]))  # beyond the slots
    _refused(ln, J.DECLINED, [(1, 11, 8), (2, 12, 4)], _i64(np.arange(8, 16), [0, 1, 2, 3]))  # items out of order
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([0, 1, 2, 3]), _i64([998, 999, 1000, 1001]))  # positions
    _refused(ln, J.DECLINED, [(2, 12, 4)], _i64([0, 8, 16, 24]))  # runs of one token: not worth it
    assert ln.st[J.S_DECLINED] == 7


def test_held_blocks_are_refused_as_busy(ln):
    ln.holders[3] = 5  # another operation's
    _refused(ln, J.BUSY, [(0, 10, 16)], _i64(np.arange(16, 32)))
    assert ln.holders[3] == 5 and ln.holders.sum() == 5
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.OK  # other blocks


def test_a_closed_registration_takes_no_request(ln):
    A.set_word(ln.lock, ln.st, J.S_OPEN, 0)
    _refused(ln, J.CLOSED, [(1, 11, 8)], _i64(np.arange(0, 8)))


def test_driver_refusals_leave_nothing_in_flight(ln):
    ln.drv.copy_rc = 2
    _refused(ln, J.DRIVER, [(1, 11, 8)], _i64(np.arange(0, 8)))
    ln.drv.copy_rc, ln.drv.launch_rc = 0, 1
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.DRIVER
    # the upload was queued: the loop waited for it (held meanwhile) before releasing
    assert len(ln.drv.copies) == 1 and len(ln.drv.held_while_copying) == 1
    assert ln.drv.held_while_copying[0][0] == OP and not ln.holders.any()


def test_an_unobservable_completion_keeps_the_blocks_held_and_stops_the_channel(ln):
    ln.drv.query_codes = [600, 999]  # not ready, then an error: nothing proves the copy finished
    assert ln.request([(0, 10, 16)], _i64(np.arange(16, 32))) == J.STUCK
    ln.thread.join(60)
    assert ln.codes[-1] == J.STUCK and ln.st[J.S_STUCK] == 1
    assert ln.st[J.S_NSTUCK] == 2 and ln.blocks[:2].tolist() == [2, 3]
    assert np.flatnonzero(ln.holders).tolist() == [2, 3] and ln.holders[2] == OP
    assert ln.lock[0] == 0
    # the channel is closed: a later request is not answered, and the client is told so
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.GONE


def test_a_failed_record_is_unobservable_too(ln):
    ln.drv.record_rc = 3
    assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.STUCK
    assert ln.holders[0] == OP


def test_both_sides_sleep_and_are_woken(monkeypatch):
    ln = Channel(spin_s=1e-3)
    try:
        ln.client.spin_ns = int(1e-3 * 1e9)
        assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.OK  # (compiles; the loop may have slept)
        wait_for(lambda: ln.page.words[J.W_SVC_SLEEP] == 1 and ln.codes and ln.codes[-1] == J.IDLE, interval=0.005)
        sleeps = ln.sleeps
        assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.OK  # the send woke the loop
        assert ln.sleeps >= sleeps
        # a slow copy, done only once the client sleeps (after its spin budget): the reply wakes it,
        # not the 0.25 s limit of each of its sleeps
        woken = []  # per sleep of the client: whether its eventfd was written

        def recording(fd, timeout, real=channel.sleep_on):
            if fd == ln.efd_cli:
                woken.append(bool(select.select([fd], [], [], max(0.0, timeout))[0]))
                timeout = 0.0
            real(fd, timeout)

        monkeypatch.setattr(channel, "sleep_on", recording)
        ln.drv.ready_when = lambda: ln.page.words[J.W_CLI_SLEEP] == 1
        assert ln.request([(1, 11, 8)], _i64(np.arange(0, 8))) == J.OK
        assert woken and woken[-1] is True, f"the client's sleeps ended woken: {woken}"
    finally:
        ln.close()


def test_a_client_that_gets_no_reply_by_its_deadline_stops_using_the_channel(ln):
    ln.stop()  # nobody answers; the closed page says so
    A.put(ln.page.words, J.W_STATE, 0)  # (as if the service were only slow)
    ln.client.spin_ns = int(1e6)
    with pytest.raises(ServiceError, match="no reply") as info:
        ln.request([(1, 11, 8)], _i64(np.arange(0, 8)), timeout=0.2)
    assert info.value.op_id == OP  # the channel's operation: draining it waits for whatever is in flight
    assert ln.client.closed is True


def test_random_pages_never_crash_the_loop_nor_hold_anything():
    """Fuzz: random request words (within and beyond the bounds) published by a hostile client."""
    ln = Channel(rows=4)
    rng = np.random.default_rng(7)
    page = ln.page.words
    c = ln.client
    try:
        for k in range(400):
            n = int(rng.integers(-2, J.MAX_ITEMS + 3))
            T = int(rng.integers(-2, MAX_T + 3))
            page[J.R_N], page[J.R_T], page[J.R_FLAGS] = n, T, int(rng.integers(-1, 3))
            area = page[J.R_ITEMS:J.R_ITEMS + 3 * J.MAX_ITEMS + 2 * MAX_T]
            if k % 2:
                area[:] = rng.integers(-5, 200, size=area.size)
            else:  # plausible rows and generations, random counts and slots
                area[:] = rng.integers(0, 130, size=area.size)
                area[0:3 * J.MAX_ITEMS:3] = rng.integers(0, 3, size=J.MAX_ITEMS)
                area[1:3 * J.MAX_ITEMS:3] = 10 + area[0:3 * J.MAX_ITEMS:3]
            c.seq += 1
            A.put(page, J.W_REQ, c.seq)
            code = J.wait(page, c.seq, c.fns, int(60e9), c.ts)
            assert code in (J.OK, J.STALE, J.DECLINED, J.MALFORMED, J.BUSY), code
            assert not ln.holders.any() and ln.lock[0] == 0
        assert ln.thread.is_alive()
    finally:
        ln.close()


def test_the_service_adopts_only_sealed_pages_of_the_agreed_size():
    page, fd = channel.Page.create(MAX_T)
    try:
        assert channel.Page.adopt(fd, MAX_T).words[J.W_MAGIC] == J.MAGIC
        with pytest.raises(ProtocolError, match="bytes"):
            channel.Page.adopt(fd, MAX_T * 64)
    finally:
        os.close(fd)
        page.close()
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)  # not sealed: it could shrink under the mapping
    try:
        os.ftruncate(fd, channel.page_bytes(MAX_T))
        with pytest.raises(ProtocolError, match="sealed"):
            channel.Page.adopt(fd, MAX_T)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(ProtocolError, match="memfd"):
            channel.Page.adopt(r, MAX_T)
    finally:
        os.close(r)
        os.close(w)
    import fcntl

    fd = os.memfd_create("y", os.MFD_ALLOW_SEALING)  # sealed, right size, no magic word
    try:
        os.ftruncate(fd, channel.page_bytes(MAX_T))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        with pytest.raises(ProtocolError, match="magic"):
            channel.Page.adopt(fd, MAX_T)
    finally:
        os.close(fd)


def test_the_registry_reserves_and_releases_under_the_registrations_lock():
    """A channel's loop holds ``Registration.lock`` while it changes the holders: the registry's
    reservation waits for it."""
    from kmesh_host.service.registry import PeerIdentity, Registry
    from tests.kmesh_host.service.helpers import small_layout

    registry = Registry(lambda reg: None)
    reg = registry.register(PeerIdentity(1, 1, 1), instance=0, handle_key=b"k", layout=small_layout(), memory=None)
    other = registry.register(PeerIdentity(1, 1, 1), instance=0, handle_key=b"o", layout=small_layout(), memory=None)
    A.take(reg.lock)
    done, started = [], threading.Event()
    t = threading.Thread(target=lambda: (started.set(), done.append(registry.begin(reg, "restore", np.array([1, 2])))))
    t.start()
    assert started.wait(30)
    time.sleep(0.2)  # (a reservation that did not wait for the lock would be done by now)
    assert not done and not reg.holders.any()
    # the registry itself is not held meanwhile: other registrations' operations go on
    op_other = registry.begin(other, "restore", np.array([1]))
    registry.submitted(op_other, None, outcome="ok")
    assert not other.holders.any()
    A.give(reg.lock)
    t.join(30)
    assert done and np.flatnonzero(reg.holders).tolist() == [1, 2]
    op = done[0]
    registry.submitted(op, None, outcome="ok")
    assert not reg.holders.any() and reg.lock[0] == 0
