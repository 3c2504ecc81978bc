"""Process-wide settings (runtime.py)."""

import gc
import weakref

from jaxinfer import runtime


class Node:
    def __init__(self):
        self.partner = None


def test_freeze_loaded_objects_freezes_the_living_and_frees_garbage_cycles_first():
    """Objects alive go to the permanent generation; a cycle already garbage is collected, not frozen forever."""
    alive = Node()
    garbage_a, garbage_b = Node(), Node()
    garbage_a.partner, garbage_b.partner = garbage_b, garbage_a
    gone = weakref.ref(garbage_a)
    del garbage_a, garbage_b
    try:
        runtime.freeze_loaded_objects()
        assert gone() is None
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive for obj in gc.get_objects())  # frozen objects are outside every generation
    finally:
        gc.unfreeze()
    assert any(obj is alive for obj in gc.get_objects())
