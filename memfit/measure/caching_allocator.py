"""A model of PyTorch's CUDA caching allocator, replayed over the storages a (fake) step allocates and
frees: what ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` would read on a GPU.

Our own because torch has none: its memory snapshots and ``MemTracker`` read a real allocator. The
rules are ``c10/cuda/CUDACachingAllocator.cpp``'s defaults (no expandable segments, ``max_split_size``
or garbage collection; segments are never released during training):

* a request is rounded up to a multiple of 512 bytes;
* requests up to 1 MiB come from the small pool, larger ones from the large pool; each stream has its
  own pools: a block freed by one stream is reused only by requests on that stream;
* the smallest free block of the pool that fits is used (ties: the lowest address); it is split when
  what remains is at least 512 bytes (small pool) or more than 1 MiB (large pool), else the whole
  block is allocated and counts as allocated;
* with no free block, a segment is reserved (``cudaMalloc``): 2 MiB for a small request, 20 MiB for a
  large one under 10 MiB, else the request rounded up to 2 MiB;
* a freed block merges with free neighbours of its segment.

Checked against the real allocator's traces of training steps (tests/measure/test_allocator_traces.py):
given cudaMalloc's segment addresses, every block lands where torch put it; see docs/planner.md.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Sequence

MIN_BLOCK = 512
SMALL_SIZE = 2**20  # largest request served from the small pool
SMALL_BUFFER = 2 * 2**20  # segment size for small requests
LARGE_BUFFER = 20 * 2**20  # segment size for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20
# Blocks a process may hold before its training step that the step does not show: what its model's construction, the
# libraries' handles or a user's own tensors left. Which segments a step's blocks land in can turn on one such block:
# DINO Swin-L with both its checkpointings reserves 12.05 GiB on the simulated allocator, 13.03 GiB beside a 2 MiB
# block held from the start (13.09 on an H100); its AMP row reserved 9.25 and 9.90 GiB in two H100 runs.
STRAY_BLOCKS = (2 * 2**20, 6 * 2**20)
_BESIDE_STRAYS: dict[Hashable, int] = {}  # reserved_beside_strays' figures by their calls' sizes and order


_ADDR_BITS = 64  # a free block's place in its pool: size << _ADDR_BITS | address (any 64-bit address: a trace's CUDA
# addresses take 47 bits)


class _Pool:
    """The free blocks of one (stream, small) pool, ordered by (size, address) as the allocator's sets are: sorted
    integer keys (``size << _ADDR_BITS | address``; ints compare faster than tuples) and each key's block."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}


