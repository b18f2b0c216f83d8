"""tests/deploy: test_compose.py runs real containers, so only `make test-deploy` collects it (it sets
MSERVE_DEPLOY_TESTS=1 after building the images and starting an engine); `make test` never does."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("MSERVE_DEPLOY_TESTS") == "1" else ["test_compose.py"]
