"""A checkpoint's text side: ``tokenizer.json`` (read with the ``tokenizers`` library) and the EOS ids
(``generation_config.json``'s ``eos_token_id``, else ``config.json``'s; an int or a list)."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import RunnerError


def load_tokenizer(folder: str | Path):
    """The folder's ``tokenizers.Tokenizer``, or None when it has no tokenizer.json."""
    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own exception type
        raise RunnerError(f"tokenizer: cannot read {path} ({exc})") from None


def eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json; () when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.exists():
            try:
                eos = json.loads(path.read_text()).get("eos_token_id")
            except ValueError as exc:
                raise RunnerError(f"checkpoint: cannot read {path} ({exc})") from None
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (eos,)
                if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                    raise RunnerError(f"checkpoint: {name} eos_token_id must be an id or a list of ids, got {eos!r}")
                return ids
    return ()
