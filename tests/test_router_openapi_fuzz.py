"""Schemathesis against a live router (the real app on uvicorn, stand-in workers): every operation of
its OpenAPI document, valid and invalid requests generated from the document with a fixed seed and a
bounded number of examples. No answer may be a 5xx, nor contradict the document (a status, content
type, header or body it does not list; an invalid request accepted; a wrong method without 405 and
`Allow`). The statuses seen are printed with `-s`.

Not checked: that every schema-valid request is accepted (`positive_data_acceptance`). The document
cannot say what the router refuses beyond the schema (a prompt longer than the model's context, an
unknown model, token ids outside the vocabulary, a stop string list that is empty), so those are
400s (or 404s) that the document lists."""

from __future__ import annotations

import collections

import pytest
import router_stand_in as stand_in
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from router.app import create_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, unsupported_method, allow_header_conformance]
SEEN: collections.Counter = collections.Counter()  # (method path, status) -> answers


CONFIG = {"seed": 20261130, "generation": {"mode": "all", "max-examples": 40, "database": "none"},
          "phases": {"stateful": {"enabled": False}}}
# The document the router serves at /openapi.json (test_router_app.py checks it is served as is),
# read at collection time: the fuzzer makes one test per operation before any server runs.
schema = schemathesis.openapi.from_dict(create_app(stand_in.state()).openapi(),
                                        config=schemathesis.Config.from_dict(CONFIG))


@pytest.fixture(scope="module")
def router_url():
    with stand_in.served(stand_in.state()) as url:
        yield url
    statuses = collections.Counter()
    for (operation, status), count in sorted(SEEN.items()):
        statuses[status] += count
        if not operation.startswith(("OPTIONS", "PUT", "PATCH", "DELETE", "TRACE", "QUERY")):
            print(f"\n{operation} -> {status}: {count}", end="")
    print(f"\n{sum(SEEN.values())} requests; statuses: {dict(sorted(statuses.items()))}")


@schema.parametrize()
def test_the_router_answers_as_its_openapi_document_says(case, router_url):
    response = case.call_and_validate(base_url=router_url, checks=CHECKS)
    SEEN[f"{case.method} {case.path}", response.status_code] += 1
