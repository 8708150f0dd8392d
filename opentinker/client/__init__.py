"""The thin client: talk to an ``opentinker-server`` from a laptop (no torch, transformers or ray).

::

    from opentinker.client import OpenTinkerClient, GenericEnvironment, InteractionSpec

    client = OpenTinkerClient()          # $OPENTINKER_BASE_URL, $OPENTINKER_API_KEY
    env = GenericEnvironment({"algorithm.adv_estimator": "grpo"}, dataset="train.jsonl")
    env.setup(client)
    info = client.fit(env, steps=20)     # progress bar; raises JobFailedError if the job fails
"""

from opentinker.client.client import ENV_API_KEY, ENV_BASE_URL, OpenTinkerClient
from opentinker.client.environment import DataGenerator, GenericEnvironment, RowDataLoader
from opentinker.client.errors import (
    AuthenticationError,
    ConfigurationError,
    ConflictError,
    ConnectionFailedError,
    DatasetError,
    EnvironmentSetupError,
    JobFailedError,
    JobTimeoutError,
    NotFoundError,
    OpenTinkerError,
    RateLimitError,
    ServerError,
    UnsafeArchiveError,
    ValidationError,
)
from opentinker.client.jobs import JobHandle
from opentinker.environments.registry import InteractionSpec

__all__ = [
    "ENV_API_KEY",
    "ENV_BASE_URL",
    "AuthenticationError",
    "ConfigurationError",
    "ConflictError",
    "ConnectionFailedError",
    "DataGenerator",
    "DatasetError",
    "EnvironmentSetupError",
    "GenericEnvironment",
    "InteractionSpec",
    "JobFailedError",
    "JobHandle",
    "JobTimeoutError",
    "NotFoundError",
    "OpenTinkerClient",
    "OpenTinkerError",
    "RateLimitError",
    "RowDataLoader",
    "ServerError",
    "UnsafeArchiveError",
    "ValidationError",
]
