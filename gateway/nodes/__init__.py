"""Nodes: the hosts that own sandboxes, their heartbeats, load and drain switch."""
