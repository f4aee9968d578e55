"""The sessions' step channel over gRPC (``sessions.proto``), served beside the REST API."""