class _Block:
    __slots__ = ("addr", "size", "small", "stream", "free", "prev", "next", "pool", "requested")

    def __init__(self, addr: int, size: int, small: bool, stream: Hashable, pool: _Pool) -> None:
        self.addr, self.size, self.small, self.stream, self.free, self.pool = addr, size, small, stream, True, pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.requested = 0  # the bytes asked for (before rounding) while allocated


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
    """``malloc(key, nbytes, stream)`` and ``free(key)`` in program order; ``allocated``/``reserved`` now
    and their peaks (``peak_allocated``/``peak_reserved``), in bytes; ``segments``: ``(address, size,
    stream)`` of each segment reserved, in order. A block freed by one stream is reused only by requests
    on the same stream (streams are any hashable; 0 the default one). Every call that changes a block is
    kept in ``trace`` (``(key, nbytes)``; ``nbytes`` None for a free; a request's stream is kept apart), for
    :meth:`replay`."""

    def __init__(self) -> None:
        self.trace: list[tuple[Hashable, int | None]] = []
        self._trace_streams: dict[int, Hashable] = {}  # index in trace -> stream, where not 0
        self.segments: list[tuple[int, int, Hashable]] = []
        # Free blocks of each (stream, small) pool, sorted by (size, address) as the allocator's sets are.
        self._pools: dict[Hashable, tuple[_Pool, _Pool]] = {}  # each stream's (large, small) pools
        self._used: dict[Hashable, _Block] = {}
        self._heads: list[_Block] = []  # each segment's first block
        self._next_addr = 0
        self._placed: int | None = None  # the address of the next segment, where given
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        # Bytes requested by the live blocks (before rounding) and their peak: what the program itself holds.
        self.requested = self.peak_requested = 0

    def next_segment_at(self, addr: int) -> None:
        """The address the next segment reserved takes (cudaMalloc's choice, read from a recorded trace).
        By default each segment lies above the ones before; where free blocks of a pool tie on size, the
        one at the lowest address is used, so addresses decide ties."""
        self._placed = addr

    def _reserve(self, head: _Block, size: int) -> None:
        self.segments.append((head.addr, size, head.stream))
        self._heads.append(head)
        self._next_addr = max(self._next_addr, head.addr + size)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def address(self, key: Hashable) -> int | None:
        """The address of the block ``key`` holds (None when it holds none)."""
        block = self._used.get(key)
        return None if block is None else block.addr

    def segment_blocks(self) -> list[tuple[int, int, Hashable, list[tuple[int, int, bool]]]]:
        """Each segment as ``(address, size, stream, blocks)``, blocks ``(address, size, allocated)`` in
        address order, as torch's memory snapshot lists them."""
        out = []
        for head in self._heads:
            blocks, b = [], head
            while b is not None:
                blocks.append((b.addr, b.size, not b.free))
                b = b.next
            out.append((head.addr, sum(n for _, n, _ in blocks), head.stream, blocks))
        return out

    def add_segment(self, size: int, blocks: Sequence[tuple[Hashable | None, int]] = (), stream: Hashable = 0,
                    addr: int | None = None) -> int:
        """A segment that exists already (a replay's initial state): ``blocks`` are ``(key, size)`` in address
        order, key None for a free block (one free block of the whole segment when empty); a 2 MiB
        segment is of the small pool. Returns its address (``addr``, or above every segment so far)."""
        addr = self._next_addr if addr is None else addr
        blocks = list(blocks) or [(None, size)]
        if sum(n for _, n in blocks) != size:
            raise ValueError(f"blocks of {sum(n for _, n in blocks)} bytes in a segment of {size}")
        small, chain, at = size <= SMALL_BUFFER, [], addr
        pool = self._pool(stream, small)
        for _, n in blocks:
            block = _Block(at, n, small, stream, pool)
            block.free, at = False, at + n
            if chain:
                chain[-1].next, block.prev = block, chain[-1]
            chain.append(block)
        self._reserve(chain[0], size)
        for (key, n), block in zip(blocks, chain):
            if key is None:  # free: merged with a free neighbour, as the allocator would have
                self._insert_free(block)
            else:
                self._used[key] = block
                self.allocated += n
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return addr

    def malloc(self, key: Hashable, nbytes: int, stream: Hashable = 0) -> None:
        """Allocate ``nbytes`` for ``key`` (ignored if ``key`` holds a block or ``nbytes`` is not positive)."""
        if nbytes <= 0 or key in self._used:
            return
        if stream != 0:
            self._trace_streams[len(self.trace)] = stream
        self.trace.append((key, nbytes))
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size's, inlined: the planner's hottest call
        small = size <= SMALL_SIZE
        pool = (self._pools.get(stream) or self._new_pools(stream))[small]  # _pool's, inlined
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        if i < len(keys):
            block = pool.blocks.pop(keys.pop(i))
        else:
            seg = segment_size(size)
            addr, self._placed = (self._next_addr if self._placed is None else self._placed), None
            block = _Block(addr, seg, small, stream, pool)
            self._reserve(block, seg)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.addr + size, rest, small, stream, pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            k = rest << _ADDR_BITS | tail.addr
            insort(keys, k)
            pool.blocks[k] = tail
        block.free = False
        block.requested = nbytes
        self._used[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self.requested += nbytes
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def free(self, key: Hashable) -> None:
        """Free ``key``'s block (ignored if it holds none); for a block under ``record_stream``, call it when
        torch completes the free (the trace's 'free_completed'), not when it is requested."""
        block = self._used.pop(key, None)
        if block is None:
            return
        self.trace.append((key, None))
        self.allocated -= block.size
        self.requested -= block.requested
        self._insert_free(block)

    def _new_pools(self, stream: Hashable) -> tuple[_Pool, _Pool]:
        self._pools[stream] = pools = (_Pool(), _Pool())
        return pools

    def _pool(self, stream: Hashable, small: bool) -> _Pool:
        return (self._pools.get(stream) or self._new_pools(stream))[small]

    def _insert_free(self, block: _Block) -> _Block:
        """Mark ``block`` free, merged with its free neighbours, in its pool; the merged block."""
        block.free = True
        pool = block.pool
        keys, blocks = pool.keys, pool.blocks
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            k = prev.size << _ADDR_BITS | prev.addr
            del keys[bisect_left(keys, k)]
            del blocks[k]
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            k = nxt.size << _ADDR_BITS | nxt.addr
            del keys[bisect_left(keys, k)]
            del blocks[k]
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        k = block.size << _ADDR_BITS | block.addr
        insort(keys, k)
        blocks[k] = block
        return block

    @classmethod
    def rerun(cls, trace: Sequence[tuple[Hashable, int | None]], streams: dict[int, Hashable] | None = None,
              held: int = 0) -> CachingAllocatorModel:
        """A model that ran another's ``trace`` (``streams``: its requests' streams where not 0, by index), after a
        block of ``held`` bytes it keeps (none by default)."""
        model = cls()
        model.malloc(("held from the start",), held)
        streams = streams or {}
        for i, (key, nbytes) in enumerate(trace):
            if nbytes is None:
                model.free(key)
            else:
                model.malloc(key, nbytes, streams.get(i, 0))
        return model

    def reserved_beside_strays(self) -> int:
        """The largest peak reserved of this model's calls, as they ran and run again beside each of
        :data:`STRAY_BLOCKS` (less the segment the stray block took): what a GPU may reserve for them, whichever way
        its segments fragment. Segments are never released, so a peak reserved is the last; a stray block is of the
        large pool, so only the large pool's calls run again, beside the small pool's segments as they were. Calls
        of the same sizes in the same order (a planner's rows that differ in what does not allocate) run once."""
        live: dict[Hashable, int] = {}
        large: list[tuple[Hashable, int | None]] = []
        streams: dict[int, Hashable] = {}
        shape = []  # each large allocation's size; each free, how many calls back its block was allocated
        for i, (key, n) in enumerate(self.trace):
            if n is None:
                if key in live:
                    shape.append(live.pop(key) - len(large) - 1)
                    large.append((key, None))
            elif n > SMALL_SIZE:  # over 1 MiB (rounded up to 512 bytes too): the large pool's
                if i in self._trace_streams:
                    streams[len(large)] = self._trace_streams[i]
                live[key] = len(large)
                large.append((key, n))
                shape.append(n)
        small = sum(head.size for head in self._heads if head.small)
        fingerprint = (len(shape), hash(tuple(shape)), hash(tuple(sorted(streams.items()))), small, self.peak_reserved)
        if fingerprint not in _BESIDE_STRAYS:
            if len(_BESIDE_STRAYS) >= 1024:
                _BESIDE_STRAYS.clear()
            _BESIDE_STRAYS[fingerprint] = max(self.peak_reserved, *(
                self.rerun(large, streams, n).reserved - segment_size(round_size(n)) + small for n in STRAY_BLOCKS))
        return _BESIDE_STRAYS[fingerprint]

    def calls(self) -> tuple[list[tuple[Hashable, int | None]], dict[int, Hashable]]:
        """``(trace, streams)``, what :meth:`rerun` takes (copies)."""
        return list(self.trace), dict(self._trace_streams)

    def held_since(self, start: int) -> list[Hashable]:
        """The keys allocated since ``trace[start]`` that still hold a block."""
        return list(dict.fromkeys(key for key, n in self.trace[start:] if n is not None and key in self._used))

    def finish_steps(self, start: int, epilogue: Sequence[tuple[int, int | None]], made: Iterable[Hashable],
                     micro_steps: int = 1, tail: Sequence[tuple[Hashable, int | None, Hashable]] = ()) -> None:
        """The calls since ``trace[start]`` were a forward/backward: end its training step with an optimizer
        step's calls (``epilogue``: ``(i, nbytes)`` and ``(i, None)``, its state kept), free what the step made and
        still holds (``made``: the gradients, which ``zero_grad`` frees), then run the step again as the next
        would (:meth:`replay`): a real run's second step on the segments the first left. ``tail``: the step's calls
        after its backward returned (``(key, nbytes, stream)``, ``nbytes`` None for a free: what the train step
        lets go when it returns, its batch and loss), which come after the optimizer's. ``micro_steps`` > 1: the
        forward/backward runs again before the optimizer step as a later micro-step of gradient accumulation
        (:meth:`accumulate`), in both steps."""
        late = {key for key, nbytes, _ in tail if nbytes is None}
        made = [key for key in made if key not in late]
        if micro_steps > 1:
            end = len(self.trace)
            self.run(tail)  # the first micro-step's train step returns
            self.accumulate(start, end, set(made))
            tail = [(("micro", key), nbytes, stream) for key, nbytes, stream in tail]
        for i, nbytes in epilogue:
            if nbytes is None:
                self.free(("optimizer", i))
            else:
                self.malloc(("optimizer", i), nbytes)
        for key in made:
            self.free(key)
        self.run(tail)
        self.replay(start)

    def run(self, calls: Iterable[tuple[Hashable, int | None, Hashable]]) -> None:
        """Make ``calls`` (``(key, nbytes, stream)``, ``nbytes`` None for a free)."""
        for key, nbytes, stream in calls:
            if nbytes is None:
                self.free(key)
            else:
                self.malloc(key, nbytes, stream)

    def accumulate(self, start: int, end: int, made: set[Hashable]) -> None:
        """Run ``trace[start:end]`` (a forward/backward) again as a later micro-step of gradient accumulation would:
        what it made and kept (``made``: the gradients) is now a temporary, freed as soon as it is made (autograd
        adds it into the kept gradient in place)."""
        for i, (key, nbytes) in enumerate(self.trace[start:end]):
            if nbytes is None:
                self.free(("micro", key))
                continue
            self.malloc(("micro", key), nbytes, self._trace_streams.get(start + i, 0))
            if key in made:
                self.free(("micro", key))

    def replay(self, start: int) -> None:
        """Run ``trace[start:]`` (one training step) again, as the next step would: the same requests in the
        same order, on the segments the first left behind, except that what the first step allocated and
        kept (the optimizer state it created) is not allocated again. Fragmentation grows over the first
        steps, and max_memory_reserved with it: DINO Swin-L reserves 2 GiB more in its second step."""
        for i in self.replayed(start):
            key, nbytes = self.trace[i]
            if nbytes is None:
                self.free(("again", key))
            else:
                self.malloc(("again", key), nbytes, self._trace_streams.get(i, 0))

    def replayed(self, start: int) -> list[int]:
        """The calls (indices of ``trace``) that :meth:`replay` from ``start`` would make again, in order: all but
        the last allocation of each block the step kept."""
        events = self.trace[start:]
        kept = {key for key, _ in events if key in self._used}
        last = {key: i for i, (key, n) in enumerate(events) if n is not None and key in kept}
        return [start + i for i, (key, _) in enumerate(events) if last.get(key) != i]
