"""The product tests' fixtures for the lab's tests (tests/ is on pytest's pythonpath): the cache
isolation, the quiet machine, the tiny checkpoints and built deployments (tests/conftest.py),
and the EAGLE-3 deployments of tests/test_eagle3.py."""

from conftest import _isolated_cache, _quiet_machine, built, tiny_ckpts  # noqa: F401
from test_eagle3 import eagle_deploy, heads  # noqa: F401
