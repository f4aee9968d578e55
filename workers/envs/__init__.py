"""Environment families: the contract (:mod:`~workers.envs.base`), the registry, and the built-in families.

``terminal`` today (Harbor-style task directories driven through bash); ``swe`` and
``web`` follow. See :mod:`workers.envs.registry` for adding one.
"""
