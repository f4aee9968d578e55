"""Data plane: environment families, the episode runner and policy clients.

Plain async code with no Celery import; ``workers.runtime.WorkerRuntime`` is what the
gateway's in-process executor drives in embedded mode.
"""
