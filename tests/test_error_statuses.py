"""One mapping from error codes to HTTP statuses (`ps_core.errors.http_status`):
every error class answers its own status through it, no code has two, and
the documents' error tables name each code under its status."""

from __future__ import annotations

import re
from typing import Any

import pytest

import app.api.server  # noqa: F401  (declares the API's errors)
import ps_core.model.events  # noqa: F401  (declares the event errors)
from app.api.errors import InvalidEventError
from app.api.openapi import openapi_document
from ps_core.errors import HTTP_CODES, PSError, http_status
from ps_core.net.shard_openapi import shard_document


def _subclasses(cls: type[PSError]) -> list[type[PSError]]:
    return [c for s in cls.__subclasses__() for c in (s, *_subclasses(s))]


PER_EVENT = {InvalidEventError}  # its code is the event's reason, set per instance


def test_every_error_class_maps_to_its_status_through_the_one_mapping() -> None:
    classes = _subclasses(PSError)
    assert len(classes) > 30  # the walk found the core's, the app's and the events' errors
    for cls in classes:
        if cls in PER_EVENT:
            continue
        assert cls.code != PSError.code, f"{cls.__qualname__} declares no code"
        assert http_status(cls.code) == cls.status, cls.__qualname__


def test_a_code_declared_with_a_second_status_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown_lease"):

        class _Elsewhere(PSError, code="unknown_lease", status=410):
            pass


def _tables(doc: dict[str, Any]) -> list[tuple[int, str]]:
    return [
        (int(status), response["description"])
        for item in doc["paths"].values()
        for op in item.values()
        if isinstance(op, dict)
        for status, response in op.get("responses", {}).items()
        if status.isdigit() and int(status) >= 400
    ]


@pytest.mark.parametrize("doc", [shard_document(), openapi_document(), openapi_document(replica=True)])
def test_the_documents_name_each_error_code_under_its_status(doc: dict[str, Any]) -> None:
    codes = {c for c in map(str, (cls.code for cls in _subclasses(PSError))) if c != PSError.code} | set(HTTP_CODES)
    named = [(status, word) for status, text in _tables(doc) for word in re.findall(r"[a-z_]+", text) if word in codes]
    assert len(named) > 10
    wrong = sorted({(word, status, http_status(word)) for status, word in named if http_status(word) != status})
    assert not wrong, wrong
