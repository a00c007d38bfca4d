"""The in-process indexes both stores keep over their database (the lexicon, the dense cache),
written once: caches of the database, kept exact by what changed since the version they hold."""
