"""`EngramStore`: LangGraph's long-term memory store (`BaseStore`) over engram memories, so
LangGraph agents, LangMem's memory tools and engram's own faces share one database.

An item `(namespace, key) -> value` is one engram memory: an episode (a stored document, never
merged with a similar one: a key-value store keeps every key) of the scope
`agent_id=<the store's agent_id>` (and `user_id=namespace[user_at]` when `user_at` is given),
whose text is the item's indexed text and whose metadata holds the namespace, key and value.
Search with a `query` is engram's hybrid search; a `ttl` is the memory's `expires_at`.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from engram import AsyncMemory, InvalidInput, Memory, MemoryRecord, NotFound
from engram.model import utcnow

from .. import missing, sync_memory

try:
    from langgraph.store.base import (
        BaseStore,
        GetOp,
        IndexConfig,
        Item,
        ListNamespacesOp,
        MatchCondition,
        Op,
        PutOp,
        Result,
        SearchItem,
        SearchOp,
        TTLConfig,
    )
    from langgraph.store.base.embed import get_text_at_path
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langgraph", exc) from exc

# metadata keys of a store item's memory
NAMESPACE = "lg_namespace"  # the namespace as a JSON list (exact match)
LEVEL = "lg_ns{}"           # each label, for prefix filters in the database
KEY = "lg_key"
VALUE = "lg_value"
TTL = "lg_ttl"              # minutes, refreshed on read
INDEXED = "lg_indexed"
ROLE = "document"           # the stored memories' role: what `context` shows as the speaker
PAGE = 1000


# -- pure helpers ------------------------------------------------------------------------------

def text_of(value: Mapping[str, Any], fields: Sequence[str] | None) -> str:
    """The text engram indexes for a value: the given fields (LangGraph's path syntax), or every
    string in the value (LangMem's `{"content": ...}` gives just the content)."""
    if fields and fields != ["$"]:
        parts = [t for f in fields for t in get_text_at_path(value, f)]
    else:
        parts = list(_strings(value))
    text = "\n".join(p for p in parts if p.strip())
    return text or json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _compare(actual: Any, wanted: Any) -> bool:
    if isinstance(wanted, Mapping):
        if any(str(k).startswith("$") for k in wanted):
            return all(_operator(actual, op, v) for op, v in wanted.items())
        return isinstance(actual, Mapping) and all(_compare(actual.get(k), v) for k, v in wanted.items())
    return bool(actual == wanted)


def _operator(actual: Any, op: str, wanted: Any) -> bool:
    if op == "$eq":
        return bool(actual == wanted)
    if op == "$ne":
        return bool(actual != wanted)
    if op in ("$gt", "$gte", "$lt", "$lte"):
        try:
            return bool({"$gt": actual > wanted, "$gte": actual >= wanted,
                         "$lt": actual < wanted, "$lte": actual <= wanted}[op])
        except TypeError:
            return False
    raise InvalidInput(f"unsupported filter operator {op!r}: use $eq, $ne, $gt, $gte, $lt, $lte")


def matches(value: Mapping[str, Any], filter: Mapping[str, Any] | None) -> bool:
    """LangGraph's filter semantics: exact matches (nested too) and $eq/$ne/$gt/$gte/$lt/$lte."""
    return all(_compare(value.get(k), v) for k, v in (filter or {}).items())


def namespace_matches(namespace: tuple[str, ...], condition: MatchCondition) -> bool:
    path = tuple(condition.path)
    if len(namespace) < len(path):
        return False
    pairs = (zip(namespace, path, strict=False) if condition.match_type == "prefix"
             else zip(reversed(namespace), reversed(path), strict=False))
    return all(p == "*" or n == p for n, p in pairs)


def list_namespaces(namespaces: Iterable[tuple[str, ...]], op: ListNamespacesOp) -> list[tuple[str, ...]]:
    found = {ns for ns in namespaces
             if all(namespace_matches(ns, c) for c in op.match_conditions or ())}
    if op.max_depth is not None:
        found = {ns[: op.max_depth] for ns in found}
    return sorted(found)[op.offset: op.offset + op.limit]


# -- the store ---------------------------------------------------------------------------------

class EngramStore(BaseStore):
    """LangGraph's `BaseStore` over engram: `create_agent(..., store=EngramStore(mem))`.

    `agent_id` scopes every item (one engram database can hold several apps' stores);
    `user_at` names the namespace position that is the engram `user_id` (LangMem's
    `("memories", "{langgraph_user_id}")` is `user_at=1`), so the items are also the user's
    memories in `Memory.search` / `Memory.context`. `index={"fields": [...]}` chooses what text
    is indexed (default: every string in the value). TTLs are in minutes, as in LangGraph.
    """

    supports_ttl = True

    def __init__(self, memory: Memory | AsyncMemory, *, agent_id: str = "langgraph",
                 user_at: int | None = None, index: IndexConfig | None = None,
                 ttl: TTLConfig | None = None) -> None:
        self.memory = sync_memory(memory)
        if not isinstance(agent_id, str) or not agent_id:
            raise InvalidInput("agent_id must be a non-empty string")
        if user_at is not None and (isinstance(user_at, bool) or not isinstance(user_at, int)
                                    or user_at < 0):
            raise InvalidInput("user_at must be a namespace position (an integer >= 0)")
        self.agent_id = agent_id
        self.user_at = user_at
        self.index_config = index
        self.ttl_config = ttl

    # scope and metadata ------------------------------------------------------------------------

    def _user(self, namespace: tuple[str, ...]) -> str | None:
        if self.user_at is None or len(namespace) <= self.user_at:
            return None
        return namespace[self.user_at]

    def _prefix_filter(self, prefix: tuple[str, ...]) -> dict[str, Any]:
        return {LEVEL.format(i): label for i, label in enumerate(prefix)}

    def _records(self, prefix: tuple[str, ...], filters: Mapping[str, Any]) -> Iterator[MemoryRecord]:
        cursor = None
        while True:
            page = self.memory.list(agent_id=self.agent_id, user_id=self._user(prefix),
                                    filters={**self._prefix_filter(prefix), **filters},
                                    kinds=["episodic"], cursor=cursor, limit=PAGE)
            yield from (r for r in page.items if KEY in r.metadata)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def _find(self, namespace: tuple[str, ...], key: str) -> MemoryRecord | None:
        ns = json.dumps(list(namespace), ensure_ascii=False)
        return next(self._records(namespace, {NAMESPACE: ns, KEY: key}), None)

    @staticmethod
    def _item(rec: MemoryRecord, score: float | None = None, search: bool = False) -> Item:
        meta = rec.metadata
        fields = {"namespace": tuple(json.loads(meta[NAMESPACE])), "key": meta[KEY],
                  "value": meta[VALUE], "created_at": rec.created_at, "updated_at": rec.updated_at}
        return SearchItem(**fields, score=score) if search else Item(**fields)

    def _refresh(self, rec: MemoryRecord, refresh: bool) -> None:
        ttl = rec.metadata.get(TTL)
        if refresh and isinstance(ttl, int | float):
            self.memory.update(rec.id, expires_at=utcnow() + timedelta(minutes=ttl),
                               agent_id=self.agent_id)

    # the operations ----------------------------------------------------------------------------

    def _get(self, op: GetOp) -> Item | None:
        rec = self._find(op.namespace, op.key)
        if rec is None:
            return None
        self._refresh(rec, op.refresh_ttl)
        return self._item(rec)

    def _document(self, op: PutOp) -> tuple[dict[str, Any], Any]:
        """The engram message of a put (its text, metadata) and its expiry."""
        assert op.value is not None
        if op.index is False:
            fields: list[str] | None = None
        else:
            fields = op.index or (self.index_config or {}).get("fields")
        value = dict(op.value)
        meta: dict[str, Any] = {NAMESPACE: json.dumps(list(op.namespace), ensure_ascii=False),
                                KEY: op.key, VALUE: value, INDEXED: op.index is not False,
                                **self._prefix_filter(op.namespace)}
        expires = None
        if op.ttl is not None:
            if not isinstance(op.ttl, int | float) or isinstance(op.ttl, bool) or not (
                    op.ttl > 0 and math.isfinite(op.ttl)):
                raise InvalidInput("ttl must be a positive number of minutes")
            meta[TTL] = op.ttl
            expires = utcnow() + timedelta(minutes=op.ttl)
        return {"role": ROLE, "content": text_of(value, fields), "metadata": meta}, expires

    def _puts(self, ops: Sequence[PutOp]) -> None:
        """Puts in order; the new keys of one user (and TTL) are added in one `Memory.add`:
        one embedding call, one transaction."""
        if len({(op.namespace, op.key) for op in ops}) < len(ops):
            for op in ops:  # the same key twice: order matters, one at a time
                self._puts([op])
            return
        new: dict[tuple[str | None, float | None], list[dict[str, Any]]] = {}
        expiry: dict[tuple[str | None, float | None], Any] = {}
        for op in ops:
            rec = self._find(op.namespace, op.key)
            if op.value is None:
                if rec is not None:
                    self.memory.delete(rec.id, agent_id=self.agent_id)
                continue
            message, expires = self._document(op)
            if rec is not None:
                self.memory.update(rec.id, text=message["content"], metadata=message["metadata"],
                                   expires_at=expires, agent_id=self.agent_id)
                continue
            group = (self._user(op.namespace), op.ttl)
            new.setdefault(group, []).append(message)
            expiry[group] = expires
        for (user, _), messages in new.items():
            self.memory.add(messages, agent_id=self.agent_id, user_id=user, infer=False,
                            expires_at=expiry[(user, _)])

    def _search(self, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        want = op.offset + op.limit
        found: list[tuple[MemoryRecord, float | None]]
        if op.query:
            pool = min(PAGE, max(2 * want, 20))
            while True:
                hits = self.memory.search(op.query, agent_id=self.agent_id, user_id=self._user(prefix),
                                          filters={**self._prefix_filter(prefix), INDEXED: True},
                                          kinds=["episodic"], limit=pool)
                found = [(h.memory, h.score) for h in hits if KEY in h.memory.metadata
                         and matches(h.memory.metadata[VALUE], op.filter)]
                # a filter may have thrown hits away: look further, up to engram's limit
                if len(found) >= want or len(hits) < pool or pool == PAGE:
                    break
                pool = min(PAGE, pool * 4)
        else:
            recs = [r for r in self._records(prefix, {}) if matches(r.metadata[VALUE], op.filter)]
            recs.sort(key=lambda r: r.updated_at, reverse=True)
            found = [(r, None) for r in recs]
        page = found[op.offset: want]
        for rec, _ in page:
            self._refresh(rec, op.refresh_ttl)
        return [self._item(rec, score, search=True) for rec, score in page]  # type: ignore[misc]

    def _namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        return list_namespaces((tuple(json.loads(r.metadata[NAMESPACE]))
                                for r in self._records((), {})), op)

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        results: list[Result] = []
        puts: list[PutOp] = []
        for op in [*ops, None]:
            if isinstance(op, PutOp):
                puts.append(op)
                results.append(None)
                continue
            if puts:  # a run of puts ends: write it before anything reads
                self._puts(puts)
                puts = []
            if op is None:
                break
            if isinstance(op, GetOp):
                results.append(self._get(op))
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._namespaces(op))
            else:
                raise InvalidInput(f"unknown store operation {type(op).__name__}")
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        return await asyncio.to_thread(self.batch, list(ops))

    def forget(self, namespace: tuple[str, ...], key: str) -> int:
        """Erase an item for good (`delete` is engram's soft delete: kept in the history)."""
        rec = self._find(namespace, key)
        if rec is None:
            raise NotFound(f"no item {key!r} in {namespace!r}")
        return self.memory.erase(id=rec.id, agent_id=self.agent_id)
