"""Control plane: the HTTP API, its database, API-key auth and the ``forkyard`` CLI.

The gateway owns state and never touches a sandbox: it drives a
:class:`workers.runtime.WorkerRuntime` (in-process in embedded mode).
"""

import os

# gRPC's fork handlers are off in every process of ours (before anything imports grpc). We
# never use gRPC in a child: every fork is followed by an exec. But uvloop spawns with a plain
# fork(), so each `cp -a` of a snapshot ran them in a process serving gRPC, and they are
# reported to close descriptors behind Python's back (grpc/grpc#40136). (The descriptor a node
# did lose, a sandbox's root, was uvloop's pipe double close: sandboxes.local._loop_pipe.)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
