"""The op tests need the built library: the ``library`` fixture (tests/conftest.py) fails them
(never skips) without it and says how to build it."""
