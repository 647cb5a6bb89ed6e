"""Publishing a stored folder when its final name is already taken (``storage.commit_folder``
found a folder there): another producer published the same prefix first, or a bad folder (from a
crash, another model, a damaged disk) is in the way. Loaded only then; the article's path
publishes with one ``os.rename`` and never reads this file."""
from __future__ import annotations

import os
import shutil
from typing import Callable


def publish_over(tmp: str, final: str, final_is_valid: Callable[[], bool]) -> str:
    """Publish ``tmp`` where ``final`` already exists. Returns "exists" (``final`` is valid, or a
    concurrent producer published first: ours is dropped) or "replaced" (an invalid folder was in
    the way; it is moved aside and deleted)."""
    if final_is_valid():
        shutil.rmtree(tmp, ignore_errors=True)
        return "exists"
    trash = f"{final}.old-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        os.rename(final, trash)
    except OSError:             # someone else moved it first: fine, try to put ours there
        trash = None
    try:
        os.rename(tmp, final)
    except OSError:             # a concurrent producer published first
        shutil.rmtree(tmp, ignore_errors=True)
        return "exists"
    finally:
        if trash:
            shutil.rmtree(trash, ignore_errors=True)
    return "replaced"
