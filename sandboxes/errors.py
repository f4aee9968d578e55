"""Exceptions raised by sandbox backends; every one derives from :class:`SandboxError`."""


class SandboxError(Exception):
    """Root of every error a sandbox backend raises."""


class BackendUnavailableError(SandboxError):
    """The backend cannot run on this host (no daemon, not root, no overlayfs...)."""


class SandboxNotFoundError(SandboxError):
    """No live sandbox has this id on this backend."""


class ImageNotFoundError(SandboxError):
    """The image reference is not known to the backend."""


class PathEscapeError(SandboxError):
    """A file path points outside the sandbox's root filesystem."""


class SandboxCrashedError(SandboxError):
    """The sandbox's shell or init died and could not be restarted."""


class FileTooLargeError(SandboxError):
    """A file read with a size cap is bigger than the cap."""
