"""The memory lifecycle. Pure steps: extract, consolidate, retrieve (fuse, rank), forget, text.
Orchestrations over an `Engine` (engine.py): write, learn, read, index, erase."""
