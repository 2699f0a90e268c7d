"""The disk tier's files: one file per KV page, size-bounded, least recently used first out.

Layout under the store directory (``default_disk_dir``: ``$CHATSERVE_CACHE/kv``, else
``~/.cache/chatserve/kv``, which ``make run`` and compose's ``engine-cache`` volume keep)::

    <dir>/<PageKey.fingerprint()>/<first 2 hex digits>/<chained hash, 16 hex digits>.kvp

One folder per page key (weights, format, KV dtype, block size, model shape), so pages of
other weights or formats are never even listed; a page's file name is its chained block
hash, which already covers the cache namespace, the salt and every token before it
(``engine.block_hash``), and its header says the same again (``engine.kv_page``).

Two engines may share one directory: a page is written to a temporary file in its
folder and renamed over its name (atomic on POSIX), so a reader sees a whole page or
none; each engine bounds what it knows of (its index: what it found at start plus what
it wrote), and a page the other engine evicted is a miss (``FileNotFoundError``), not an
error. Least recently used: an index ordered by use, seeded at start by the files'
modification times; a read touches the file so the order survives restarts.

Thread-safe: the index is behind a lock; file I/O runs outside it.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DiskPageStore", "default_disk_bytes", "default_disk_dir"]

_SUFFIX = ".kvp"
_GIB = 1 << 30


def default_disk_dir() -> Path:
    """``$CHATSERVE_CACHE/kv``, else ``~/.cache/chatserve/kv`` (beside the converted models)."""
    base = os.environ.get("CHATSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "chatserve") / "kv"


def default_disk_bytes(directory: Path | str) -> int:
    """The disk tier's default bound: 8 GiB (the size of llama.cpp's default prompt cache),
    but at most half the disk space free under ``directory`` at start, and at least 256 MiB."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = 16 * _GIB
    return max(256 << 20, min(8 * _GIB, free // 2))


class DiskPageStore:
    """Page files of one page key in one folder (see the module doc).

    Args:
        root: the store directory (created if missing).
        fingerprint: ``PageKey.fingerprint()`` of the pages this store holds.
        max_bytes: the most bytes of page files this store keeps (it evicts its least
            recently used files beyond it).

    Raises:
        OSError: the folder cannot be created or listed.
    """

    def __init__(self, root: Path | str, fingerprint: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.folder = Path(root) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # chained hash -> file bytes, oldest use first
        self._bytes = 0
        self.evicted = 0  # files this store deleted to stay under max_bytes
        self._folders: set[Path] = set()  # subfolders known to exist
        self._scan()

    # --- index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the pages already in the folder, oldest modification first; delete
        leftover temporary files of writers that died mid-write."""
        found: list[tuple[float, int, int]] = []
        for sub in self.folder.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                try:
                    if name.endswith(_SUFFIX) and len(name) == 16 + len(_SUFFIX):
                        st = entry.stat()
                        found.append((st.st_mtime, int(name[:16], 16), st.st_size))
                    elif name.startswith(".tmp-"):
                        os.unlink(entry.path)
                except (OSError, ValueError):
                    continue
        found.sort()
        with self._lock:
            for _, h, size in found:
                self._index[h] = size
                self._bytes += size
        self._evict_over()

    def path_of(self, chain_hash: int) -> Path:
        """The file of the page named ``chain_hash``."""
        name = f"{chain_hash:016x}"
        return self.folder / name[:2] / (name + _SUFFIX)

    @property
    def num_pages(self) -> int:
        """Pages this store knows of."""
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        """Bytes of the page files this store knows of."""
        return self._bytes

    def indexed(self, chain_hash: int) -> bool:
        """Whether the page is in the index, without looking on disk: the write path's check
        (a page another engine wrote and this one never saw is written again, the same
        bytes, rather than costing the step loop a ``stat`` per new page)."""
        with self._lock:
            return chain_hash in self._index

    def __contains__(self, chain_hash: int) -> bool:
        """Whether the page is in the index (a file written by another engine sharing the
        folder is looked up on disk once and indexed)."""
        with self._lock:
            if chain_hash in self._index:
                return True
        try:
            size = self.path_of(chain_hash).stat().st_size
        except OSError:
            return False
        with self._lock:
            if chain_hash not in self._index:
                self._index[chain_hash] = size
                self._bytes += size
        return True

    # --- I/O --------------------------------------------------------------------------------

    def put(self, chain_hash: int, data: bytes | Sequence[bytes | memoryview]) -> None:
        """Write one page file atomically (temporary file, then rename), then evict the
        least recently used files beyond ``max_bytes``.

        Args:
            data: the file's bytes, or its parts in order (``kv_page.encode_page_parts``:
                written one after the other, never joined).

        Raises:
            OSError: the write failed (a full disk: ``ENOSPC``); nothing is indexed, and
                the temporary file is removed.
        """
        path = self.path_of(chain_hash)
        if path.parent not in self._folders:  # one mkdir per folder, not per page
            path.parent.mkdir(exist_ok=True)
            self._folders.add(path.parent)
        tmp = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        size = 0
        try:
            with open(tmp, "wb", buffering=0) as f:
                for part in parts:
                    view = memoryview(part).cast("B")
                    size += len(view)
                    while view:  # a raw write may be short
                        view = view[f.write(view):]
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            old = self._index.pop(chain_hash, 0)
            self._index[chain_hash] = size
            self._bytes += size - old
        self._evict_over()

    def get(self, chain_hash: int) -> bytes | None:
        """The page file's bytes, or None when it is gone (evicted, here or by another
        engine); marks it most recently used (in the index and by its file time).

        Raises:
            OSError: a read error other than a missing file.
        """
        path = self.path_of(chain_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.discard(chain_hash, unlink=False)
            return None
        self._touch(chain_hash, path)
        return data

    def read_into(self, chain_hash: int, scratch: bytearray) -> memoryview | bytes | None:
        """``get`` through the caller's ``scratch``: a memoryview of the file's bytes in
        it, valid until the next call with the same scratch (a file larger than the
        scratch comes back as ``bytes``, as from ``get``); None when the page is gone. A
        reader that reuses one scratch allocates nothing per page (a fresh 370 KB
        ``bytes`` a page costs its page faults).

        Raises:
            OSError: a read error other than a missing file.
        """
        path = self.path_of(chain_hash)
        view = memoryview(scratch)
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size >= len(scratch):
                    data: memoryview | bytes = f.read()
                else:
                    n = got = f.readinto(view)
                    while got and n < len(view):  # a short read is not the end of the file
                        got = f.readinto(view[n:])
                        n += got or 0
                    data = view[:n]
        except FileNotFoundError:
            self.discard(chain_hash, unlink=False)
            return None
        self._touch(chain_hash, path)
        return data

    def _touch(self, chain_hash: int, path: Path) -> None:
        """Mark a page most recently used: in the index, and by its file time (for a restart)."""
        with self._lock:
            if chain_hash in self._index:
                self._index.move_to_end(chain_hash)
        try:
            os.utime(path)
        except OSError:
            pass

    def discard(self, chain_hash: int, unlink: bool = True) -> None:
        """Forget a page (and delete its file with ``unlink``): a corrupt or stale page."""
        with self._lock:
            size = self._index.pop(chain_hash, None)
            if size is not None:
                self._bytes -= size
        if unlink:
            try:
                os.unlink(self.path_of(chain_hash))
            except OSError:
                pass

    def _evict_over(self) -> None:
        """Delete least recently used files until the store is within ``max_bytes``."""
        while True:
            with self._lock:
                if self._bytes <= self.max_bytes or not self._index:
                    return
                h, size = self._index.popitem(last=False)
                self._bytes -= size
                self.evicted += 1
            try:
                os.unlink(self.path_of(h))
            except OSError:
                pass
