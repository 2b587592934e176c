"""Resident slots first: SGLang's KV allocator, made to hand out a streamed pool's resident slots
before its streamed ones.

A streamed pool with resident rows (`pool.py`) streams only slots at or above `resident_rows`.
SGLang's allocators hand out `free_pages` from the front and put freed pages at the back (token
allocator) or the front (paged allocator), so after some traffic a short request could land on
streamed slots while resident ones are free. `prefer_resident` keeps `free_pages` sorted on the
allocator SGLang built, with SGLang's own means:

- frees are held back (SGLang's `need_sort` mode, which PD disaggregation uses);
- before each allocation the held-back pages rejoin with SGLang's `merge_and_sort_free` (a no-op
  when nothing was freed since; else one sort of the free list).

Allocations take from the front of a sorted list, so a request gets the lowest free slots:
resident ones while there are any, and the part of a context that does not fit in them is
streamed. Admission in streamed mode is therefore per slot, decided by what is free locally.
The allocator class is SGLang's, subclassed at run time (`_resident_first`), and the allocator
SGLang built is swapped to it (`touchpoints.RESIDENT_FIRST`, checked at start-up).
"""

from __future__ import annotations

ALLOC_METHODS = ("alloc", "alloc_extend", "alloc_decode")


def _resident_first(base: type) -> type:
    """`base` (an SGLang allocator class) whose allocations first sort freed pages back in.
    A direct subclass adding no slots, so an instance of `base` may become one."""

    def wrap(name: str):
        orig = getattr(base, name)

        def method(self, *args, **kwargs):
            self.merge_and_sort_free()
            return orig(self, *args, **kwargs)

        method.__name__ = name
        return method

    body = {name: wrap(name) for name in ALLOC_METHODS if hasattr(base, name)}
    body.update(__slots__=(), __module__=__name__)
    return type(f"ResidentFirst{base.__name__}", (base,), body)


_classes: dict[type, type] = {}


def prefer_resident(allocator):
    """Make `allocator` (built by SGLang for a streamed pool) hand out its lowest free slots
    first, hence the resident ones (every slot below the pool's first streamed row). Returns it."""
    cls = type(allocator)
    if cls not in _classes.values():
        if cls not in _classes:
            _classes[cls] = _resident_first(cls)
        allocator.__class__ = _classes[cls]
    allocator.need_sort = True
    allocator.merge_and_sort_free()
    return allocator
