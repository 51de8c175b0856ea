"""A minimal keep-alive HTTP/1.1 GET client on asyncio streams, for scraping /metrics.

A general client (aiohttp ≈ 0.5 ms CPU a request here) would make scraping 100 endpoints
at 10 Hz cost half a core; one persistent connection per endpoint and a fixed request
line keep the I/O side to a small fraction of that.
"""

from __future__ import annotations

import asyncio
import contextlib

from llmgw.discovery import join


class HttpGetError(Exception):
    pass


class KeepAliveGetter:
    def __init__(self, host: str, port: int, *, max_bytes: int = 8 * 1024 * 1024) -> None:
        self.host = host
        self.port = port
        self.max_bytes = max_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """The connection to ask on, and whether it is one kept from an earlier answer."""
        reader, writer = self._reader, self._writer
        if reader is not None and writer is not None and not writer.is_closing():
            if not reader.at_eof():
                return reader, writer, True
            await self.close()  # the server closed it while idle (uvicorn: after 5 s)
        self._reader, self._writer = await asyncio.open_connection(
            self.host, self.port, limit=1 << 20
        )
        return self._reader, self._writer, False

    async def _ask(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str
    ) -> bytes:
        """Send the request; the response's head."""
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {join(self.host, self.port)}\r\n"
            "Accept: text/plain\r\nUser-Agent: llmgw-scraper\r\n\r\n".encode()
        )
        await writer.drain()
        return await reader.readuntil(b"\r\n\r\n")

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body). Any protocol or connection error closes the connection and raises."""
        try:
            return await self._get(path)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            await self.close()
            raise HttpGetError(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            await self.close()  # cancelled mid-response: the connection is unusable
            raise

    async def _get(self, path: str) -> tuple[int, bytes]:
        reader, writer, reused = await self._connect()
        try:
            head = await self._ask(reader, writer, path)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            # A kept connection the server closed before answering (its idle close crossed
            # this request): once more on a new one. Not when it had begun to answer.
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            await self.close()
            reader, writer, _ = await self._connect()
            head = await self._ask(reader, writer, path)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        # HTTP/1.1 keeps the connection unless told not to; HTTP/1.0 closes it unless told
        # (prometheus_client's `start_http_server` answers HTTP/1.0 and closes).
        connection = headers.get("connection", "").lower()
        http10 = parts[0] == "HTTP/1.0"
        keep_alive = connection == "keep-alive" if http10 else connection != "close"
        if "content-length" in headers:
            length = int(headers["content-length"])
            if length > self.max_bytes:
                raise ValueError(f"response of {length} bytes exceeds {self.max_bytes}")
            body = await reader.readexactly(length)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked(reader)
        else:  # neither: the body ends when the server closes (HTTP/1.0 servers)
            body = await self._read_to_close(reader)
            keep_alive = False
        if not keep_alive:
            await self.close()
        return status, body

    async def _read_to_close(self, reader: asyncio.StreamReader) -> bytes:
        """Everything up to the server's close (one read returned only what had arrived:
        a page in several segments was cut, its last number read short)."""
        chunks: list[bytes] = []
        total = 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            if total > self.max_bytes:
                raise ValueError(f"response exceeds {self.max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # trailers are not used; consume the final CRLF
                return b"".join(chunks)
            total += size
            if total > self.max_bytes:
                raise ValueError(f"chunked response exceeds {self.max_bytes} bytes")
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()
