"""The exceptions mxserve raises on purpose, and the gRPC status a serving request ends with.

- `InvalidRequestError`: a request (prompt or sampling parameters) is wrong; `field` names what.
  The engine rejects such a request at `add_request` and keeps serving the others. The gRPC layer
  maps it to INVALID_ARGUMENT.
- `ModelLoadError`: a checkpoint is missing, corrupt or of an architecture mxserve cannot run.
- `UnavailableError`: the engine has failed for good (a tensor-parallel rank died): UNAVAILABLE.
- `ServeError`: a serving request failed with a status the client should get. `code` is a gRPC
  status code name; the router's Serve wrapper sets it on the call. It pickles by value, so a
  worker replica can raise it and the router receives it intact.
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


class UnavailableError(MxserveError):
    """The engine can serve no request any more (a tensor-parallel rank failed); another
    worker can. The gRPC layer maps it to UNAVAILABLE (retriable)."""


class WorkerLostError(MxserveError):
    """The worker serving a request went away (its process died, or Serve stopped it) before
    the request finished: the router goes on with it on another worker."""

    def __init__(self, message: str, worker_id: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id


INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAUTHENTICATED = "UNAUTHENTICATED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
# Ends of a request the client caused or chose: logged in one line, never as server errors.
CLIENT_STATUSES = ("cancelled", INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
                   UNAUTHENTICATED)


class ServeError(MxserveError):
    """A request failed with a status the client should get.

    Attributes:
        code: a gRPC status code name, e.g. "INVALID_ARGUMENT".
        message: what went wrong; for INVALID_ARGUMENT it starts with the field's name.
        field: the offending request field, when there is one.
    """

    def __init__(self, code: str, message: str, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field
        self.retry_after_s = retry_after_s  # when to retry (RESOURCE_EXHAUSTED), if known

    def __reduce__(self):
        return type(self), (self.code, self.message, self.field, self.retry_after_s)

    @classmethod
    def invalid(cls, error: InvalidRequestError) -> ServeError:
        return cls(INVALID_ARGUMENT, str(error), error.field)


def as_serve_error(error: BaseException) -> ServeError | None:
    """The ServeError that `error` is or wraps (a Ray task error keeps it as `.cause`), if any;
    an InvalidRequestError becomes INVALID_ARGUMENT."""
    for e in (error, getattr(error, "cause", None), error.__cause__):
        if isinstance(e, ServeError):
            return ServeError(e.code, e.message, e.field, e.retry_after_s)
        if isinstance(e, InvalidRequestError):
            return ServeError.invalid(e)
        if isinstance(e, UnavailableError):
            return ServeError(UNAVAILABLE, str(e))
    return None
