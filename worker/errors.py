"""The exceptions mxserve raises for bad input.

- `InvalidRequestError`: a request (prompt or sampling parameters) is wrong; `field` names what.
  The engine rejects such a request at `add_request` and keeps serving the others. The gRPC layer
  maps it to INVALID_ARGUMENT.
- `ModelLoadError`: a checkpoint is missing, corrupt or of an architecture mxserve cannot run.
"""

from __future__ import annotations


class MxserveError(Exception):
    """Base class of every error mxserve raises on purpose."""


class InvalidRequestError(MxserveError, ValueError):
    """A request field is out of range or of the wrong type.

    Attributes:
        field: the offending field, e.g. "temperature", "prompt", "stop".
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(MxserveError):
    """A checkpoint could not be loaded (missing or corrupt files, unsupported architecture)."""
