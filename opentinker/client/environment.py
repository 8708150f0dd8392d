"""``GenericEnvironment``: what a researcher trains on — config, interactions and data.

::

    env = GenericEnvironment(
        {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 4},
        [InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": "http://envhost:8001"})],
        data_generator=DataGenerator(lambda i: {"extra_info": {"interaction_kwargs": {"name": "guess"}}}, 64),
    )
    env.setup(client)            # fails at once if the server cannot reach envhost:8001
    client.fit(env, steps=20)

Rows are verl-style dicts: ``{"prompt": [{"role": "user", "content": ...}], "extra_info":
{"interaction_kwargs": {"name": ..., ...}}, "reward_model": {...}}``. A row needs a
``prompt`` list of chat messages, or ``extra_info.interaction_kwargs`` (a data-free row:
the environment's first observation opens the chat).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.client.errors import DatasetError, EnvironmentSetupError
from opentinker.client.relay import local_problems, relayed_specs
from opentinker.config import build_recipe, expand_dotted, parse_overrides
from opentinker.environments.env_routing import shard_urls
from opentinker.environments.registry import InteractionSpec
from opentinker.protocol import EnvCheckResult, JobCreate, JobMode
from opentinker.recipe import RecipeSpec
from opentinker.rows import row_shape_problem

if TYPE_CHECKING:
    from opentinker.client.client import OpenTinkerClient

__all__ = ["DataGenerator", "GenericEnvironment", "RowDataLoader", "load_rows", "validate_row"]

Row = dict[str, Any]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_JSON_SUFFIXES = (".json",)
_PARQUET_SUFFIXES = (".parquet", ".pq")


class DataGenerator:
    """A data-free dataset: ``fn(i)`` makes row ``i`` for ``i`` in ``range(length)``.

    Rows are made when a batch needs them (each epoch anew), so ``fn`` may be random as
    long as it is cheap; make it depend on ``i`` for reproducible runs.
    """

    def __init__(self, fn: Callable[[int], Mapping[str, Any]], length: int):
        if not callable(fn):
            raise TypeError(f"DataGenerator needs a callable fn(i) -> row, got {type(fn).__name__}")
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"DataGenerator length must be a positive int, got {length!r}")
        self.fn = fn
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __call__(self, index: int) -> Mapping[str, Any]:
        return self.fn(index)

    def __repr__(self) -> str:
        return f"DataGenerator({getattr(self.fn, '__name__', self.fn)!r}, length={self.length})"


# ---------------------------------------------------------------------- row checks


def validate_row(row: Any, where: str, interaction_names: Iterable[str] = ()) -> Row:
    """Check one dataset row's shape (``opentinker/rows.py``, the server's rules too); ``where``
    (e.g. ``"train.jsonl line 3"``) starts every error. ``interaction_names``: the environment's
    interactions (a data-free row needs one; a row naming another is an error)."""
    problem = row_shape_problem(row, list(interaction_names))
    if problem is not None:
        raise DatasetError(f"{where}: {problem}")
    return dict(row)


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path} line {number}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {number}: invalid JSON: {exc.msg} (column {exc.colno})") from None


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = " (one JSON object per line? name the file .jsonl)" if exc.msg == "Extra data" else ""
        raise DatasetError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}{hint}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must be a JSON list of rows, got a {type(data).__name__}")
    for index, row in enumerate(data):
        yield f"{path} index {index}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading parquet files needs pyarrow, which is not installed: pip install pyarrow "
            "(or convert the file to .jsonl)"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's own errors, e.g. not a parquet file
        raise DatasetError(f"{path}: cannot read as parquet: {exc}") from exc
    for index, row in enumerate(rows):
        yield f"{path} row {index}", row


def load_rows(path: str | os.PathLike[str], interaction_names: Iterable[str] = ()) -> list[Row]:
    """Every row of a ``.json`` (a list), ``.jsonl``/``.ndjson`` or ``.parquet`` file, validated."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        located = _read_jsonl(path)
    elif suffix in _JSON_SUFFIXES:
        located = _read_json(path)
    elif suffix in _PARQUET_SUFFIXES:
        located = _read_parquet(path)
    else:
        raise DatasetError(f"{path}: unsupported dataset format {suffix or '(no suffix)'!r}; use .json, .jsonl or .parquet")
    names = list(interaction_names)
    rows = [validate_row(row, where, names) for where, row in located]
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    return rows


# ---------------------------------------------------------------------- loader


