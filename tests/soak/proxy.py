"""A small threaded TCP proxy on loopback whose connections the soak can cut for real.

``cut()`` closes every connection in flight (both sides see a reset or EOF, as on a broken
network); ``block(seconds)`` also refuses new connections for that long (each accepted socket is
closed at once), so clients see the service unreachable. Nothing is buffered beyond one ``recv``:
what a client wrote before the cut either reached the server or was lost with the connection.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

__all__ = ["TcpProxy"]

log = logging.getLogger(__name__)


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>`` until ``close()``."""

    def __init__(self, target_port: int, name: str) -> None:
        self.target_port, self.name = target_port, name
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self.listener.getsockname()[1])
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.blocked_until = 0.0
        self.closed = False
        self.thread = threading.Thread(target=self.accept_loop, name=f"proxy-{name}", daemon=True)
        self.thread.start()

    def accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self.blocked_until:
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.pairs.append((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self.pump, args=(src, dst, (client, server)), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self.drop(pair)

    def drop(self, pair: tuple[socket.socket, socket.socket]) -> None:
        with self.lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self) -> int:
        """Close every connection in flight; return how many there were."""
        with self.lock:
            pairs = list(self.pairs)
        for pair in pairs:
            self.drop(pair)
        log.info("proxy %s: cut %d connections", self.name, len(pairs))
        return len(pairs)

    def block(self, seconds: float) -> int:
        """Cut every connection and refuse new ones for ``seconds``."""
        self.blocked_until = time.monotonic() + seconds
        return self.cut()

    def unblock(self) -> None:
        self.blocked_until = 0.0

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        self.cut()
