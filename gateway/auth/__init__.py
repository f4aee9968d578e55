"""API keys: creation, hashing at rest, and the bearer-token dependency."""
