"""The memory lifecycle as pure functions: write (consolidate), read (retrieve), forget."""
