"""Opening a channel, on the CPU: what the service refuses (typed, the connection kept in step,
the service serving on), and that a client with channels on restores a CPU registration through the
socket as before. The channel's loop: ``test_channel_jit.py``; channels on the GPU:
``test_channel_gpu.py``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from kmesh_gpu import place_many
from kmesh_gpu.errors import OwnershipError, ProtocolError, ServiceError
from kmesh_host.service import CacheClient, SharedCache, channel, sockets
from tests.kmesh_host.service.helpers import fingerprint, put_original, running_service, small_layout


@pytest.fixture(scope="module")
def service():
    with running_service(reap_interval_s=0.05) as svc:
        yield svc


def _open(client, reg, *, fds: int = 3, send: int | None = None, secret: str | None = None,
          max_tokens: int | None = None):
    """A hand-made ``channel`` request announcing ``fds`` descriptors and sending ``send`` of them."""
    send = fds if send is None else send
    page, fd = channel.Page.create(max_tokens or reg.layout.num_slots)
    efds = [channel.new_eventfd(), channel.new_eventfd()]
    try:
        def after(sock):
            if send:
                socket.send_fds(sock, [sockets.FD_MARK], [fd, *efds][:send])

        header = {"op": "channel", "reg": reg.reg_id, "secret": secret or reg.secret, "fds": fds,
                  "max_tokens": max_tokens or reg.layout.num_slots, "event": "00" * 64}
        return client._call(header, after=after).header
    finally:
        page.close()
        for x in (fd, *efds):
            os.close(x)


def test_channel_requests_the_service_refuses(service):
    layout = small_layout()
    cache = SharedCache(layout, fill=0)
    try:
        with CacheClient(service.socket_path, timeout=60) as c:
            reg = c.register(cache, layout, model_fingerprint=fingerprint())
            with pytest.raises(ServiceError, match="GPU registrations"):
                _open(c, reg)  # a CPU registration: no channel (its descriptors were read and closed)
            assert c.status()["healthy"]  # the connection is still in step
            with pytest.raises(ProtocolError, match="expected 3 file descriptors"):
                _open(c, reg, fds=0)
            with pytest.raises(ProtocolError, match="outside 0..3"):
                _open(c, reg, fds=9, send=0)
            assert c.status()["healthy"]
            with pytest.raises(OwnershipError, match="wrong secret"):
                _open(c, reg, secret="ab" * 32)
            assert c.status()["healthy"]
            with pytest.raises(OwnershipError, match="not open on this connection"):
                c.call({"op": "channel_keys", "reg": reg.reg_id, "secret": reg.secret, "channel": 12345, "keys": ["k"]})
            st = c.status()
            assert st["channels"] == {"open": 0, "served": 0, "declined": 0, "stuck": 0}
            assert c.close_registration(reg, timeout=30) is True
    finally:
        cache.close()


def test_a_client_with_channels_restores_cpu_registrations_through_the_socket(service):
    layout = small_layout()
    cache = SharedCache(layout, fill=0)
    try:
        with CacheClient(service.socket_path, timeout=60) as c:
            assert c.channel  # on by default
            kv = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
            key = put_original(c, kv)
            reg = c.register(cache, layout, model_fingerprint=fingerprint())
            assert c.restore(reg, [(key, [4, 5, 6, 7])]) > 0  # a socket operation's id
            ref = layout.allocate(fill=0)
            place_many([kv], ref, layout, [torch.tensor([4, 5, 6, 7])])
            assert torch.equal(cache.tensor.view(torch.uint8), ref.view(torch.uint8))
            assert c.route_counts == {"channel": 0, "socket": 1}  # (a channel is for GPU registrations only)
            assert c.last_route == "socket"
            assert c.close_registration(reg, timeout=30) is True
            c.evict(key)
    finally:
        cache.close()
