"""Control plane: the HTTP API, its database, API-key auth and the ``forkyard`` CLI.

The gateway owns state and never touches a sandbox: it drives a
:class:`workers.runtime.WorkerRuntime` (in-process in embedded mode).
"""
