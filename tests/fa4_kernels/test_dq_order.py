"""The backward's rotated visit order and deterministic dQ turns (src/fa4_kernels/dq_order.py),
checked on Python ints against a direct model: turns are each query block's arrival order, and a
schedule with a chunk resident at a time always finishes, without the ascending turns' skew."""
import itertools

import pytest

from fa4_kernels.dq_order import rotated_turn, rotation_start

SHAPES = [(1, 1), (1, 7), (5, 1), (3, 8), (8, 3), (7, 7), (13, 5), (16, 64), (64, 16), (33, 33), (40, 9)]


def arrival_order(n_blocks, m_blocks, period, visit):
    """The blocks in the order they reach query block ``visit`` (one query block per step from
    their start), chunk by chunk, ties in block order."""
    def step(n):
        return (visit - rotation_start(n, n_blocks, m_blocks, period)) % m_blocks
    return sorted(range(n_blocks), key=lambda n: (n // period, step(n), n))


@pytest.mark.parametrize("n_blocks,m_blocks", SHAPES)
@pytest.mark.parametrize("period", [1, 2, 5, 8, 1 << 30])
def test_turns_are_the_arrival_order(n_blocks, m_blocks, period):
    for visit in range(m_blocks):
        order = arrival_order(n_blocks, m_blocks, period, visit)
        turns = [rotated_turn(n, visit, n_blocks, m_blocks, period) for n in range(n_blocks)]
        assert [order.index(n) for n in range(n_blocks)] == turns, (visit, turns)


@pytest.mark.parametrize("n_blocks,m_blocks", SHAPES)
def test_one_chunk_is_the_plain_rotation(n_blocks, m_blocks):
    # The default (non-deterministic) rotation: block n of N starts n / N of the way round.
    for n in range(n_blocks):
        assert rotation_start(n, n_blocks, m_blocks, 1 << 30) == n * m_blocks // n_blocks
        assert rotation_start(n, n_blocks, m_blocks, n_blocks) == n * m_blocks // n_blocks


def simulate(n_blocks, m_blocks, slots, start, turn):
    """Ticks until every K/V block (launched in block order into ``slots`` resident places) has
    added into every query block in its turn, one visit per tick; None on a deadlock."""
    counters = [0] * m_blocks
    done = [0] * n_blocks  # visits made
    resident, launched, ticks = [], 0, 0
    while any(d < m_blocks for d in done):
        while len(resident) < slots and launched < n_blocks:
            resident.append(launched)
            launched += 1
        ready = []
        for n in resident:
            m = (start(n) + done[n]) % m_blocks
            if counters[m] == turn(n, m):
                ready.append((n, m))
        if not ready:
            return None
        for n, m in ready:
            counters[m] += 1
            done[n] += 1
        resident = [n for n in resident if done[n] < m_blocks]
        ticks += 1
    return ticks


@pytest.mark.parametrize("n_blocks,m_blocks,slots", [(16, 16, 16), (32, 8, 32), (24, 24, 8), (40, 12, 13),
                                                     (9, 30, 4)])
def test_chunks_no_larger_than_the_gpu_finish_without_skew(n_blocks, m_blocks, slots):
    period = min(n_blocks, slots)
    rotated = simulate(n_blocks, m_blocks, slots, lambda n: rotation_start(n, n_blocks, m_blocks, period),
                       lambda n, m: rotated_turn(n, m, n_blocks, m_blocks, period))
    ascending = simulate(n_blocks, m_blocks, slots, lambda n: 0, lambda n, m: n)
    assert rotated is not None and ascending is not None
    assert rotated <= ascending
    if slots >= n_blocks:  # all resident: no block ever waits
        assert rotated == m_blocks * max(1, -(-n_blocks // m_blocks)) or rotated == m_blocks
    chunks = -(-n_blocks // period)
    assert rotated <= chunks * (m_blocks + -(-period // m_blocks) * m_blocks)


def test_a_chunk_larger_than_the_gpu_can_deadlock():
    # Why the host caps the period at the resident CTAs: the model finds the hang it prevents.
    n_blocks, m_blocks, slots = 8, 8, 4
    assert simulate(n_blocks, m_blocks, slots, lambda n: rotation_start(n, n_blocks, m_blocks, n_blocks),
                    lambda n, m: rotated_turn(n, m, n_blocks, m_blocks, n_blocks)) is None


def test_turns_stay_in_range():
    for n_blocks, m_blocks, period in itertools.product(range(1, 12), range(1, 12), range(1, 14)):
        for visit in range(m_blocks):
            turns = sorted(rotated_turn(n, visit, n_blocks, m_blocks, period) for n in range(n_blocks))
            assert turns == list(range(n_blocks))
