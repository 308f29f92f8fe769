"""fa4.log: what the debug log says about a launch (the launches themselves: tests/gpu)."""
from fa4 import log


def test_tile_family_from_the_variant_name():
    assert log.tile_family_of("fa4_fwd_sm_90a_bf16_d64x64_causal_shortseq") == "short"
    assert log.tile_family_of("fa4_fwd_sm_90a_bf16_d128x128_none_longseq") == "long"
    assert log.tile_family_of("fa4_fwd_sm_90a_bf16_d128x128_none_longseq_softcap") == "long"
    assert log.tile_family_of("fa4_fwd_sm_90a_bf16_d256x256_causal") == "regular"
    assert log.tile_family_of("fa4_fwd_sm_90a_bf16_d128x128_local_kvcache") == "regular"


def test_backward_clusters_that_did_not_run_are_explained(monkeypatch):
    monkeypatch.delenv("FA4_BWD_CLUSTERS", raising=False)
    ran = {"name": "fa4_bwd_sm_90a_bf16_d256x256_local_longseq", "active_clusters": 66}
    assert log.clusters_not_run(ran) is None
    plain = {"name": "fa4_bwd_sm_90a_bf16_d128x128_local", "active_clusters": -1}
    assert log.clusters_not_run(plain) is None
    fell_back = {"name": "fa4_bwd_sm_90a_bf16_d256x256_local", "active_clusters": 0}
    assert log.clusters_not_run(fell_back) == ("the device holds 0 of the cluster kernel's clusters at once, too "
                                               "few: fa4_bwd_sm_90a_bf16_d256x256_local (one CTA per block) ran")
    monkeypatch.setenv("FA4_BWD_CLUSTERS", "1")
    assert log.clusters_not_run(plain) == ("FA4_BWD_CLUSTERS=1: no cluster kernel for this call, so "
                                           "fa4_bwd_sm_90a_bf16_d128x128_local ran")
    assert log.clusters_not_run(ran) is None


def test_a_forced_family_that_did_not_run_is_explained(monkeypatch):
    monkeypatch.delenv("FA4_TILES", raising=False)
    assert log.forced_family_not_run("fa4_fwd_sm_90a_bf16_d256x256_causal") is None
    monkeypatch.setenv("FA4_TILES", "short")
    assert log.forced_family_not_run("fa4_fwd_sm_90a_bf16_d64x64_causal_shortseq") is None
    why = log.forced_family_not_run("fa4_fwd_sm_90a_bf16_d256x256_causal")
    assert why == "FA4_TILES=short: no such variant for this call, so fa4_fwd_sm_90a_bf16_d256x256_causal " \
                  "(regular tiles) ran"
