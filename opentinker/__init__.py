"""OpenTinker: reinforcement learning of LLMs as a service.

This top-level package is the thin client side: it must import without torch,
transformers or ray (``tests/test_client_imports.py`` keeps it so). The training
engine lives in :mod:`opentinker.engine` and is only imported on the server.
"""

from opentinker.version import __version__  # noqa: E402
from opentinker.client import GenericEnvironment, JobHandle, OpenTinkerClient  # noqa: E402
from opentinker.environments.registry import InteractionSpec  # noqa: E402

__all__ = ["GenericEnvironment", "InteractionSpec", "JobHandle", "OpenTinkerClient", "__version__"]
