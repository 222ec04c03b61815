"""Where the tests find the repository: its root, ``deploy/`` and the test data, wherever a test
file sits in the tree."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = REPO_ROOT / "tests" / "data"
DEPLOY = REPO_ROOT / "deploy"
