"""systemd's readiness protocol (sd_notify(3)) for a launcher that may run outside systemd."""

from __future__ import annotations

import socket


class SystemdNotifier:
    """Sends sd_notify(3) datagrams (``READY=1``, ``STATUS=...``) to ``$NOTIFY_SOCKET``.

    Without an address every call is a no-op, so the launcher runs the same outside systemd.
    The socket is non-blocking: a receiver that stops reading makes `notify` raise instead of
    freezing the launcher's event loop (a Unix datagram queue holds only
    ``net.unix.max_dgram_qlen`` messages, 10 by default, unix(7)).
    Addresses are a filesystem path or ``@name`` for Linux's abstract namespace, as systemd sets
    them (sd_notify(3)).
    """

    def __init__(self, address: str | None) -> None:
        self._address: str | None = None
        self._socket: socket.socket | None = None
        if address and address[0] in "/@":
            self._address = "\0" + address[1:] if address[0] == "@" else address
            self._socket = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
            )

    def notify(self, *assignments: str) -> None:
        """Send ``assignments`` (``"READY=1"``, ``"STATUS=text"``) as one newline-joined datagram.

        Raises:
            OSError: the datagram could not be sent (no listener, permission).
        """
        if self._socket is None or self._address is None:
            return
        self._socket.sendto("\n".join(assignments).encode("utf-8"), self._address)

    def close(self) -> None:
        """Release the socket."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
