"""Environment families (``terminal`` today; ``swe`` and ``web`` follow)."""
