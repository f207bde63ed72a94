"""The one exception tree of vlmserve.

Every error a client can cause is a subclass of ``VlmserveError`` and carries the
HTTP status, OpenAI error ``type`` and ``code`` it maps to; ``api/errors.py`` turns
it into ``{"error": {"message", "type", "param", "code"}}`` in one place.

    VlmserveError                      500 internal_error (never raised directly for client faults)
    ├── InvalidRequest                 400 invalid_request_error
    │   ├── MediaError                 400 media could not be read or decoded
    │   ├── MediaBlocked               400 the URL or path is outside the fetch policy
    │   └── UnsupportedFeature         400 a feature this server or model does not offer
    ├── AuthenticationError            401
    ├── NotFound                       404 unknown model, session, ...
    ├── RequestTimeout                 408 media preprocessing over its time limit
    ├── PayloadTooLarge                413 body, media item, pixels, frames over a limit
    ├── Overloaded                     429 queue full
    ├── ServiceUnavailable             503 model not ready; carries Retry-After
    └── ConfigError                    a bad setting found at start-up (not an HTTP error)
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "InvalidRequest",
    "MediaBlocked",
    "MediaError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "ServiceUnavailable",
    "UnsupportedFeature",
    "VlmserveError",
]


class VlmserveError(Exception):
    status_code: int = 500
    error_type: str = "internal_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidRequest(VlmserveError):
    status_code = 400
    error_type = "invalid_request_error"


class MediaError(InvalidRequest):
    default_code = "invalid_media"


class MediaBlocked(InvalidRequest):
    default_code = "media_url_blocked"


class UnsupportedFeature(InvalidRequest):
    default_code = "unsupported_feature"


class AuthenticationError(VlmserveError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(VlmserveError):
    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class RequestTimeout(VlmserveError):
    status_code = 408
    error_type = "invalid_request_error"
    default_code = "media_timeout"


class PayloadTooLarge(VlmserveError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class Overloaded(VlmserveError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: str | None):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServiceUnavailable(VlmserveError):
    status_code = 503
    error_type = "service_unavailable"
    default_code = "model_not_ready"

    def __init__(self, message: str, *, retry_after: float = 5.0, **kw: str | None):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ConfigError(VlmserveError):
    """A setting or model source that makes start-up impossible; the message says how to fix it."""

    error_type = "config_error"
