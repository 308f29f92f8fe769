"""The backward's rotated visit order and deterministic dQ turns (src/fa4_kernels/dq_order.py),
checked on Python ints against a direct model: turns are each query block's arrival order, and a
schedule with a chunk resident at a time always finishes, without the ascending turns' skew."""
import itertools

import pytest

from fa4_kernels.dq_order import rotated_turn, rotation_start
from fa4_kernels.tile_scheduler import StaticPersistentScheduler

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


# ------------------------------------------------------------------ spaced turns (several chunks)
def launch_order(n_blocks, pairs, group):
    """(K/V block, pair) per CTA in launch order: the grid's (pair by pair) or, with ``group`` > 0,
    the kernel's launch groups (FlashAttentionBackwardSm90.launch_order: the forward's
    ``coordinates``, block n of every pair of a group before block n + 1)."""
    if group == 0:
        return [(n, p) for p in range(pairs) for n in range(n_blocks)]
    sched = StaticPersistentScheduler(n_blocks, pairs, 1, group, False, 0)
    return [(n, p) for n, p, _ in (sched.coordinates(t) for t in range(n_blocks * pairs))]


def timed_turns(n_blocks, m_blocks, pairs, slots, period, group, step, land, notice=0, stages=1):
    """Ticks until a deterministic backward's CTAs, launched in order into ``slots`` SMs as they
    free up, have added into every query block of their pair in their turns: a visit's GEMMs take
    ``step`` ticks and run up to ``stages`` visits ahead of the CTA's dQ writer; the writer waits
    for the visit's turn, then is busy ``land`` ticks (its reduce-adds landing, the fence and the
    pass), and the next writer sees the pass ``notice`` ticks after it (its poll). A query block's
    chain then takes land + notice per link, a writer land per visit. None on a deadlock."""
    order = launch_order(n_blocks, pairs, group)
    counters = [[0] * m_blocks for _ in range(pairs)]
    passed_at = [[-notice] * m_blocks for _ in range(pairs)]
    ctas, launched, ticks = [], 0, 0
    while launched < len(order) or ctas:
        while len(ctas) < slots and launched < len(order):
            n, p = order[launched]
            launched += 1
            ctas.append({"n": n, "p": p, "start": rotation_start(n, n_blocks, m_blocks, period), "computed": 0,
                         "computing": 0, "written": 0, "writing": 0})
        moved = False
        for c in ctas:
            if c["writing"]:
                c["writing"] -= 1
                moved = True
                if not c["writing"]:
                    m = (c["start"] + c["written"]) % m_blocks
                    counters[c["p"]][m] += 1
                    passed_at[c["p"]][m] = ticks
                    c["written"] += 1
            elif c["written"] < c["computed"]:
                m = (c["start"] + c["written"]) % m_blocks
                if counters[c["p"]][m] == rotated_turn(c["n"], m, n_blocks, m_blocks, period):
                    moved = True  # waiting out a poll counts as progress
                    if ticks - passed_at[c["p"]][m] >= notice:
                        c["writing"] = land
            if c["computing"]:
                c["computing"] -= 1
                moved = True
                if not c["computing"]:
                    c["computed"] += 1
            elif c["computed"] < m_blocks and c["computed"] - c["written"] <= stages:
                c["computing"] = step
                moved = True
        if not moved:
            return None
        ctas = [c for c in ctas if c["written"] < m_blocks]
        ticks += 1
    return ticks


def spaced(n_blocks, pairs, slots, spacing):
    """(period, launch group) by the host's rules (fa4.heuristics over libfa4_rules.so) for a
    deterministic unmasked call of square blocks."""
    from fa4 import heuristics

    period = heuristics.bwd_rotate("none", True, False, n_blocks, slots, tile=(64, 64), spacing=spacing)
    group = heuristics.bwd_launch_group("none", False, True, period, n_blocks, pairs=pairs, num_sms=slots)
    return period, group


@pytest.mark.parametrize("n_blocks,pairs,slots", [(16, 6, 24), (16, 7, 24), (8, 13, 20), (12, 5, 12), (10, 9, 16),
                                                  (6, 11, 13)])
@pytest.mark.parametrize("spacing", [1, 2, 3])
def test_spaced_turns_by_the_host_rules_always_finish(n_blocks, pairs, slots, spacing):
    period, group = spaced(n_blocks, pairs, slots, spacing)
    assert period > 0 and (spacing > 1 or group == 0)
    if group:  # every group's chunks, the last group's leftover pairs too, fit the SMs at once
        assert (pairs if pairs <= group else group + pairs % group) * period <= slots
    assert timed_turns(n_blocks, n_blocks, pairs, slots, period, group, step=4, land=3, notice=2) is not None


def test_a_last_group_spread_past_the_sms_deadlocks():
    # Why fa4_bwd_launch_group sizes the groups by their leftovers too: 7 pairs in groups of 3
    # end with a group of 4 pairs, whose chunks of 8 spread over 32 CTAs, past 24 SMs.
    n_blocks, pairs, slots, period = 16, 7, 24, 8
    assert timed_turns(n_blocks, n_blocks, pairs, slots, period, 3, step=4, land=3, notice=2) is None
    assert spaced(n_blocks, pairs, slots, 2) == (8, 2)


def test_spaced_turns_hide_a_hand_over_longer_than_a_step():
    # Session 49's bound on rotated turns: with one chunk a query block's visitors come a step apart,
    # so a link (a writer's landing and pass, then the next writer's poll) longer than a step sets
    # the pace; two chunks give each link two steps, while each writer still lands once per step.
    # Eight pairs of 16 blocks on 33 SMs: groups of 4 pairs fill 32 of them. A model of the
    # kernel's chain with hd192's proportions (step ~2.4 us, link ~1.35 steps: deterministic at
    # ~0.78 of the default, as measured), not a measurement.
    n_blocks, pairs, slots = 16, 8, 33
    one, two = (spaced(n_blocks, pairs, slots, s) for s in (1, 2))
    assert one == (16, 0) and two == (8, 4)
    free = timed_turns(n_blocks, n_blocks, pairs, slots, *one, step=20, land=8)  # a link shorter than a step
    assert timed_turns(n_blocks, n_blocks, pairs, slots, *two, step=20, land=8) == free
    long_link = [timed_turns(n_blocks, n_blocks, pairs, slots, *cfg, step=20, land=13, notice=14) for cfg in (one, two)]
    assert long_link[0] > 1.2 * free and long_link[1] < 1.05 * free
