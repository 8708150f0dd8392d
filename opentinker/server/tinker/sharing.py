"""Sharing and keeping checkpoints, apart from HTTP: the bodies of the routes that do it, the
TTL range, copies (``copy_weights``) and the files of external weights
(``save_weights_external``) that signed links serve.

A copy is a new training run of the caller's (model state ``copy``: it holds its checkpoint and
takes no training request) in a session of its own, whose checkpoint row names the source's
folder: checkpoint folders never change, so nothing is written, and a folder is deleted only
when no row names it (``TinkerService._remove_folder``). The copy counts in the caller's
checkpoint quota at the source's size, since the caller keeps those bytes alive.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from opentinker.protocol import MAX_INT
from opentinker.server.tinker.checkpoint_quota import Usage
from opentinker.server.tinker.projects import PROJECT_NAME
from opentinker.server.tinker.schemas import SaveWeights, _Body
from opentinker.server.tinker.state import CheckpointRow, ModelRow, TinkerState

if TYPE_CHECKING:
    from opentinker.server.tinker.service import TinkerService

MIN_TTL_S = 3600  # the SDK's range: 1 hour ...
MAX_TTL_S = 10 * 365 * 86400  # ... to 10 years
MAX_EXTERNAL_FILES = 1000  # files one external checkpoint may list (a sampler checkpoint has two or three)
COPY_STATE = "copy"
COPY_ERROR = ("it is a copy made by copy_weights, which holds its checkpoint and cannot be trained on; "
              "create_training_client_from_state(<its path>) loads it into a model that can")


class SetTtl(_Body):
    ttl_seconds: int | None  # None: the checkpoint never expires


class CopyWeights(_Body):
    source_path: str = Field(min_length=1, max_length=2048)
    destination_project_id: str | None = Field(None, pattern=PROJECT_NAME)
    session_id: str | None = Field(None, min_length=1, max_length=256)
    model_seq_id: int | None = Field(None, ge=0, le=MAX_INT)
    ttl_seconds: int | None = None
    weights_access_token: str | None = Field(None, max_length=8192)  # refused: not offered


class SaveWeightsExternal(SaveWeights):
    age_encryption_recipients: list[Annotated[str, Field(max_length=4096)]] | None = Field(None, max_length=10)


def ttl_problem(ttl_s: int | None, longest: int) -> str | None:
    """Why ``ttl_seconds`` is refused (a TTL set on a checkpoint, or a copy's), or None."""
    top = min(MAX_TTL_S, longest)
    if ttl_s is None or MIN_TTL_S <= ttl_s <= top:
        return None
    return (f"ttl_seconds {ttl_s} is out of range: give {MIN_TTL_S} (1 hour) to {top} seconds ({top / 86400:g} days; "
            f"--tinker-max-checkpoint-ttl {longest}), or null for no expiry")


def expiry(ttl_s: int | None) -> float | None:
    return None if ttl_s is None else time.time() + ttl_s


def external_problem(body: SaveWeightsExternal) -> str | None:
    """Why a save_weights_external request is refused before it is queued, or None."""
    if body.path is None:
        return "save_weights_external: path (the name of the external weights) is required"
    if body.age_encryption_recipients:
        return ("age_encryption_recipients: encrypting exported weights is not offered on this server; save without "
                "recipients (the files stay in the operator's external folder, served by links this server signs)")
    return None


def copy_session_id(user_id: int, idempotency_key: str | None) -> str:
    """The session a copy is made in: the same for a re-sent request (its X-Idempotency-Key), so
    the copy it made is found and answered again."""
    if not idempotency_key:
        return uuid.uuid4().hex
    return hashlib.sha256(f"copy_weights\n{user_id}\n{idempotency_key}".encode()).hexdigest()[:32]


def copy_path(copy: ModelRow) -> str:
    """The tinker path of the checkpoint a copy run holds (its source's kind and name)."""
    _, kind, name = copy.spec["copy_of"].removeprefix("tinker://").split("/")
    return f"tinker://{copy.model_id}/{kind}/{name}"


def check_copy_quota(svc: TinkerService, user_id: int, source: CheckpointRow) -> None:
    """QuotaExceeded unless a copy of ``source`` fits the user's checkpoint quota (its bytes
    count: the copy keeps them alive). The server's cap is not checked: nothing is written."""
    def alive(model_id: str) -> bool:
        return svc.host.slot(model_id) is not None

    svc.checkpoint_quota.check(Usage(*svc.state.checkpoint_usage(user_id)),
                               svc.checkpoint_quota.in_flight(user_id, alive), source.size_bytes or 0)


def make_copy(state: TinkerState, source: CheckpointRow, source_model: ModelRow, user_id: int, model_id: str,
              session_id: str, ttl_s: int | None) -> CheckpointRow:
    """The copy's run (state ``copy``) and its checkpoint row, naming the source's folder."""
    spec = {key: value for key, value in source_model.spec.items() if key != "copy_of"}
    state.add_model(model_id, session_id, user_id, source_model.base_model, dict(spec, copy_of=source.tinker_path),
                    None)
    state.set_model_state(model_id, COPY_STATE, COPY_ERROR)
    row = CheckpointRow(model_id, source.kind, source.name, user_id, source.folder, source.size_bytes, False,
                        source.metadata, time.time(), expiry(ttl_s))
    state.add_checkpoint(row)
    return row


def write_id(row: CheckpointRow) -> str:
    """The id of the write a checkpoint row names (its folder is ``<name>@<write id>``): a link
    carries it, so a checkpoint deleted and saved again under its name is not served by old links."""
    return Path(row.folder).name.partition("@")[2]


def external_files(folder: Path) -> list[str]:
    """The files of an external checkpoint, as paths relative to it (``/``-separated), sorted;
    ValueError past ``MAX_EXTERNAL_FILES``. Links are not followed."""
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root, name)
            if path.is_symlink():
                continue
            found.append(path.relative_to(folder).as_posix())
            if len(found) > MAX_EXTERNAL_FILES:
                raise ValueError(f"the checkpoint has over {MAX_EXTERNAL_FILES} files, more than one answer lists")
    return sorted(found)


def file_in(folder: Path, relative: str) -> Path | None:
    """``folder / relative`` if that is a plain file inside ``folder`` (nothing escapes it by
    ``..`` or a link), else None."""
    root = folder.resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        return None
    return target
