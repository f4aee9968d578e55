"""Policies: the weight version a trainer announces and the pause switch the dispatcher obeys."""
