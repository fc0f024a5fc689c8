"""The process's compiled generation programs: a least-recently-used cache bounded by how many programs it
holds and by the memory maps their machine code takes.

XLA's CPU backend gives every kernel of a program sections of its own (code, constants, data), each a memory
map, so a program holds maps in proportion to its kernels. Linux aborts a process that passes
``vm.max_map_count`` maps (65,530 by default) from inside the allocator, which Python cannot catch. The cache
therefore counts the maps each compile adds and drops its oldest programs once the programs together hold
more than :data:`MAP_BUDGET_SHARE` of the limit, or once the whole process holds more than
:data:`PROCESS_MAP_SHARE` of it, whatever holds the rest. A dropped program gives its maps back once nothing
else refers to it (``generation_loop.program_jit``). Where there are no maps to read (not Linux) only the count
bounds it. docs/hardening.md has the figures.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable

MAX_PROGRAMS = 32               # programs held at most, however small
MAP_BUDGET_SHARE = 0.25         # of vm.max_map_count: the maps the held programs may take together
PROCESS_MAP_SHARE = 0.5         # of vm.max_map_count: past it the cache drops programs, down to the newest
DEFAULT_MAX_MAP_COUNT = 65530   # Linux's default, where /proc/sys/vm/max_map_count cannot be read


def process_maps() -> int | None:
    """The memory maps this process holds now; None where the system does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> int:
    """The kernel's limit of memory maps per process."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return DEFAULT_MAX_MAP_COUNT


class ProgramCache:
    """Compiled programs by key, least recently used first out. Threads may share it: a lookup and an
    insertion each hold the lock, a compile runs outside it (two threads missing one key both compile it;
    the second insertion wins). A compile's maps are the process's maps after it less those before, so a
    compile running in another thread at the same time is counted twice, which only drops programs early."""

    def __init__(self, max_programs: int = MAX_PROGRAMS, max_maps: int | None = None,
                 max_process_maps: int | None = None):
        limit = max_map_count()
        self.max_programs = max_programs
        self.max_maps = int(limit * MAP_BUDGET_SHARE) if max_maps is None else max_maps
        self.max_process_maps = int(limit * PROCESS_MAP_SHARE) if max_process_maps is None else max_process_maps
        self._programs: collections.OrderedDict[Hashable, tuple[object, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.last_compile_maps = 0  # the maps the latest compile added

    def __len__(self) -> int:
        return len(self._programs)

    @property
    def maps_held(self) -> int:
        """The maps the held programs' compiles added, together."""
        with self._lock:
            return sum(maps for _, maps in self._programs.values())

    def get(self, key: Hashable) -> object | None:
        """The program compiled for ``key``, now the most recently used; None if it is not held."""
        with self._lock:
            entry = self._programs.get(key)
            if entry is None:
                return None
            self._programs.move_to_end(key)
            return entry[0]

    def compile(self, key: Hashable, compile_program: Callable[[], object]) -> tuple[object, float]:
        """``compile_program()``, held under ``key``: (the program, the seconds its compile took). Drops the
        oldest programs until the cache is within its bounds again; the new one always stays."""
        before = process_maps()
        start = time.perf_counter()
        program = compile_program()
        seconds = time.perf_counter() - start
        after = process_maps()
        maps = max(1, after - before) if before is not None and after is not None else 1
        with self._lock:
            self.last_compile_maps = maps
            self._programs[key] = (program, maps)
            self._programs.move_to_end(key)
            while len(self._programs) > 1 and (len(self._programs) > self.max_programs
                                               or sum(m for _, m in self._programs.values()) > self.max_maps):
                self._programs.popitem(last=False)
            while len(self._programs) > 1 and (process_maps() or 0) > self.max_process_maps:
                self._programs.popitem(last=False)  # freed here unless a caller still holds it
        return program, seconds

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()
