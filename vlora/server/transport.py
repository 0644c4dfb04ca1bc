"""How uvicorn runs the app: its HTTP protocol, with a bound on the request header block.

uvicorn's default HTTP parser (httptools, picked when it is installed: it is a dependency of vlora for its
speed) accepts a header block of any size: a client can make the server buffer megabytes of headers before
the app sees the request. :class:`LimitedHttpTools` refuses a request whose request line and headers
together exceed :data:`MAX_HEADER_BYTES` (64 KiB) with ``431 Request Header Fields Too Large`` and closes the
connection. Where httptools is missing, uvicorn's h11 parser is used with its own bound
(``h11_max_incomplete_event_size``), which answers 400.

The count is the bytes of the request line's target and each header's name and value (plus 4 per header for
``": "`` and the line end); a header still arriving is bounded too (the bytes of reads that begin and end
inside one header block), so one endless header value cannot grow the buffer more than a read past the bound.
"""

from __future__ import annotations

import json

MAX_HEADER_BYTES = 64 * 1024


class _HeadTooLarge(Exception):
    pass


def _protocol_class():
    """The HTTP protocol for uvicorn: httptools with the header bound, or None (h11) without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:         # no httptools
        return None

    class LimitedHttpTools(HttpToolsProtocol):
        max_header_bytes = MAX_HEADER_BYTES

        def connection_made(self, transport) -> None:
            self._head_fields = 0       # bytes of the current request's target and complete headers
            self._head_raw = 0          # bytes of chunks that ended inside the current header block
            self._in_head = True        # no header block completed since the last request (or the start)
            self._heads = 0             # header blocks completed on this connection
            self._refused = False
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            was_in_head, heads = self._in_head, self._heads
            super().data_received(data)
            if self._refused or self.transport.is_closing():
                return
            # a chunk that began and ended inside one header block (none completed meanwhile) is header bytes
            # all through; one that completed a block is not counted (its part of the next block, if any, is
            # bounded by the complete headers' count once they arrive)
            if was_in_head and self._in_head and self._heads == heads:
                self._head_raw += len(data)
                if self._head_raw > self.max_header_bytes:
                    self._refuse()

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._count(len(name) + len(value) + 4)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads += 1
            self._head_fields = self._head_raw = 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True        # the next bytes begin the next request's header block
            super().on_message_complete()

        def _count(self, size: int) -> None:
            self._head_fields += size
            if self._head_fields > self.max_header_bytes:
                self._refused = True
                raise _HeadTooLarge()   # stops the parser; uvicorn answers through send_400_response

        def send_400_response(self, msg: str) -> None:
            if self._refused:
                self._refuse()
            else:
                super().send_400_response(msg)

        def _refuse(self) -> None:
            """431 with an OpenAI-shaped error body, then close (written only while no response is under way)."""
            self._refused = True
            if self.transport.is_closing():
                return
            self.logger.warning("Request header block larger than %d bytes: refused (431).", self.max_header_bytes)
            if self.cycle is None or self.cycle.response_complete:
                body = json.dumps({"error": {
                    "message": f"the request's header block is larger than {self.max_header_bytes} bytes",
                    "type": "invalid_request_error", "param": None,
                    "code": "request_header_fields_too_large"}}).encode()
                head = [b"HTTP/1.1 431 Request Header Fields Too Large\r\n"]
                for name, value in self.server_state.default_headers:
                    head += [name, b": ", value, b"\r\n"]
                head += [b"content-type: application/json\r\n",
                         b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n\r\n"]
                self.transport.write(b"".join(head) + body)
            self.transport.close()

    return LimitedHttpTools


def uvicorn_config(app, **kwargs):
    """A ``uvicorn.Config`` for ``app`` with vlora's HTTP protocol and header bound; ``kwargs`` go to it."""
    import uvicorn

    protocol = _protocol_class()
    if protocol is None:
        kwargs.setdefault("http", "h11")
    else:
        kwargs.setdefault("http", protocol)
    kwargs.setdefault("h11_max_incomplete_event_size", MAX_HEADER_BYTES)
    return uvicorn.Config(app, **kwargs)
