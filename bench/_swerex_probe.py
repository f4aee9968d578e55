"""Time SWE-ReX's local deployment (the peer baseline); runs in bench/.venv-swerex.

Prints one JSON line: {"create": [s...], "exec": [s...], "write": [s...]} where a
create is a deployment start plus a bash session (what a new sandbox costs there).
"""

import asyncio
import json
import sys
import tempfile
import time


async def main(runs: int) -> None:
    from swerex.deployment.local import LocalDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest, WriteFileRequest

    out: dict[str, list[float]] = {"create": [], "exec": [], "write": []}
    for _ in range(max(runs // 5, 5)):
        t = time.perf_counter()
        deployment = LocalDeployment()
        await deployment.start()
        await deployment.runtime.create_session(CreateBashSessionRequest())
        out["create"].append(time.perf_counter() - t)
        await deployment.stop()
    deployment = LocalDeployment()
    await deployment.start()
    try:
        runtime = deployment.runtime
        await runtime.create_session(CreateBashSessionRequest())
        for _ in range(3):
            await runtime.run_in_session(BashAction(command="echo hi"))
        for _ in range(runs):
            t = time.perf_counter()
            obs = await runtime.run_in_session(BashAction(command="echo hi"))
            out["exec"].append(time.perf_counter() - t)
            assert obs.output.strip() == "hi", obs
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(runs):
                t = time.perf_counter()
                await runtime.write_file(WriteFileRequest(path=f"{tmp}/f{i}", content="x" * 1024))
                out["write"].append(time.perf_counter() - t)
    finally:
        await deployment.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50))
