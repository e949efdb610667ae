"""vLLM's error answers: the error object, request-validation failures, `VLLMValidationError`.

Source: vllm-protocol.md section 7 (1Cat-vLLM `entrypoints/utils.py::create_error_response`,
`openai/server_utils.py`).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered as vLLM's error object: ``{"error": {message, type, param, code}}``.

    `status` is the HTTP status and the `code`; `kind` is the `type` (section 7.2).
    """

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The error object, fields in vLLM's order."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def validation_error(*errors: dict[str, Any]) -> ApiError:
    """A FastAPI request-validation failure as vLLM answers it: 400, type "Bad Request".

    Each error is a pydantic error dict (`type`, `loc`, `msg`); the message is
    ``str(RequestValidationError)`` followed by the list of errors, like vLLM's handler.
    """
    count = len(errors)
    lines = "".join(f"\n  {e!r}" for e in errors)
    head = f"{count} validation error{'' if count == 1 else 's'}:{lines}"
    return ApiError(400, "Bad Request", f"{head} {list(errors)!r}")


def vllm_error(message: str, param: str | None, value: object) -> ApiError:
    """A `VLLMValidationError`: 400 BadRequestError, message suffixed with parameter and value."""
    return ApiError(400, "BadRequestError", f"{message} (parameter={param}, value={value})", param)


def validation_error_text(text: str) -> ApiError:
    """A validation failure raised with a plain string error (vLLM's media type check)."""
    return ApiError(400, "Bad Request", f"1 validation error:\n  {text} {[text]!r}")
