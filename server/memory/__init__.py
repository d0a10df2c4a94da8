"""The server's memory, in one place: what a request costs, the budget it is admitted against,
the heap's modes and the passes that give memory back, and the table of every size bound.

    costs.py     what one request and one run hold (estimates; default budget from cgroup/meminfo)
    budget.py    MemoryBudget, Reservation, MemoryTooLarge, MemoryExhausted (--memory-limit-bytes)
    heap.py      glibc's allocator: roomy or lean, trims, the cyclic collector's freeze
    reclaim.py   Reclaimer: the budget's on_idle/on_crowded turned into heap passes
    limits.py    LIMITS: each size bound, its default, its setting and where it is enforced

docs/memory.md ("Memory") explains the model; docs/design.md the why of each mechanism.
"""
