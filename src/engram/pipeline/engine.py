"""The engine's parts, built once per `Memory`: store, embedder, LLM, config, retrieval preset.

Every pipeline takes an `Engine` rather than the `Memory` facade, so nothing below the facade
imports it (no cycles) and sessions, context and jobs run on exactly the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..model import UNSET, Unset
from ..providers.embedders import Embedder, get_embedder
from ..providers.llms import LLM, get_llm
from ..store import Store, open_store
from .retrieve import RetrievalConfig, get_preset


@dataclass(frozen=True)
class Engine:
    """What the pipelines work with. Frozen: a part is chosen once, when `Memory` is made."""

    store: Store
    embedder: Embedder
    llm: LLM | None  # None: every feature takes its no-LLM path (ARCHITECTURE rule 6)
    config: Config
    retrieval: RetrievalConfig

    @classmethod
    def build(cls, config: Config, *, store: Store | None = None, embedder: Embedder | None = None,
              llm: LLM | None | Unset = UNSET, retrieval: str | RetrievalConfig | None = None,
              tenant: str | None = None) -> Engine:
        """The parts given, and the configured ones for the rest (`llm=None`: no LLM even if
        one is configured)."""
        preset = retrieval or config.retrieval
        opened = store or open_store(config, tenant)
        try:
            if embedder is None:  # `auto` follows the space the database records
                recorded = opened.space()
                embedder = get_embedder(config.embedder, config, recorded.latest if recorded else None)
            return cls(store=opened, embedder=embedder,
                       llm=get_llm(config) if isinstance(llm, Unset) else llm, config=config,
                       retrieval=get_preset(preset) if isinstance(preset, str) else preset)
        except BaseException:
            if store is None:  # opened here: not left open by a part that failed
                opened.close()
            raise
