"""Where things are, for every test module wherever its folder (tests/ mirrors lrattn_lightning/: tests/model/routing/
holds the routing kinds' tests, tests/e2e/ the tests whose point is real processes): a test module takes paths from
here, never from its own `__file__`."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent  # conftest.py, helpers/ and run_hooks.py
REPO_ROOT = TESTS_DIR.parent
GOLDEN_DIR = TESTS_DIR / "golden"
REGISTRY_PATH = REPO_ROOT / "registry.yaml"
ROUTING_TESTS = TESTS_DIR / "model" / "routing"  # a routing kind's tests: test_KIND.py, test_KIND_*.py or KIND/
SWEEP_HOOKS = TESTS_DIR / "tools"  # sweep_hooks.py: callbacks the sweep tests put in a sweep's recipe
PRECIOUS = "precious\n"  # what a planted link's victim (conftest's `victim` fixture) holds, before and after
