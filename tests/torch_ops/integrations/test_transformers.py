"""fa4 as a transformers attention implementation (small random Llama, no downloads; CPU, fp32):
logits, gradients and generate() match attn_implementation="sdpa" for dense, padded and
padding-free packed batches, eager and compiled."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import fa4.integrations.transformers as fa4_hf  # noqa: E402


def models(device="cpu", dtype=torch.float32, head_dim=32):
    """(fa4 model, sdpa model) with the same random weights: GQA, 4 query and 2 K/V heads."""
    fa4_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    ref = transformers.LlamaForCausalLM(config).to(device, dtype)
    model = transformers.LlamaForCausalLM(config).to(device, dtype)
    model.load_state_dict(ref.state_dict())
    ref.set_attn_implementation("sdpa")
    model.set_attn_implementation("fa4")
    return model, ref


def grads(model, loss):
    loss.backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def test_dense_logits_and_gradients_match_sdpa():
    model, ref = models()
    x = torch.randint(0, 128, (2, 37))
    a, b = model(x).logits, ref(x).logits
    assert torch.allclose(a, b, atol=1e-5)
    for ga, gb in zip(grads(model, a.square().mean()), grads(ref, b.square().mean())):
        assert torch.allclose(ga, gb, atol=1e-5)


def test_padded_batch_matches_sdpa():
    model, ref = models()
    x = torch.randint(0, 128, (3, 29))
    mask = torch.ones(3, 29, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    mask[2, :1] = 0
    a, b = model(x, attention_mask=mask).logits, ref(x, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-5)


def test_padding_free_packed_batch_matches_separate_sequences():
    model, ref = models()
    lengths = [11, 5, 20]
    seqs = [torch.randint(0, 128, (1, n)) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(packed, position_ids=position_ids).logits
    want = torch.cat([ref(s).logits for s in seqs], dim=1)
    assert torch.allclose(out, want, atol=1e-5)
    # the flattening collator's form: cu_seq_lens and max_length given
    cu = torch.tensor([0, 11, 16, 36], dtype=torch.int32)
    out2 = model(packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20,
                 max_length_k=20).logits
    assert torch.allclose(out2, want, atol=1e-5)


def test_generate_matches_sdpa():
    model, ref = models()
    x = torch.randint(1, 128, (2, 9))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(x, **kwargs), ref.generate(x, **kwargs))


def test_compiled_model_matches_eager():
    model, ref = models()
    x = torch.randint(0, 128, (2, 21))
    compiled = torch.compile(model)
    assert torch.allclose(compiled(x).logits, ref(x).logits, atol=1e-5)


def test_dropout_in_training_is_refused():
    model, _ = models()
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        model(torch.randint(0, 128, (1, 8)))
