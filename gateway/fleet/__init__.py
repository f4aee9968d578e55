"""The distributed mode: gateways schedule episode jobs over Celery + Redis onto worker nodes."""

from __future__ import annotations

import asyncio


def event_loop() -> asyncio.AbstractEventLoop:
    """Return a new event loop for a distributed-mode process: uvloop's where it is installed.

    The node channel is a stream of small gRPC messages, each a handful of loop wake-ups
    on both ends; on uvloop a call's round trip takes about half as long (0.45 ms against
    0.95 ms on this project's 2-core machine). ``forkyard up`` keeps asyncio's loop.
    """
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it on Linux; elsewhere asyncio's loop serves
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
