"""The one-call layer's scratch is one buffer per thread, reused by later forwards (a fresh one
per forward costs page faults inside the step): same memory for a smaller and an equal batch,
a larger one only when a batch needs more, and another thread gets its own."""

import threading

from shared.model import cpu_kernels


def test_scratch_is_reused_per_thread_and_grows_only_when_needed():
    a = cpu_kernels.layer_scratch(1000)
    b = cpu_kernels.layer_scratch(600)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 600
    assert cpu_kernels.layer_scratch(1000).data_ptr() == a.data_ptr()
    big = cpu_kernels.layer_scratch(1 << 20)
    assert big.numel() == 1 << 20
    assert cpu_kernels.layer_scratch(10).data_ptr() == big.data_ptr()
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(cpu_kernels.layer_scratch(10).data_ptr()))
    t.start()
    t.join()
    assert other[0] != big.data_ptr()  # a forward on another thread never shares it
