"""How megashard makes a new file: under a temporary name next to its place, then renamed over it (never the name of
an existing file), with the mode any new file gets here; and how a ``torch.save`` archive is recognised (megashard
marks its own in the archive's zip comment). :mod:`megashard.outputs` decides *whether* a path may be written; this
module is how."""
from __future__ import annotations

import os
import tempfile

__all__ = ["temp_path", "new_file_mode", "torch_archive_comment", "is_torch_archive"]


def temp_path(path: str, suffix: str = ".tmp") -> str:
    """A new, empty, uniquely named file next to ``path`` (``.<name>.<random><suffix>``) to write and then rename
    over ``path``: never the name of an existing file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix,
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    os.chmod(tmp, new_file_mode())  # mkstemp makes 0600; the renamed file gets the mode of any new file
    return tmp


def new_file_mode(directory: bool = False) -> int:
    """The mode a new file gets here (0666 less the umask), as for a file made with open(); ``directory``: that of
    a new directory (0777 less the umask), as os.mkdir makes it."""
    mask = os.umask(0o022)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def torch_archive_comment(path: str) -> bytes:
    """The zip comment of ``torch.save`` file ``path`` (b"" if none or unreadable): where megashard marks its own."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return z.comment or b""
    except (OSError, zipfile.BadZipFile, ValueError):
        return b""


def is_torch_archive(path: str) -> bool:
    """``path`` is a ``torch.save`` file (a zip archive holding ``<name>/data.pkl``)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") for n in z.namelist()[:64])
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
