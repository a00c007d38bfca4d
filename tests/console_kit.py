"""The console tests' fixtures: a live service (real uvicorn, real SQLite, the real embedder) with
keys of every role for two tenants, seeded with the sample conversation, a superseded fact, a
fact with source episodes, a `<script>` memory; and Debian's chromium driven by Playwright."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from importlib.resources import files
from pathlib import Path
from typing import Any

from engram import Memory
from engram.config import Config
from engram.providers.embedders import Embedder
from engram.server import ServiceLimits, create_app
from engram.server.keys import SQLiteKeyStore
from server_kit import serve_in_thread

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCRIPT_TEXT = ('<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2">'
               " remember to water the plants")
SECRET_B = "tenant b only: the launch code is 0000"


@dataclass
class Live:
    url: str
    tokens: dict[str, str]       # "a-admin", "a-member", "a-reader", "b-admin" -> API key
    ids: dict[str, str] = field(default_factory=dict)
    app: Any = None

    def memory(self, tenant: str | None) -> Memory:
        mem: Memory = self.app.state.tenants.get(tenant)
        return mem


@contextmanager
def live_service(tmp: Path, embedder: Embedder, *, auth: bool = True) -> Iterator[Live]:
    cfg = Config(path=tmp / "data" / "engram.db")
    keys = SQLiteKeyStore(tmp / "data" / "keys.db") if auth else None
    tokens = {}
    if keys is not None:
        for tenant, role in (("a", "admin"), ("a", "member"), ("a", "reader"), ("b", "admin")):
            tokens[f"{tenant}-{role}"] = keys.create(tenant, role, f"{tenant} {role}")[1]
    app = create_app(cfg, embedder=embedder, keys=keys, auth=auth, mcp=False,
                     limits=ServiceLimits(rate=10_000, burst=10_000))
    try:
        with serve_in_thread(app) as url:
            live = Live(url, tokens, app=app)
            live.ids = seed(live.memory("a" if auth else None))
            if auth:
                live.memory("b").add(SECRET_B, user_id="ana", kind="semantic")
            yield live
    finally:
        if keys is not None:
            keys.close()


def seed(mem: Memory) -> dict[str, str]:
    """Tenant a's memories; returns the ids the tests look for."""
    data = json.loads(files("engram").joinpath("data/sample_conversation.json").read_text("utf-8"))
    user, agent = data["user_id"], data["agent_id"]
    for s in data["sessions"]:
        start = datetime.fromisoformat(s["date"])
        mem.add([{**m, "observed_at": start + timedelta(minutes=2 * i)} for i, m in enumerate(s["messages"])],
                session_id=s["session_id"], user_id=user, agent_id=agent)
    porto = mem.add("Ana lives in Porto, in a small flat near the Bolhão market.", kind="semantic",
                    importance=0.8, observed_at=datetime.fromisoformat("2024-03-04T19:00:00+00:00"),
                    user_id=user, agent_id=agent).memories[0]
    lives, *others = data["facts"]
    lisbon = mem.add(lives["text"], kind="semantic", importance=lives["importance"],
                     observed_at=datetime.fromisoformat(lives["observed_at"]), supersedes=porto.id,
                     user_id=user, agent_id=agent).memories[0]
    for fact in others:
        mem.add(fact["text"], kind="semantic", importance=fact["importance"],
                observed_at=datetime.fromisoformat(fact["observed_at"]), user_id=user, agent_id=agent)
    sourced = _sourced_fact(mem, user, agent)
    script = mem.add(SCRIPT_TEXT, kind="semantic", user_id="mallory").memories[0]
    mem.add([{"role": "user", "content": "I'm Bob and my locker code is 3141"},
             {"role": "user", "content": "I like chess"}], user_id="bob", session_id="bob-chat")
    if hasattr(mem, "relate"):  # the entity graph (Memory.relate / neighbours), where it is built
        for subject, predicate, obj in (("Ana", "lives_in", "Lisbon"), ("Ana", "works_at", "Clínica+"),
                                        ("Clínica+", "located_in", "Lisbon"), ("Ana", "sister", "Inês"),
                                        ("Inês", "lives_in", "Porto"), ("Ana", "age", 34)):
            mem.relate(subject, predicate, obj, user_id=user, agent_id=agent)
    return {"porto": porto.id, "lisbon": lisbon.id, "sourced": sourced, "script": script.id}


def _sourced_fact(mem: Memory, user: str, agent: str) -> str:
    """A fact with source episodes, as an LLM's extraction stores it (no LLM runs in these
    tests): written through the public import, which keeps provenance."""
    episode = next(m for m in mem.list(user_id=user, kinds=["episodic"], limit=100).items
                   if "vegetarian" in m.text)
    fact = mem.add("Ana was vegetarian in March 2024.", kind="semantic", user_id=user,
                   agent_id=agent, observed_at=episode.observed_at)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "export.jsonl"
        mem.export(path, user_id=user)
        lines = path.read_text("utf-8").splitlines()
        line = json.loads(next(x for x in lines[1:] if json.loads(x)["memory"]["id"] == fact.memories[0].id))
        new_id = "sourced-" + fact.memories[0].id
        line["memory"].update(id=new_id, text="Ana is vegetarian and avoids fish broth.",
                              provenance=[episode.id])
        for i, ev in enumerate(line["events"]):
            ev.update(id=f"{new_id}-ev{i}", memory_id=new_id, reason="extracted from the conversation")
            for snap in (ev.get("before"), ev.get("after")):
                if snap:
                    snap.update(id=new_id, text=line["memory"]["text"], provenance=[episode.id])
        path.write_text(lines[0] + "\n" + json.dumps(line) + "\n", "utf-8")
        mem.import_(path)
    mem.delete(fact.memories[0].id)
    return new_id
