"""TEMPORARY stand-in (replaced by the ring branch)."""

from __future__ import annotations
import collections, mmap, os, struct
from . import _shm


class RingError(Exception):
    pass


_H = struct.Struct("<QQ")


class RingWriter:
    @classmethod
    def create(cls, name, size):
        self = cls()
        self.name = name
        self.size = size
        fd = os.open(os.path.join(_shm.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._live = collections.deque()
        self._head = 0
        self._freed = set()
        self._closed = False
        return self

    def capacity_for(self, n):
        return _H.size + n <= self.size

    def allocate(self, n):
        need = (_H.size + n + 63) // 64 * 64
        if not self._live:
            self._head = 0
        tail = self._live[0][0] if self._live else None
        start = self._head
        if tail is None:
            if need > self.size:
                return None
        elif start > tail:  # head == tail with slots live: wrapped, and full
            if start + need > self.size:
                if need <= tail:
                    start = 0
                else:
                    return None
        else:
            if start + need > tail:
                return None
        self._live.append([start, need, False])
        self._head = start + need
        return start

    def write(self, off, tag, data):
        data = memoryview(data).cast("B")
        _H.pack_into(self._map, off, tag, data.nbytes)
        self._map[off + _H.size : off + _H.size + data.nbytes] = data

    def free(self, off):
        for slot in self._live:
            if slot[0] == off and not slot[2]:
                slot[2] = True
                break
        else:
            raise ValueError(off)
        while self._live and self._live[0][2]:
            self._live.popleft()

    def close(self):
        if not self._closed:
            self._closed = True
            self._map.close()
            try:
                os.unlink(os.path.join(_shm.SHM_DIR, self.name))
            except FileNotFoundError:
                pass


class RingReader:
    @classmethod
    def open(cls, name):
        self = cls()
        fd = os.open(os.path.join(_shm.SHM_DIR, name), os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        return self

    def read(self, off, tag, size):
        t, n = _H.unpack_from(self._map, off)
        if t != tag or n != size:
            raise RingError("foreign")
        return bytes(self._map[off + _H.size : off + _H.size + size])

    def close(self):
        self._map.close()
