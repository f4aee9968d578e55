"""The local backend on uvloop, the loop of ``forkyard worker`` and ``forkyard gateway``.

uvloop's ``connect_read_pipe``/``connect_write_pipe`` let libuv close the file object's
descriptor and then close the file object as well (MagicStack/uvloop#763): the second close
can hit a descriptor another thread opened in between. On a node that was a new sandbox's
root directory, and the verifier's write into it failed with ENOTDIR.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import tempfile
from pathlib import Path

import pytest

from sandboxes.base import SandboxSpec
from sandboxes.local import _loop_pipe
from tests.sandboxes.conftest import BASE_REF, fresh_backend

uvloop = pytest.importorskip("uvloop")


class _Probe(io.FileIO):
    """A pipe end that notes, when closed, whether its descriptor was still its own."""

    def close(self) -> None:
        if not self.closed:
            try:
                os.fstat(self.fileno())
                self.closed_open = True
            except OSError:
                self.closed_open = False
        super().close()


@pytest.mark.parametrize("mode", ["rb", "wb"])
def test_a_pipe_handed_to_uvloop_is_closed_once(mode):
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        mine, other = (r, w) if mode == "rb" else (w, r)
        original = _Probe(mine, mode)
        given = _loop_pipe(loop, original)
        assert original.closed and original.closed_open, "the original is closed at once, while still its own"
        connect = loop.connect_read_pipe if mode == "rb" else loop.connect_write_pipe
        transport, _ = await connect(asyncio.Protocol, given)
        held = given.fileno()
        assert held != mine
        transport.close()
        await asyncio.sleep(0.01)
        # libuv closed the duplicate; the lowest free number (that one) now goes to a bystander,
        # which neither the file object's close nor its collection may close.
        bystander = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            given.close()
            del given, transport
            gc.collect()
            os.fstat(bystander)
        finally:
            os.close(bystander)
            os.close(other)

    uvloop.run(scenario())


def test_the_default_loop_gets_the_pipe_itself():
    async def scenario() -> None:
        r, w = os.pipe()
        with open(r, "rb", buffering=0) as pipe:
            assert _loop_pipe(asyncio.get_running_loop(), pipe) is pipe
        os.close(w)

    asyncio.run(scenario())


@pytest.mark.local
def test_local_sandboxes_run_and_go_on_uvloop(node_name):
    async def scenario() -> list[str]:
        created: list[str] = []
        outputs = []
        with tempfile.TemporaryDirectory(prefix="forkyard-uvloop-") as root:
            async for backend in fresh_backend("local", created, Path(root), node_name):
                infos = await asyncio.gather(*(backend.create(SandboxSpec(image=BASE_REF)) for _ in range(2)))
                outputs = [(await backend.exec(i.id, "echo $((6*7))")).stdout for i in infos]
                await asyncio.gather(*(backend.destroy(i.id) for i in infos))
        return outputs

    assert uvloop.run(scenario()) == ["42\n", "42\n"]
