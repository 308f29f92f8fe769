"""The split tail's partials layout (src/fa4_kernels/split_partials.py) against the workspace the
shim allocates (csrc_shims/fa4_shim.c, fa4_split_workspace: tile_m * (head_dim_v + 8) fp32 words
per CTA slot)."""
import pytest

pytest.importorskip("cutlass")
from fa4_kernels.split_partials import CHUNK, chunk_index, partial_words_per_thread  # noqa: E402


@pytest.mark.parametrize("head_dim_v", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("warpgroups", [1, 2, 3])
def test_chunks_fill_the_shims_slots_once(head_dim_v, warpgroups):
    threads, tile_m, slots = 128 * warpgroups, 64 * warpgroups, 3
    words = partial_words_per_thread(head_dim_v)
    assert words % CHUNK == 0  # a thread's words are whole chunks
    slot_words = tile_m * (head_dim_v + 8)
    seen = set()
    for slot in range(slots):
        for t in range(threads):
            for w in range(0, words, CHUNK):
                first = chunk_index(slot, w, t, words, threads) * CHUNK
                # every chunk inside its own slot, and no word written twice
                assert slot * slot_words <= first and first + CHUNK <= (slot + 1) * slot_words
                seen.update(range(first, first + CHUNK))
    assert seen == set(range(slots * slot_words))


def test_a_warps_chunks_are_contiguous():
    # One chunk index over a warp's 32 threads: 512 contiguous bytes (one 128-bit access each).
    words, threads = partial_words_per_thread(128), 256
    for slot, w, warp in [(0, 0, 0), (5, 64, 3), (2, 32, 7)]:
        firsts = [chunk_index(slot, w, warp * 32 + lane, words, threads) for lane in range(32)]
        assert firsts == list(range(firsts[0], firsts[0] + 32))
