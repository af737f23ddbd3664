"""A model of PyTorch's CUDA caching allocator, replayed over the storages a (fake) step allocates and
frees: what ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` would read on a GPU.

Our own because torch has none: its memory snapshots and ``MemTracker`` read a real allocator. The
rules are ``c10/cuda/CUDACachingAllocator.cpp``'s defaults (one stream; no expandable segments,
``max_split_size`` or garbage collection; segments are never released during training):

* a request is rounded up to a multiple of 512 bytes;
* requests up to 1 MiB come from the small pool, larger ones from the large pool;
* the smallest free block of the pool that fits is used (ties: the lowest address); it is split when
  what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool), else the whole
  block is allocated and counts as allocated;
* with no free block, a segment is reserved (``cudaMalloc``): 2 MiB for a small request, 20 MiB for a
  large one under 10 MiB, else the request rounded up to 2 MiB;
* a freed block merges with free neighbours of its segment.

Measured against an H100 (benchmarks/gpu_calibration.py, docs/planner.md): see the planner's docs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable

MIN_BLOCK = 512
SMALL_SIZE = 2**20  # largest request served from the small pool
SMALL_BUFFER = 2 * 2**20  # segment size for small requests
LARGE_BUFFER = 20 * 2**20  # segment size for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20


class _Block:
    __slots__ = ("addr", "size", "small", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small, self.free = addr, size, small, True
        self.prev: _Block | None = None
        self.next: _Block | None = None


def round_size(nbytes: int) -> int:
    """The block size the allocator serves ``nbytes`` with (before any split)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes reserved (``cudaMalloc``) for a request of ``size`` no free block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocatorModel:
    """``malloc(key, nbytes)`` and ``free(key)`` in program order; ``allocated``/``reserved`` now and
    their peaks (``peak_allocated``/``peak_reserved``), in bytes. Every call that changes a block is
    kept in ``trace`` (``(key, nbytes)``; ``nbytes`` None for a free), for :meth:`replay`."""

    def __init__(self) -> None:
        self.trace: list[tuple[Hashable, int | None]] = []
        # Free blocks of each pool (small: True), sorted by (size, address) as the allocator's sets are.
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._used: dict[Hashable, _Block] = {}
        self._next_addr = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: Hashable, nbytes: int) -> None:
        if nbytes <= 0 or key in self._used:
            return
        self.trace.append((key, nbytes))
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            block = _Block(self._next_addr, seg, small)
            self._next_addr += seg
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.addr + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            insort(pool, (tail.size, tail.addr, tail))
        block.free = False
        self._used[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        block = self._used.pop(key, None)
        if block is None:
            return
        self.trace.append((key, None))
        self.allocated -= block.size
        block.free = True
        pool = self._pools[block.small]
        for other in (block.prev, block.next):
            if other is None or not other.free:
                continue
            del pool[bisect_left(pool, (other.size, other.addr))]
            if other is block.prev:
                other.size += block.size
                other.next = block.next
                if block.next is not None:
                    block.next.prev = other
                block = other
            else:
                block.size += other.size
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
        insort(pool, (block.size, block.addr, block))

    def replay(self, start: int) -> None:
        """Run ``trace[start:]`` (one training step) again, as the next step would: the same requests in the
        same order, on the segments the first left behind, except that what the first step allocated and
        kept (the optimizer state it created) is not allocated again. Fragmentation grows over the first
        steps, and max_memory_reserved with it: DINO Swin-L reserves 2 GiB more in its second step."""
        events = self.trace[start:]
        kept = {key for key, _ in events if key in self._used}
        last = {key: i for i, (key, n) in enumerate(events) if n is not None and key in kept}
        for i, (key, nbytes) in enumerate(events):
            if last.get(key) == i:
                continue
            if nbytes is None:
                self.free(("again", key))
            else:
                self.malloc(("again", key), nbytes)
