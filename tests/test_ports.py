"""[Note: rendezvous ports] in selzero_plugin/ports.py: the launches' ports come from below the
ephemeral range, where the kernel never hands a port to a bind(0) of another process (a port
from the usual recipe could be given to a gloo pair meanwhile: suspected in one suite run's
300 s hang of an Accelerate launch)."""

from __future__ import annotations

import socket

from selzero_plugin.ports import _ephemeral_low, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_is_free():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # random, not one fixed port every caller would share
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    import selzero_plugin.ports as ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        picks = iter([taken, taken, taken + 1 if taken + 1 != taken else taken + 2])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(picks))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65535)
        assert free_port() != taken
