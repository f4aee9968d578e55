"""Tasks: content-hashed task instances of an environment, stored as archives."""
