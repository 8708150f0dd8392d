"""The env instances a job may have left open at its env servers, kept on disk.

A gym-protocol env keeps an instance from ``/reset`` until ``/finalize``. A step's agent loops
finalize every instance they start, and an interaction keeps those whose finalize could not
reach the server and sends it again before the next step (``Interaction.finalize_leftovers``).
What a killed process cannot do is remember: so before a step starts its episodes, the ids
they will use (and the leftovers) are written here, and after the step only the leftovers. A
runner started again on the job (a server restart, ``jobs resume``) reads the file and
finalizes them first, so a crash leaves no instance open at the env.

A small JSON file ``{"interactions": {name: [instance id, ...]}}`` written whole (a temporary
file, then a rename), with no fsync: it is meant to survive the process, not the machine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["EnvInstanceJournal"]

logger = logging.getLogger(__name__)

FILE_NAME = "env_instances.json"


class EnvInstanceJournal:
    """The file of one run (``path`` None: nothing is kept, e.g. a run without a folder)."""

    def __init__(self, path: Path | str | None):
        self.path = Path(path) if path is not None else None
        self._written: dict[str, list[str]] | None = None  # what the file holds now (None: unknown)

    @classmethod
    def in_folder(cls, folder: Path | str | None) -> EnvInstanceJournal:
        return cls(Path(folder) / FILE_NAME if folder else None)

    def read(self) -> dict[str, list[str]]:
        """``{interaction name: [instance id, ...]}`` left open by an earlier process (empty when none)."""
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # a torn or foreign file: nothing can be trusted in it
            logger.warning("ignoring the env instance journal %s: %s", self.path, exc)
            return {}
        found = data.get("interactions") if isinstance(data, dict) else None
        if not isinstance(found, dict):
            return {}
        return {str(name): [str(i) for i in ids if isinstance(i, str)]
                for name, ids in found.items() if isinstance(ids, list)}

    def write(self, open_instances: Mapping[str, Sequence[str]]) -> None:
        """Keep ``open_instances`` (the file goes away when there are none)."""
        if self.path is None:
            return
        entries = {name: list(ids) for name, ids in open_instances.items() if ids}
        if entries == self._written:
            return
        try:
            if not entries:
                self.path.unlink(missing_ok=True)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                temporary.write_text(json.dumps({"interactions": entries}), encoding="utf-8")
                os.replace(temporary, self.path)
        except OSError as exc:  # the journal guards against a crash; a full disk must not stop training
            logger.warning("could not write the env instance journal %s: %s", self.path, exc)
            self._written = None
            return
        self._written = entries