class RowDataLoader:
    """Batches of rows, reshuffled each epoch from ``seed`` (epoch ``e`` uses ``seed + e``).

    ``iter(loader)`` is one epoch (the last batch may be short); :meth:`endless` gives full
    batches forever, running on into the next epoch — what training steps consume.
    """

    def __init__(
        self,
        num_rows: int,
        get_row: Callable[[int], Row],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        source: str = "dataset",
    ):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.source = source
        self.epoch = 0
        self._get_row = get_row

    def __repr__(self) -> str:
        return f"RowDataLoader({self.source}, rows={self.num_rows}, batch_size={self.batch_size})"

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[list[Row]]:
        order = self._order(self.epoch)
        self.epoch += 1
        for start in range(0, len(order), self.batch_size):
            yield [self._get_row(i) for i in order[start : start + self.batch_size]]

    def endless(self) -> Iterator[list[Row]]:
        """Full batches forever; an epoch's tail carries over into the next epoch."""
        pending: list[Row] = []
        while True:
            for i in self._order(self.epoch):
                pending.append(self._get_row(i))
                if len(pending) == self.batch_size:
                    yield pending
                    pending = []
            self.epoch += 1

    def rows(self) -> list[Row]:
        """Every row once, in dataset order."""
        return [self._get_row(i) for i in range(self.num_rows)]


# ---------------------------------------------------------------------- environment


def _config_tree(config: Any) -> dict[str, Any]:
    """verl-style overrides in any common shape -> a nested dict (keys not yet checked)."""
    if config is None:
        return {}
    if isinstance(config, argparse.Namespace):
        config = {k: v for k, v in vars(config).items() if v is not None}
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return expand_dotted(copy.deepcopy(dict(config)))
    if isinstance(config, (list, tuple)) and all(isinstance(item, str) for item in config):
        return parse_overrides(config)
    raise TypeError(
        f"config must be a dict of verl-style overrides (nested or dotted keys) or a list of 'key=value' "
        f"strings, got {type(config).__name__}"
    )


def _spec_urls(spec: InteractionSpec) -> list[str]:
    if "env_endpoint" not in spec.config and "env_shards" not in spec.config:
        return []
    return shard_urls(spec.config.get("env_endpoint"), spec.config.get("env_shards"))


