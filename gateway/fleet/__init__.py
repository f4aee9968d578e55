"""The distributed mode: gateways schedule episode jobs over Celery + Redis onto worker nodes."""

from __future__ import annotations

import asyncio


def event_loop() -> asyncio.AbstractEventLoop:
    """Return a new event loop for a distributed-mode process: uvloop's where it is installed.

    A step through a node wakes the loops of the gateway and the node several times (the
    node channel's frames, the sandbox shell's pipes), and a wake-up costs less on uvloop;
    with the node channel on gRPC it halved a call's round trip (0.45 ms against 0.95 ms
    on this project's 2-core machine). ``forkyard up`` keeps asyncio's loop.
    """
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it on Linux; elsewhere asyncio's loop serves
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
