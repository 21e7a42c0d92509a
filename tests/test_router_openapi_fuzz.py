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
import contextlib

import pytest
import router_stand_in as stand_in
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from router.app import create_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, unsupported_method, allow_header_conformance]
KEY = "k3y"
SEEN: collections.Counter = collections.Counter()  # (router, method path, status) -> answers


def document(router_state, max_examples: int):
    """The document the router for `router_state` serves (FastAPI serves `app.openapi()` at
    /openapi.json), read at collection time: the fuzzer makes one test per operation before any
    server runs."""
    config = {"seed": 20261130, "generation": {"mode": "all", "max-examples": max_examples, "database": "none"},
              "phases": {"stateful": {"enabled": False}}}
    return schemathesis.openapi.from_dict(create_app(router_state).openapi(),
                                          config=schemathesis.Config.from_dict(config))


schema = document(stand_in.state(), 40)
keyed_schema = document(stand_in.state(api_key=KEY), 5)  # what the key adds: 401s, security


@contextlib.contextmanager
def served(name: str, **options):
    with stand_in.served(stand_in.state(**options)) as url:
        yield url
    statuses = collections.Counter()
    for (router, operation, status), count in sorted(SEEN.items()):
        if router == name:
            statuses[status] += count
            if not operation.startswith(("OPTIONS", "PUT", "PATCH", "DELETE", "TRACE", "QUERY")):
                print(f"\n{name}: {operation} -> {status}: {count}", end="")
    print(f"\n{name}: {sum(statuses.values())} requests; statuses: {dict(sorted(statuses.items()))}")


@pytest.fixture(scope="module")
def router_url():
    with served("router") as url:
        yield url


@pytest.fixture(scope="module")
def keyed_router_url():
    with served("keyed router", api_key=KEY) as url:
        yield url


@schema.parametrize()
def test_the_router_answers_as_its_openapi_document_says(case, router_url):
    response = case.call_and_validate(base_url=router_url, checks=CHECKS)
    SEEN["router", f"{case.method} {case.path}", response.status_code] += 1


@keyed_schema.parametrize()
def test_with_an_api_key_the_router_answers_as_its_document_says(case, keyed_router_url):
    # ignored_auth: a request that succeeded with the key is sent again without it, and with a wrong one
    response = case.call_and_validate(base_url=keyed_router_url, headers={"Authorization": f"Bearer {KEY}"},
                                      checks=[*CHECKS, ignored_auth])
    SEEN["keyed router", f"{case.method} {case.path}", response.status_code] += 1