class GenericEnvironment:
    """A training environment: config overrides, interaction specs and the data.

    ``config``: verl-style overrides (nested dict, dotted keys, or ``key=value`` strings),
    checked against the known keys at once. ``interaction_specs``: the interactions rows
    may name. ``dataset`` / ``val_dataset``: a file path (``.json`` list, ``.jsonl``,
    ``.parquet``) or a list of rows. ``data_generator``: data-free rows instead of a
    dataset — a :class:`DataGenerator`, a ``(fn, length)`` pair, or a bare ``fn(i) -> row``
    (then as many rows as the run consumes: ``train_batch_size * total_training_steps``).
    Without any data the server uses its built-in task (``data.task``).
    """

    def __init__(
        self,
        config: Mapping[str, Any] | Sequence[str] | None = None,
        interaction_specs: Sequence[InteractionSpec | Mapping[str, Any]] | None = None,
        *,
        dataset: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | None = None,
        val_dataset: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | None = None,
        data_generator: DataGenerator | tuple[Callable[[int], Mapping[str, Any]], int] | Callable | None = None,
    ):
        self.config: dict[str, Any] = _config_tree(config)
        # Parsed once here (ConfigError naming a bad key); a job's mode and steps are set on it.
        self.recipe: RecipeSpec = build_recipe(self.config)
        specs = [s if isinstance(s, InteractionSpec) else InteractionSpec.model_validate(s) for s in interaction_specs or ()]
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate interaction names: {', '.join(duplicates)}")
        self.interaction_specs: list[InteractionSpec] = specs
        if dataset is not None and data_generator is not None:
            raise ValueError("give either dataset or data_generator, not both")
        if isinstance(data_generator, tuple):
            data_generator = DataGenerator(*data_generator)
        if data_generator is not None and not callable(data_generator):
            raise TypeError(f"data_generator must be callable (fn(i) -> row), got {type(data_generator).__name__}")
        self.dataset = dataset
        self.val_dataset = val_dataset
        self.data_generator = data_generator
        self._rows_cache: dict[tuple[str, int | None], list[Row]] = {}
        self._set_up_for: OpenTinkerClient | None = None

    def __repr__(self) -> str:
        data = self.dataset if self.dataset is None or isinstance(self.dataset, (str, os.PathLike)) else f"<{len(self.dataset)} rows>"
        return (
            f"GenericEnvironment(interactions={[s.name for s in self.interaction_specs]}, dataset={data!r}, "
            f"data_generator={self.data_generator!r})"
        )

    @property
    def interaction_names(self) -> list[str]:
        return [s.name for s in self.interaction_specs]

    # ------------------------------------------------------------------ data

    def _default_generator_length(self, steps: int | None = None) -> int:
        recipe = self.recipe
        return recipe.data.train_batch_size * (steps or recipe.trainer.total_training_steps)

    def _loader_parts(
        self, source: Any, *, length: int | None = None, steps: int | None = None
    ) -> tuple[int, Callable[[int], Row], str]:
        names = self.interaction_names
        if isinstance(source, (str, os.PathLike)):
            rows = load_rows(source, names)
            return len(rows), rows.__getitem__, str(source)
        if callable(source):
            fn = source
            n = length or (len(source) if hasattr(source, "__len__") else self._default_generator_length(steps))

            def make(i: int) -> Row:
                try:
                    row = fn(i)
                except Exception as exc:
                    raise DatasetError(f"data_generator({i}) raised {type(exc).__name__}: {exc}") from exc
                return validate_row(row, f"data_generator({i})", names)

            make(0)  # fail fast on a generator that makes bad rows
            return n, make, f"data_generator x {n}"
        if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
            rows = [validate_row(row, f"dataset row {i}", names) for i, row in enumerate(source)]
            if not rows:
                raise DatasetError("the dataset has no rows")
            return len(rows), rows.__getitem__, f"{len(rows)} rows"
        raise TypeError(
            f"expected a dataset path, a list of rows or a data generator, got {type(source).__name__}"
        )

    def get_dataloader(
        self,
        path_or_rows: Any = None,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        *,
        length: int | None = None,
    ) -> RowDataLoader:
        """Batches of validated rows from ``path_or_rows`` (default: the environment's
        dataset, else its data generator): a ``.json``/``.jsonl``/``.parquet`` path, a list of
        rows, or a generator ``fn(i) -> row`` (``length`` rows; see the class docstring).
        ``batch_size`` defaults to ``data.train_batch_size``. Errors name the file, the
        line or index, and what is missing."""
        source = path_or_rows
        if source is None:
            source = self.dataset if self.dataset is not None else self.data_generator
        if source is None:
            raise DatasetError(
                "this environment has no dataset or data_generator; pass a path, rows or a generator, "
                "or train on the server's built-in task (data.task) in server mode"
            )
        num_rows, get_row, label = self._loader_parts(source, length=length)
        size = batch_size if batch_size is not None else self.recipe.data.train_batch_size
        return RowDataLoader(num_rows, get_row, size, shuffle=shuffle, seed=seed, source=label)

    def train_rows(self, steps: int | None = None) -> list[Row] | None:
        """The training rows to upload with a server-mode job (None: the built-in task)."""
        source = self.dataset if self.dataset is not None else self.data_generator
        if source is None:
            return None
        # a bare generator's length depends on the step count; files and lists do not
        cache_key = ("train", steps if source is self.data_generator else None)
        if cache_key not in self._rows_cache:
            num_rows, get_row, _ = self._loader_parts(source, steps=steps)
            self._rows_cache[cache_key] = [get_row(i) for i in range(num_rows)]
        return self._rows_cache[cache_key]

    def val_rows(self) -> list[Row] | None:
        if self.val_dataset is None:
            return None
        if ("val", None) not in self._rows_cache:
            num_rows, get_row, _ = self._loader_parts(self.val_dataset)
            self._rows_cache[("val", None)] = [get_row(i) for i in range(num_rows)]
        return self._rows_cache[("val", None)]

    def step_batches(self) -> Iterator[list[Row]]:
        """Full batches of ``data.train_batch_size`` rows forever (client mode)."""
        data = self.recipe.data
        return self.get_dataloader(batch_size=data.train_batch_size, shuffle=data.shuffle, seed=data.seed).endless()

    # ------------------------------------------------------------------ server side

    def env_config(self) -> dict[str, Any]:
        """What a job created from this environment carries besides its data: the config
        overrides (nested) and the interaction specs, JSON-ready."""
        return {
            "config": copy.deepcopy(self.config),
            "interactions": [s.model_dump(mode="json") for s in self.interaction_specs],
        }

    def setup(self, client: OpenTinkerClient) -> dict[str, Any]:
        """Check this environment against the server before any job exists.

        Local checks first (the dataset's rows, env endpoint URLs), then
        ``POST /v1/env/check``: the server validates each spec against its allowlist and
        calls every env endpoint's ``/health``; the endpoints of interactions with
        ``relay: client`` are on this machine, so their ``/health`` is called from here. Any problem raises
        :class:`EnvironmentSetupError` at once, naming the unreachable URL(s) or listing
        the class paths the server allows. Returns :meth:`env_config`.
        """
        urls: dict[str, list[str]] = {}
        for spec in self.interaction_specs:
            try:
                urls[spec.name] = _spec_urls(spec)
            except ValueError as exc:
                raise EnvironmentSetupError(f"interaction {spec.name!r}: {exc}") from exc
        if self.dataset is not None:
            self.train_rows()  # reads and checks every row
        elif self.data_generator is not None:
            self._loader_parts(self.data_generator)  # checks its first row
        self.val_rows()
        try:
            relayed = relayed_specs(self.interaction_specs)
        except ValueError as exc:
            raise EnvironmentSetupError(str(exc)) from exc
        result = client.check_environment(self.interaction_specs)
        allowed = set(result.allowed_class_paths)
        unknown = [s for s in self.interaction_specs if s.class_path not in allowed]
        if not result.ok:
            raise EnvironmentSetupError(self._failure_message(client, result, unknown, urls))
        # Relayed envs are on this machine: the server cannot see them, so they are checked from here.
        local = local_problems(relayed)
        if local:
            raise EnvironmentSetupError("\n".join(["environment check failed on this machine:",
                                                    *(f"  - {problem}" for problem in local)]))
        if result.problems:
            import warnings

            warnings.warn(f"environment check on {client.base_url} passed with remarks: {'; '.join(result.problems)}", stacklevel=2)
        self._set_up_for = client
        return self.env_config()

    def _failure_message(
        self,
        client: OpenTinkerClient,
        result: EnvCheckResult,
        unknown: list[InteractionSpec],
        urls: dict[str, list[str]],
    ) -> str:
        lines = [f"environment check failed on {client.base_url}:"]
        unreachable: list[str] = []
        refused: list[str] = []  # endpoints that answered, or were never tried: the server may not reach them
        for problem in result.problems or ["(the server gave no details)"]:
            mentioned = [u for u_list in urls.values() for u in u_list if u in problem]
            named = refused if _is_policy_refusal(problem) else unreachable
            named += [u for u in mentioned if u not in named]
            if not mentioned:  # name the endpoints of an interaction the server names without them
                for name, name_urls in urls.items():
                    if name_urls and re.search(rf"['\"]{re.escape(name)}['\"]", problem) and "class" not in problem:
                        problem += f" (env endpoint{'s' if len(name_urls) > 1 else ''}: {', '.join(name_urls)})"
                        unreachable += [u for u in name_urls if u not in unreachable]
            lines.append(f"  - {problem}")
        if unreachable:
            lines.append(f"unreachable env endpoint(s): {', '.join(unreachable)}")
        if refused:
            lines.append(f"env endpoint(s) this server may not reach: {', '.join(refused)} (its operator allows env "
                         "hosts with --allow-env-host; an env on this machine: \"relay\": \"client\")")
        if unknown:
            named = ", ".join(f"{s.class_path!r} (interaction {s.name!r})" for s in unknown)
            lines.append(f"interaction class not allowed on this server: {named}")
            said = "\n".join(result.problems)
            if not result.allowed_class_paths or not all(p in said for p in result.allowed_class_paths):
                lines.append(f"allowed class paths: {', '.join(result.allowed_class_paths) or '(none)'}")
        return "\n".join(lines)

    def is_set_up_for(self, client: OpenTinkerClient) -> bool:
        return self._set_up_for is client

    def job_create(self, mode: JobMode = "server", steps: int | None = None, name: str | None = None) -> JobCreate:
        """The ``POST /v1/jobs`` body for this environment."""
        config, recipe = copy.deepcopy(self.config), self.recipe
        if steps is not None:
            if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
                raise ValueError(f"steps must be a positive int, got {steps!r}")
            config.setdefault("trainer", {})["total_training_steps"] = steps
            recipe = recipe.replaced("trainer.total_training_steps", steps)
        recipe.for_job(mode)  # the rules the job's mode adds, before anything is sent
        if mode == "server":
            dataset = self.train_rows(steps)
        else:
            if self.dataset is None and self.data_generator is None:
                raise DatasetError("client mode pushes batches from the environment's data: give dataset= or data_generator=")
            dataset = None
        return JobCreate(
            name=name,
            mode=mode,
            config=config,
            interactions=self.interaction_specs,
            dataset=dataset,
            val_dataset=self.val_rows(),
        )


def _is_policy_refusal(problem: str) -> bool:
    """Whether the server refused an endpoint by its operator's policy (it did not try to reach it)."""
    return "is not allowed on this server" in problem or "allows no environment servers" in problem
