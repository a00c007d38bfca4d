"""The knowledge graph over REST (server/graph.py): the routes' shapes, OpenAPI, and the
tenant-isolation matrix on both backends: tenant B never sees or touches tenant A's graph."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engram.providers.embedders import MiniLM
from server_kit import Service, service

SECRET = "Canaryperson Bluedoor"


@pytest.fixture(params=["sqlite", "postgres"])
def any_svc(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLM) -> Iterator[Service]:
    url = None
    if request.param == "postgres":
        url = request.getfixturevalue("pg_server").database_for(tmp_path)
    with service(tmp_path, embedder, database_url=url) as s:
        yield s


def relate(svc: Service, who: str, **body: Any) -> dict[str, Any]:
    r = svc.call(who, "POST", "/v1/relations", json=body)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def test_graph_routes_and_cross_tenant_matrix(any_svc: Service) -> None:
    svc = any_svc
    old = relate(svc, "a-member", subject=SECRET, predicate="works_at", object="Acme",
                 valid_from="2020-01-01T00:00:00+00:00", user_id="u1")
    new = relate(svc, "a-member", subject=SECRET, predicate="works at", object="Globex",
                 valid_from="2023-01-01T00:00:00+00:00", user_id="u1")
    relate(svc, "a-member", subject="Globex", predicate="located_in", object="Lisbon", user_id="u1")
    assert {"id", "subject", "predicate", "object", "valid_from", "valid_to"} <= set(new)
    assert (new["subject"], new["predicate"], new["object"]) == (SECRET, "works_at", "Globex")

    a = "a-member"
    now = svc.call(a, "GET", "/v1/relations", params={"subject": SECRET, "user_id": "u1"}).json()
    assert [r["object"] for r in now["items"]] == ["Globex"]
    then = svc.call(a, "GET", "/v1/relations", params={
        "subject": SECRET, "predicate": "works_at", "as_of": "2021-06-01T00:00:00+00:00",
        "user_id": "u1"}).json()
    assert [r["id"] for r in then["items"]] == [old["id"]]
    ents = svc.call(a, "GET", "/v1/entities", params={"user_id": "u1"}).json()["items"]
    assert {e["name"] for e in ents} == {SECRET, "Acme", "Globex", "Lisbon"}
    eid = next(e["id"] for e in ents if e["name"] == SECRET)
    prof = svc.call(a, "GET", f"/v1/entities/{eid}").json()
    assert prof["name"] == SECRET and [r["object"] for r in prof["relations"]] == ["Globex"]
    hood = svc.call(a, "GET", "/v1/graph/neighbours",
                    params={"name": SECRET, "depth": 2, "user_id": "u1"}).json()
    assert {e["name"] for e in hood["entities"]} == {SECRET, "Globex", "Lisbon"}
    assert {"id", "name", "type"} <= set(hood["entities"][0])
    path = svc.call(a, "GET", "/v1/graph/path", params={"a": SECRET, "b": "Lisbon"}).json()
    assert [r["predicate"] for r in path["relations"]] == ["works_at", "located_in"]
    bad = svc.call(a, "GET", "/v1/graph/neighbours", params={"name": SECRET, "depth": 9})
    assert bad.status_code == 422

    seen: list[str] = []
    for who in ("b-member", "b-admin"):
        for url, params in ((f"/v1/entities/{eid}", {}), ("/v1/graph/neighbours", {"name": SECRET}),
                            ("/v1/graph/path", {"a": SECRET, "b": "Acme"})):
            r = svc.call(who, "GET", url, params=params)
            assert r.status_code == 404, (who, url, r.text)
            seen.append(r.text)
        for url, params in (("/v1/entities", {}), ("/v1/entities", {"query": "Canaryperson"}),
                            ("/v1/relations", {}), ("/v1/relations", {"history": True}),
                            ("/v1/relations", {"subject": SECRET})):
            r = svc.call(who, "GET", url, params=params)
            assert r.status_code == 200 and r.json()["items"] == [], (who, url, r.text)
            seen.append(r.text)
        r = svc.call(who, "POST", "/v1/relations/end", json={"subject": SECRET, "predicate": "works_at"})
        assert r.status_code == 404
        seen.append(r.text)
        for target in (eid, SECRET):  # nor delete it, by id or by name
            r = svc.call(who, "DELETE", f"/v1/entities/{target}")
            assert r.status_code == 404, (who, r.text)
            seen.append(r.text)
    for text in seen:  # a 404 names what was asked for, never what A holds
        assert "Globex" not in text and "Lisbon" not in text and new["id"] not in text
    # A's graph is as it was
    still = svc.call(a, "GET", "/v1/relations", params={"subject": SECRET}).json()["items"]
    assert [r["object"] for r in still] == ["Globex"] and still[0]["valid_to"] is None

    # A deletes an entity: its relations go with it, and it answers what went
    globex = next(e["id"] for e in ents if e["name"] == "Globex")
    gone = svc.call(a, "DELETE", f"/v1/entities/{globex}", params={"user_id": "u1"})
    assert gone.status_code == 200, gone.text
    body = gone.json()
    assert [e["name"] for e in body["entities"]] == ["Globex"]
    assert {(r["subject"], r["object"]) for r in body["relations"]} == {(SECRET, "Globex"),
                                                                       ("Globex", "Lisbon")}
    assert svc.call(a, "GET", f"/v1/entities/{globex}").status_code == 404
    assert svc.call(a, "DELETE", f"/v1/entities/{globex}").status_code == 404
    left = svc.call(a, "GET", "/v1/relations", params={"history": True}).json()["items"]
    assert [r["object"] for r in left] == ["Acme"]


def test_the_graph_routes_are_in_openapi(any_svc: Service) -> None:
    doc = any_svc.client.get("/openapi.json").json()
    for route in ("/v1/entities", "/v1/entities/{id}", "/v1/relations", "/v1/relations/end",
                  "/v1/graph/neighbours", "/v1/graph/path"):
        assert route in doc["paths"], route
    assert "post" in doc["paths"]["/v1/relations"]
    assert "delete" in doc["paths"]["/v1/entities/{id}"]
