"""Frames in shared memory: a ring of fixed-size image slots two processes map.

The engine process writes each rendered frame into a free slot of the ring it made for a media
worker and tells the worker the slot's number; the worker copies the image out and hands the
slot back. Images cross between the processes as one memory copy each, never pickled.
The maker unlinks the segment's name once the other side has mapped it (:meth:`unlink`), so
nothing is left in ``/dev/shm`` when either process dies.
"""

from __future__ import annotations

import threading
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import numpy.typing as npt

__all__ = ["FrameRing", "SlotsExhausted"]

U8 = npt.NDArray[np.uint8]


class SlotsExhausted(TimeoutError):
    """No slot came free in time: the reader is not handing slots back."""


class FrameRing:
    """``slots`` images of ``shape`` (uint8) in one shared-memory segment."""

    def __init__(self, memory: shared_memory.SharedMemory, slots: int, shape: tuple[int, ...]):
        self._memory = memory
        self.name = memory.name
        self.slots = slots
        self.shape = tuple(shape)
        self._array: U8 = np.ndarray((slots, *self.shape), np.uint8, memory.buf)
        self._free = list(range(slots))
        self._changed = threading.Condition()
        self._closed = False

    @classmethod
    def create(cls, slots: int, shape: tuple[int, ...]) -> FrameRing:
        size = int(slots * np.prod(shape))
        return cls(shared_memory.SharedMemory(create=True, size=max(1, size)), slots, shape)

    @classmethod
    def attach(cls, name: str, slots: int, shape: tuple[int, ...]) -> FrameRing:
        memory = shared_memory.SharedMemory(name=name)
        # The maker owns the name; without this, this process's resource tracker would unlink
        # it (or warn of a leak) when this process exits.
        resource_tracker.unregister("/" + memory.name, "shared_memory")
        return cls(memory, slots, shape)

    # The writer's side ----------------------------------------------------------------------

    def put(self, images: list[U8], timeout: float) -> list[int]:
        """Write ``images`` into free slots and return their numbers; waits up to ``timeout``
        for slots to come back (raises :class:`SlotsExhausted`). A closed ring takes nothing
        and returns no slots."""
        with self._changed:
            enough = self._changed.wait_for(
                lambda: self._closed or len(self._free) >= len(images), timeout
            )
            if self._closed:
                return []
            if not enough:
                raise SlotsExhausted(f"{len(images)} frames waited {timeout} s for a free slot")
            taken = [self._free.pop() for _ in images]
            # Written under the lock: close() cannot unmap the memory halfway through.
            for slot, image in zip(taken, images, strict=True):
                self._array[slot] = image
        return taken

    def fill(self, images: list[U8]) -> None:
        """Slot i holds image i, for good (a ring of frames that never change)."""
        with self._changed:
            self._free = []
        for slot, image in enumerate(images):
            self._array[slot] = image

    def release(self, slots: list[int]) -> None:
        """The reader is done with ``slots``."""
        with self._changed:
            self._free.extend(s for s in slots if 0 <= s < self.slots and s not in self._free)
            self._changed.notify_all()

    # The reader's side ----------------------------------------------------------------------

    def copy(self, slot: int) -> U8:
        """The image in ``slot``, copied out of the shared memory."""
        return np.array(self._array[slot])

    def view(self, slot: int) -> U8:
        """The image in ``slot`` in place (for images that never change, such as idle frames)."""
        view: U8 = self._array[slot]
        view.flags.writeable = False
        return view

    def unlink(self) -> None:
        """Remove the segment's name (the maker does, once the other side has it mapped)."""
        try:
            self._memory.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            self._array = np.zeros((0, *self.shape), np.uint8)
        try:
            self._memory.close()
        except BufferError:  # a view still in use: the mapping goes with the process
            pass
