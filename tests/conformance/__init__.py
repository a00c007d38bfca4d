"""The `Store` contract, run against every backend listed in tests/conftest.py `STORES`."""
