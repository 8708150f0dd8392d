"""A served model's tokenizer in the Hugging Face cache, so that ``AutoTokenizer.from_pretrained(NAME)``
(what the tinker SDK's ``training_client.get_tokenizer()`` calls with the served name) finds it
without the Hub: ``opentinker tokenizer NAME``.

The layout is the Hub cache's own: ``<cache>/models--<org>--<name>/snapshots/<revision>/<files>``
and ``refs/main`` naming the revision. The revision is a hash of the files, so fetching the
same tokenizer again changes nothing. No torch, no transformers: the thin client writes files.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from opentinker.protocol import TokenizerFiles


def hf_hub_cache(explicit: str | os.PathLike | None = None) -> Path:
    """Where Hugging Face looks: ``explicit``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub``."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def place_in_hf_cache(tokenizer: TokenizerFiles, cache: str | os.PathLike | None = None) -> Path:
    """Writes the files as the Hub cache's snapshot of ``tokenizer.model``; returns its folder."""
    files = {name: base64.b64decode(data) for name, data in sorted(tokenizer.files.items())}
    for name in files:
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"the server sent a file named {name!r}; expected plain file names")
    digest = hashlib.sha1()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    revision = digest.hexdigest()
    repo = hf_hub_cache(cache) / ("models--" + tokenizer.model.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
