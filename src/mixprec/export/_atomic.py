"""Writing an export atomically: into a hidden folder beside the target, renamed into place at the end."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

__all__ = ["CHECKPOINT_PATTERNS", "check_folder", "staged"]

MANIFEST = "mixprec_export.json"
#: files a checkpoint reader takes as part of a model: weights, shard indexes, configs, the manifest
CHECKPOINT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                       "*.ckpt", "*.gguf", "config.json", "generation_config.json", "torchao_config.json", MANIFEST)


def _is_checkpoint_file(path: Path) -> bool:
    return path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in CHECKPOINT_PATTERNS)


def check_folder(folder: Path) -> list[Path]:
    """What of an existing ``folder`` goes into the new export: everything but checkpoint files
    (a tokenizer, a README). Raises ValueError when ``folder``, or a folder above it, is a file, when
    it is the current folder or contains it, and when it holds checkpoint files that no mixprec
    export wrote (no manifest), naming them."""
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                where = "" if p == folder else f" (in {folder})"
                raise ValueError(f"export: {p} is a file, not a folder{where}: choose an output folder that is "
                                 f"not under a file")
            break
    if not folder.exists():
        return []
    here = Path.cwd()
    if folder.resolve() in (here, *here.parents):
        raise ValueError(f"export: {folder} is the current folder (or contains it), which the export would replace "
                         f"by a new one: name an output folder such as {folder / 'served'}")
    entries = sorted(folder.iterdir())
    stale = [e.name for e in entries if _is_checkpoint_file(e)]
    if stale and not (folder / MANIFEST).is_file():
        shown = ", ".join(stale[:6]) + (f" and {len(stale) - 6} more" if len(stale) > 6 else "")
        raise ValueError(f"export: {folder} holds another checkpoint's files ({shown}), which a reader would take "
                         f"with the export's own (shards, an index, configs); export into a new or empty folder, "
                         f"or remove them")
    return [e for e in entries if not _is_checkpoint_file(e)]


@contextlib.contextmanager
def staged(folder: Path) -> Iterator[Path]:
    """Yield a new hidden folder beside ``folder`` to write the export into; when the block ends
    without an exception, copy in what ``folder`` held besides checkpoint files (see
    :func:`check_folder`) and rename it into place (an earlier export there is renamed aside, then
    removed). On an exception (a KeyboardInterrupt too) the hidden folder is removed and ``folder``
    is as it was. Checks ``folder`` before yielding (ValueError, see :func:`check_folder`)."""
    folder = Path(os.path.abspath(folder))  # "." or "out/" have a name and a parent to write beside
    carry = check_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = folder.parent / f".{folder.name}.mixprec-tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        for entry in carry:
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name, symlinks=True)
            else:
                shutil.copy2(entry, tmp / entry.name, follow_symlinks=False)
        if folder.exists():
            old = folder.parent / f".{folder.name}.mixprec-old-{tag}"
            os.replace(folder, old)
            try:
                os.replace(tmp, folder)
            except BaseException:
                os.replace(old, folder)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
