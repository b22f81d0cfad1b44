"""Check a live response of the HTTP side against the server's own OpenAPI document."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator


def api_paths(openapi: dict[str, Any]) -> set[str]:
    """The GET paths under /api/ that the document lists."""
    return {path for path, ops in openapi["paths"].items()
            if path.startswith("/api/") and "get" in ops}


def response_errors(openapi: dict[str, Any], path: str, body: Any) -> list[str]:
    """Every way ``body`` breaks the 200 response schema of ``GET path`` ([] when valid)."""
    content = openapi["paths"][path]["get"]["responses"]["200"]["content"]
    schema = {**content["application/json"]["schema"], "components": openapi["components"]}
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(body)]
