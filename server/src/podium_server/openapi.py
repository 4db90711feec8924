"""The request bodies in ``/openapi.json``, declared from the protocol models.

The generating handlers read the raw body themselves (its size and nesting are bounded before it
is parsed, and errors take OpenAI's shape), so FastAPI sees no body parameter and would declare
none. ``declare_request_bodies`` adds each route's body schema, generated from its pydantic model,
so schema-driven fuzzers and client generators see the real request shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def declare_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Declare ``bodies`` (POST path -> request model) in the app's OpenAPI document (adds to earlier calls)."""
    declared: dict[str, type[BaseModel]] = getattr(app.state, "request_bodies", {})
    declared.update(bodies)
    app.state.request_bodies = declared

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in declared.items():
                body = model.model_json_schema(ref_template=_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                operation = schema["paths"][path]["post"]
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": _REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
