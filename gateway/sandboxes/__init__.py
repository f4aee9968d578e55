"""The sandbox fleet as the gateway sees it: records of sandboxes and the live listing."""
