"""The operator token on the HTTP side ([auth] operator_token_env), presented as
``Authorization: Bearer <operator token>``: every write needs it, and a read that carries it
sees what only the operator may (why a client was excluded).

    refusal = operator_refusal(request.headers.get("authorization"), token)  # None: allowed
    def route(operator: bool = Depends(operator_reader(token))): ...         # a read
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Header, HTTPException

from matformer.protocol.auth import tokens_equal


def operator_refusal(authorization: str | None, operator_token: str | None
                     ) -> tuple[int, str] | None:
    """(status, message) refusing a request with this Authorization header, or None to allow."""
    if operator_token is None:
        return 403, ("this run has no operator token, so its HTTP side is read-only; set "
                     "[auth] operator_token_env (or operator_token) in run.toml and restart "
                     "the server.")
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return 401, ("changing the run (or reading what only the operator sees) needs the "
                     "operator token: send the header 'Authorization: Bearer <operator token>'.")
    if not tokens_equal(presented.strip(), operator_token):
        return 403, "wrong operator token in the Authorization header."
    return None


def operator_reader(operator_token: str | None) -> Callable[..., bool]:
    """A FastAPI dependency for reads: False without an Authorization header (the public
    view), True with the operator token; any other header is refused as a write would be, so
    a mistyped token is not mistaken for the public view."""

    def is_operator(authorization: str | None = Header(
            None, description="'Bearer <operator token>': also show what only the operator "
                              "sees (why clients were excluded)")) -> bool:
        if authorization is None:
            return False
        refusal = operator_refusal(authorization, operator_token)
        if refusal is not None:
            status, detail = refusal
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            raise HTTPException(status_code=status, detail=detail, headers=headers)
        return True

    return is_operator
