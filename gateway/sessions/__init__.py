"""Sessions: gym-like handles on a sandbox (open, step, close) driven by the caller."""
