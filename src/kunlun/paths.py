"""Where Kunlun keeps its state on disk: everything lives under ``KUNLUN_HOME``.

Everything under ``KUNLUN_HOME`` is private to the user the platform runs as: directories
0700, files 0600 (:data:`DIR_MODE`, :data:`FILE_MODE`). The daemon and the CLI call
:func:`private_umask` first thing, so every file they (and the engine workers they start,
which inherit the umask) create is private whatever creates it: ``open``, SQLite and its
``-wal``/``-shm`` files, safetensors, ``mkdtemp``. :func:`secure_home` tightens what an
older version left readable.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
"""The process umask: no group or other bits on anything created."""
DIR_MODE = 0o700
"""Mode of every directory under ``KUNLUN_HOME`` (and of the home itself)."""
FILE_MODE = 0o600
"""Mode of every file under ``KUNLUN_HOME``."""
READ_ONLY_DIR = "packages"
"""Where signed packages are installed, read-only (:mod:`kunlun.offline.install`)."""
INSTALLED_FILE = "installed.json"
"""The installed packages and each model's pinned signer, in :data:`READ_ONLY_DIR`
(:mod:`kunlun.offline.registry`; ``kunlun-installer trust list`` reads it too)."""


def private_umask() -> None:
    """Set the process umask to :data:`PRIVATE_UMASK` (children inherit it)."""
    os.umask(PRIVATE_UMASK)


def kunlun_home() -> Path:
    """``$KUNLUN_HOME``, or ``~/.kunlun`` when unset. Created (mode 0700) on first use."""
    home = Path(os.environ.get("KUNLUN_HOME") or Path.home() / ".kunlun")
    home.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return home


def model_cache_dir() -> Path:
    """Imported and converted models (GGUF -> safetensors) live here."""
    path = kunlun_home() / "models"
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return path


def secure_home(home: Path) -> int:
    """Make ``home`` and everything under it private (directories 0700, files 0600).

    Returns how many paths had group or other bits and were tightened. Symbolic links are
    not followed (what they point at is not Kunlun's), nor are paths owned by another user
    changed (that would fail; such a tree is the operator's to fix). Installed packages
    (:data:`READ_ONLY_DIR`) are left as installed: read-only (0444, directories 0555), behind
    the home's own 0700.
    """
    fixed = 0
    uid = os.geteuid()
    for root, dirs, files in os.walk(home):
        if root == str(home) and READ_ONLY_DIR in dirs:
            dirs.remove(READ_ONLY_DIR)
        names = [*dirs, *files] if root != str(home) else [os.curdir, *dirs, *files]
        for name in names:
            path = os.path.normpath(os.path.join(root, name))
            try:
                info = os.lstat(path)
                if info.st_uid != uid or stat.S_ISLNK(info.st_mode):
                    continue
                if stat.S_IMODE(info.st_mode) & 0o077:
                    os.chmod(path, DIR_MODE if stat.S_ISDIR(info.st_mode) else FILE_MODE)
                    fixed += 1
            except FileNotFoundError:  # removed meanwhile
                continue
    return fixed


CONVERSION_RECORD = "conversion.json"
"""What :func:`kunlun.engine.convert.write_quantized` keeps in a plan-cache entry's
``weights/``: written last, so a ``weights/`` without it is not a conversion (and is made
again)."""


def make_writable(folder: Path) -> None:
    """Let the owner change (or remove) a tree sealed read-only again (a sealed conversion's
    or an installed package's directories are 0500): its own directories only, a symbolic
    link to a directory is neither followed nor changed."""
    if not folder.exists() or folder.is_symlink():
        return
    os.chmod(folder, DIR_MODE)
    for root, dirs, _files in os.walk(folder):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, DIR_MODE)


def remove_tree(folder: Path) -> None:
    """Remove the directory ``folder`` (if any), also when it was sealed read-only."""
    make_writable(folder)
    shutil.rmtree(folder, ignore_errors=True)
