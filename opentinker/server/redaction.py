"""What users read of a job's errors: without this server's folders (the data folder, served
models' paths: exception messages name them; where things live is the operator's business),
with an id to quote; the trace goes to this server's log under that id."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from opentinker.server.settings import ServerSettings

log = logging.getLogger("opentinker.server.jobs")


class Redaction:
    def __init__(self, settings: ServerSettings):
        # What redact() replaces, longest first (a model folder may sit in the data folder).
        paths = {str(settings.data_dir.resolve()): "<data dir>", str(settings.data_dir): "<data dir>"}
        for model in settings.job_policy.models:
            if model.path and os.path.isabs(os.path.expanduser(model.path)):
                paths[os.path.expanduser(model.path).rstrip("/")] = f"<model {model.name}>"
        self._private_paths = sorted(paths.items(), key=lambda item: -len(item[0]))

    def published_error(self, job_id: str, data: dict[str, Any]) -> dict[str, Any]:
        """An error event as users see it: its message (server paths replaced) and an id to
        quote. Its trace goes to this server's log under that id, never to the store."""
        trace = data.pop("traceback", None)
        error_id = str(data.get("error_id") or uuid.uuid4().hex[:12])
        message = self.redact(str(data.get("message") or "the job's runner reported an error"))
        log.error("job %s: error %s: %s%s", job_id, error_id, message, f"\n{trace}" if trace else "")
        return {**data, "message": message, "error_id": error_id}

    def redact(self, text: str) -> str:
        """``text`` without this server's folders: the data folder and served models' paths
        (exception messages name them; where things live on the server is the operator's business)."""
        for path, label in self._private_paths:
            text = text.replace(path, label)
        return text
