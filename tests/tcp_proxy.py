"""A TCP proxy on 127.0.0.1 that a test can cut: the faults between two real peers (a client
relay and its server, a trainer and its env) without touching either.

``TcpProxy(target_port)`` forwards every connection made to ``proxy.port`` to the target, in a
thread of its own. ``drop()`` closes every connection open now (the peers see them break; new
ones are still accepted), ``refuse()`` also stops accepting until ``accept()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.connections = 0  # accepted in all
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tcp-proxy-{self.port}", daemon=True)
        self._thread.start()
        self.accept()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def accept(self) -> None:
        """Listen on ``port`` (again)."""
        async def start():
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        self._call(start())

    def drop(self) -> int:
        """Close every connection open now; how many there were."""
        async def close_all():
            pipes = list(self._pipes)
            for writer in pipes:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
            return len(pipes) // 2
        return self._call(close_all())

    def refuse(self) -> int:
        """Stop listening (connections are refused) and close every open one."""
        async def stop():
            if self._server is not None:
                self._server.close()
                self._server = None
        self._call(stop())
        return self.drop()

    def close(self) -> None:
        self.refuse()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._pipes.update((writer, up_writer))
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                self._pipes.discard(end)
                with contextlib.suppress(Exception):
                    end.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.transport.abort()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
