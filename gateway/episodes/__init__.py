"""Episodes: one agent run on one task sample, its steps and its token-exact training view."""
