"""A request's output constraint, from whichever field names it, as the engine's ``StructuredOutputsParams``.

The fields, OpenAI's first: ``response_format`` (``json_object``; ``json_schema`` with its ``schema``,
enforced whether or not ``strict``), vLLM's ``structured_outputs`` object, and vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with
``guided_decoding_backend``). A request may name one constraint; two are a 400 naming both. The
engine checks the constraint itself (a schema that does not compile, a bad regex) and its
``InvalidParameter`` becomes a 400 that says what is wrong.
"""

from __future__ import annotations

from podium.sampling_params import StructuredOutputsParams

from .errors import bad_request
from .protocol import ResponseFormat, SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "backend")


def from_response_format(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema (a JSON schema object)",
                          param="response_format.json_schema")
    return StructuredOutputsParams(json=spec.schema_)


def from_vllm_fields(req: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    """The constraints named by vLLM's extra fields, each with the field that named it."""
    found = []
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(_FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs has unknown field(s) {', '.join(unknown)}; it takes "
                              f"{', '.join(_FIELDS)}", param="structured_outputs")
        found.append(("structured_outputs", StructuredOutputsParams(**req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{kind: value}, backend=req.guided_decoding_backend)))
    return found


def structured_outputs(req: SamplingFields, *others: tuple[str, StructuredOutputsParams | None]) -> \
        StructuredOutputsParams | None:
    """The one constraint of ``req`` (``others``: constraints named by other fields, such as
    ``response_format`` or ``tool_choice``), or None; a 400 if several fields name one."""
    found = [(name, p) for name, p in (*others, *from_vllm_fields(req)) if p is not None]
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} each constrain the output; give only one", param=found[1][0])
    if not found:
        return None
    name, params = found[0]
    try:
        params.kind()
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from None
    return params

