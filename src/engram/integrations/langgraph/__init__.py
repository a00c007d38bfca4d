"""engram for LangGraph: `EngramStore` (long-term memory, `BaseStore`) and `EngramSaver`
(checkpoints, `BaseCheckpointSaver`), both in the database the engram `Memory` uses.
See docs/integrations.md."""

from .saver import EngramSaver
from .store import EngramStore

__all__ = ["EngramSaver", "EngramStore"]
