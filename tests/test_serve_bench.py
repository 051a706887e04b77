"""benchmarks/serve_bench.py's client against a real socket server that drops connections
the way a peer may (llama-server closes kept-alive connections on its own schedule)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import serve_bench

CHUNKS = ["Hel", "lo", "!"]


def sse_response() -> bytes:
    events = [{"choices": [{"index": 0, "text": text}]} for text in CHUNKS]
    events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return (head + body).encode()


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)


async def run_against(
    drops: int, drop_after_first_chunk: bool = False
) -> serve_bench.RequestRecord:
    """One request to a server whose first `drops` connections close after reading the
    request (without a byte of response, or after the first chunk)."""
    seen = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        await read_request(reader)
        if seen <= drops:
            if drop_after_first_chunk:
                # Headers and the first event, then the connection ends mid-body.
                writer.write(sse_response()[:200])
                await writer.drain()
            writer.close()
            return
        writer.write(sse_response())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    args = argparse.Namespace(
        model="m", output_len=3, forbid_tokens=None, base_url=f"http://127.0.0.1:{port}"
    )
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            return await serve_bench.one_request(client, args, [1, 2, 3])
    finally:
        server.close()
        await server.wait_closed()


def test_a_request_dropped_before_any_response_is_sent_once_more() -> None:
    record = asyncio.run(run_against(drops=1))
    assert record.error is None and record.retried
    assert record.output_tokens == 3 and record.ttft is not None and len(record.itls) == 2
    summary = serve_bench.summarise([record, serve_bench.RequestRecord(prompt_tokens=3)], 1.0)
    assert summary["retried"] == 1


def test_a_second_drop_is_an_error() -> None:
    record = asyncio.run(run_against(drops=2))
    assert record.retried and record.error is not None
    assert record.error.startswith("RemoteProtocolError")


def test_a_drop_after_the_first_token_is_not_sent_again() -> None:
    """The server has begun to answer: sending it again would count its work twice."""
    record = asyncio.run(run_against(drops=1, drop_after_first_chunk=True))
    assert not record.retried and record.error is not None
