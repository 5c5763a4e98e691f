"""A launch's MASTER_PORT, held by the caller for the whole launch so that no other launch (or
user) on the machine gets it between the pick and the rank's bind: ``reserve_port``."""

from __future__ import annotations

import errno
import socket
import sys

from d2lpar.processes.ranklog import LaunchError

__all__ = ["reserve_port", "HOLD_PORT"]

HOLD_PORT = sys.platform.startswith("linux")  # SO_REUSEADDR lets a store listen beside the hold


def reserve_port(addr: str, port: int) -> tuple[socket.socket | None, int]:
    """MASTER_PORT for this launch, and the socket that holds it until the launch ends.

    ``addr`` (the ranks' MASTER_ADDR) must resolve to an address of this machine: the ranks run
    here; said in one sentence, before anything starts. ``port`` 0 asks the kernel for a free one;
    a port already in use (on a shared machine, maybe another user's launch) is not an error: a free
    one replaces it, and a line says so.

    The caller binds the port without listening and keeps it bound for the whole launch (Linux),
    with SO_REUSEADDR set after the bind: another launch's probe (a bind without it) finds the port
    taken, and the kernel gives it to no ``bind(..., 0)`` or outgoing connection (Linux's
    ``inet_csk_bind_conflict`` and ``__inet_hash_connect``), while a rank's ``TCPStore``
    (``init_method='env://'``), which binds with SO_REUSEADDR, can still listen on it: a bound
    socket that does not listen blocks no listener that also asked for reuse. So two launches at
    once never share a MASTER_PORT, even between the pick and the rank's bind.
    """
    try:
        family = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise LaunchError(f"master_addr {addr!r} does not resolve ({getattr(e, 'strerror', e)}): "
                          "the launcher's ranks all run on this machine, so give '127.0.0.1' "
                          "or a name of this machine") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((addr, port))
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE and port:
            held, free = reserve_port(addr, 0)
            print(f"launch: port {port} on {addr} is in use (another launch or program): "
                  f"MASTER_PORT={free} instead")
            return held, free
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(f"no free port left on {addr}: end programs that hold ports there, "
                              "or give another master_addr") from None
        raise LaunchError(f"master_addr {addr!r} is not an address of this machine ({e.strerror}): "
                          "the launcher's ranks all run here, so give '127.0.0.1' or one "
                          "of this machine's addresses") from None
    port = s.getsockname()[1]
    if not HOLD_PORT:   # elsewhere SO_REUSEADDR means other things: the port is free, not held
        s.close()
        return None, port
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s, port
