"""cuflash.transformers without a GPU: a small Llama with attn_implementation="cuflash" against "sdpa".

The launches are swapped for cuflash.reference on host memory (test_torch_cpu's ``on_host``), so everything
from transformers' attention call down to the launch runs as on a GPU: mask building, unpadding, packing, the
KV cache during ``generate``, and cuflash.torch's eager path.
"""
import importlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cuflash.transformers  # noqa: E402
from tests.test_torch_cpu import on_host  # noqa: E402,F401  (the fixture)

VOCAB = 128


def _model(config, dtype=torch.bfloat16):
    """A causal LM with random weights of a scale that makes greedy decoding far from ties (the default init's
    std 0.02 gives near-uniform logits, whose argmax would be bf16 noise)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25 if p.shape[0] == VOCAB else 0.12)
    return model.to(dtype)


def _llama(dtype=torch.bfloat16, **config):
    return _model(transformers.LlamaConfig(**dict(dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256), **config)), dtype)


def _tokens(batch, seqlen, seed=1):
    return torch.randint(0, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, implementation, *args, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(*args, **kwargs).logits.float()


def _assert_bf16_close(got, sdpa, exact, what):
    """cuflash's error against the float32 model at most twice sdpa's in bf16, plus a small floor."""
    err, base = (got - exact).abs().max().item(), (sdpa - exact).abs().max().item()
    assert err <= 2 * base + 1e-2, f"{what}: max |cuflash - fp32| = {err:.4f}, max |sdpa bf16 - fp32| = {base:.4f}"


@pytest.fixture(scope="module", autouse=True)
def registered():
    return cuflash.transformers.register()


@pytest.fixture(scope="module")
def models():
    return _llama(), _llama(dtype=torch.float32)


def test_model_builds_with_the_name(on_host):
    """attn_implementation="cuflash" at construction: transformers takes a name with "flash" in it for a
    flash-attention kernel to preload, and register() tells it there is none to load."""
    cuflash.transformers.register()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="cuflash", dtype=torch.bfloat16)
    assert model.config._attn_implementation == "cuflash"
    model(_tokens(1, 5))
    assert [c[0] for c in on_host] == ["fwd"]


def test_dense_forward_matches_sdpa(models, on_host):
    model, exact = models
    ids = _tokens(2, 37)
    got, sdpa = _logits(model, "cuflash", ids), _logits(model, "sdpa", ids)
    _assert_bf16_close(got, sdpa, _logits(exact, "sdpa", ids), "dense")
    assert [c[0] for c in on_host] == ["fwd", "fwd"]  # one dense launch per layer
    assert on_host[0][1]["causal"] is True and on_host[0][1]["softmax_scale"] == pytest.approx(16 ** -0.5)


def test_padded_batch_matches_sdpa(models, on_host):
    """Left and right padding: 2-D masks, unpadded to the varlen kernels; valid positions agree with sdpa."""
    model, exact = models
    ids = _tokens(3, 21)
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[0, :7] = 0   # left padding
    mask[1, 15:] = 0  # right padding
    got, sdpa = (_logits(model, name, ids, attention_mask=mask) for name in ("cuflash", "sdpa"))
    keep = mask.bool()
    _assert_bf16_close(got[keep], sdpa[keep], _logits(exact, "sdpa", ids, attention_mask=mask)[keep], "padded")
    assert on_host and all(c[0] == "fwd" for c in on_host)
    assert (got[~keep] == got[~keep]).all()  # padded rows are finite (zeros out of attention), not NaN
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # a padded row then equals that sequence run by itself
    padded = _logits(model, "cuflash", ids, attention_mask=mask, position_ids=positions)
    alone = _logits(model, "cuflash", ids[:1, 7:])
    assert (padded[0, 7:] - alone[0]).abs().max().item() < 5e-2


def test_packed_sequences_match_separate_runs(models, on_host):
    """One row holding three sequences: position_ids that restart, or the collator's cu_seq_lens kwargs, keep
    every token inside its own sequence."""
    model, exact = models
    lengths = (9, 14, 5)
    ids = _tokens(1, sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    separate = torch.cat([_logits(exact, "sdpa", part) for part in ids.split(lengths, dim=1)], dim=1)
    sdpa = _logits(model, "sdpa", ids, position_ids=position_ids, use_cache=False)  # sdpa packs without a cache
    _assert_bf16_close(sdpa, sdpa, separate, "sdpa packed")  # the reference: the sequences run one by one
    by_positions = _logits(model, "cuflash", ids, position_ids=position_ids)
    cu = torch.tensor([0, 9, 23, 28], dtype=torch.int32)
    by_kwargs = _logits(model, "cuflash", ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                        max_length_q=14, max_length_k=14)
    for got, what in ((by_positions, "position_ids"), (by_kwargs, "cu_seq_lens")):
        _assert_bf16_close(got, sdpa, separate, f"packed by {what}")
    assert on_host and all(c[0] == "fwd" for c in on_host)
    dense = _logits(model, "cuflash", ids)  # without the positions, one long sequence: other logits
    assert (dense[0, 9:] - separate[0, 9:]).abs().max().item() > 1.0


@pytest.mark.parametrize("padded", [False, True])
def test_generate_gives_the_same_tokens_as_sdpa(models, on_host, padded):
    """Greedy decoding with transformers' DynamicCache: the prompt in one call, then one query row per step
    against the cached keys (bottom-right causal); with left padding, every step goes through the varlen path."""
    model, _ = models
    ids = _tokens(2, 12, seed=3)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    outputs = {}
    for name in ("cuflash", "sdpa"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                           pad_token_id=0)
    assert outputs["cuflash"].shape == (2, 20)
    assert torch.equal(outputs["cuflash"], outputs["sdpa"]), outputs
    queries = [c for c in on_host if c[0] == "fwd"]
    assert len(queries) == 8 * 2  # a prefill and 7 decode steps, 2 layers each


def test_training_gradients_match_sdpa(on_host):
    model = _llama()
    model.train()
    ids = _tokens(2, 19)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    grads = {}
    for name in ("cuflash", "sdpa"):
        model.zero_grad()
        model.set_attn_implementation(name)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads[name] = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    scale = grads["sdpa"].abs().max().item()
    assert (grads["cuflash"] - grads["sdpa"]).abs().max().item() < 0.1 * scale
    assert [c[0] for c in on_host].count("bwd") == 2


def test_sliding_window_matches_sdpa(on_host):
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    model, exact = (_model(transformers.MistralConfig(**config, sliding_window=6), dtype)
                    for dtype in (torch.bfloat16, torch.float32))
    ids = _tokens(2, 25)
    got, sdpa = _logits(model, "cuflash", ids), _logits(model, "sdpa", ids)
    _assert_bf16_close(got, sdpa, _logits(exact, "sdpa", ids), "sliding window")
    assert on_host[0][1]["window_size"] == (5, 0)
    full = _model(transformers.MistralConfig(**config, sliding_window=None))
    assert (_logits(full, "cuflash", ids) - got).abs().max().item() > 1e-2


class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(batch=2, seqlen=11, heads=4, kv_heads=2, headdim=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seqlen, headdim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, seqlen, headdim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def test_options_reach_the_kernels(on_host):
    q, k, v = _qkv()
    out, weights = cuflash.transformers.attention_forward(_Layer(), q, k, v, None, scaling=0.3, softcap=20.0,
                                                          sliding_window=4, is_causal=False)
    assert weights is None and out.shape == (2, 11, 4, 16) and out.dtype == torch.bfloat16
    assert on_host[0][1] == dict(softmax_scale=0.3, causal=False, window_size=(3, 3), softcap=20.0)


def test_dense_inputs_reach_the_kernels_without_a_copy(on_host, monkeypatch):
    seen = []
    attention = cuflash.torch.attention
    monkeypatch.setattr(cuflash.torch, "attention",
                        lambda q, k, v, **options: seen.append((q, k, v)) or attention(q, k, v, **options))
    q, k, v = _qkv()
    cuflash.transformers.attention_forward(_Layer(), q, k, v, None)
    for given, passed in zip((q, k, v), seen[0]):
        assert passed.data_ptr() == given.data_ptr() and passed.shape == given.transpose(1, 2).shape


def _masked_math(q, k, v, mask):
    """float32 SDPA in transformers' (b, h, s, d) layout with a boolean (b, sq, sk) mask, output (b, s, h, d)."""
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1), attn_mask=mask[:, None])
    return out.transpose(1, 2)


class _Bidirectional(torch.nn.Module):
    is_causal = False


def test_padded_bidirectional_and_cross_attention(on_host):
    """Not causal: every query row attends its sequence's valid keys (an encoder over padded rows, or a decoder
    attending a padded encoder output, whose query rows are not key positions)."""
    q, _, _ = _qkv(seqlen=6)
    _, k, v = _qkv(seqlen=13)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[0, :4] = keep[1, 9:] = False
    out, _ = cuflash.transformers.attention_forward(_Bidirectional(), q, k, v, keep.long())
    want = _masked_math(q, k, v, keep[:, None, :].expand(2, 6, 13))
    assert (out.float() - want).abs().max().item() < 2e-2
    q, k, v = _qkv(seqlen=13)  # encoder self-attention, and with a window (positions then matter)
    for window, band in ((None, True), (3, (torch.arange(13)[:, None] - torch.arange(13)).abs() < 3)):
        out, _ = cuflash.transformers.attention_forward(_Bidirectional(), q, k, v, keep, sliding_window=window)
        want = _masked_math(q, k, v, (keep[:, None, :] & band).expand(2, 13, 13))
        rows = keep if window else torch.ones_like(keep)  # with a window, padded query rows are zeros, unchecked
        assert (out.float() - want)[rows].abs().max().item() < 2e-2
    with pytest.raises(NotImplementedError, match="query rows cannot be placed"):
        cuflash.transformers.attention_forward(_Bidirectional(), q[:, :, :6], k, v, keep, sliding_window=3)


def test_value_head_dim_smaller_than_query_is_padded_and_cropped(on_host):
    q, k, v = _qkv()
    out, _ = cuflash.transformers.attention_forward(_Layer(), q, k, v[..., :8], None)
    full, _ = cuflash.transformers.attention_forward(_Layer(), q, k, torch.nn.functional.pad(v[..., :8], (0, 8)), None)
    assert out.shape == (2, 11, 4, 8) and torch.equal(out, full[..., :8])


def test_what_cuflash_cannot_compute_raises(on_host):
    q, k, v = _qkv()
    layer = _Layer()
    with pytest.raises(NotImplementedError, match="4-D"):
        cuflash.transformers.attention_forward(layer, q, k, v, torch.zeros(2, 1, 11, 11))
    for name in ("s_aux", "position_bias"):
        with pytest.raises(NotImplementedError, match=name):
            cuflash.transformers.attention_forward(layer, q, k, v, None, **{name: torch.zeros(4)})
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        cuflash.transformers.attention_forward(layer, *(x.float() for x in (q, k, v)), None)
    with pytest.raises(ValueError, match="attention_mask"):
        cuflash.transformers.attention_forward(layer, q, k, v, torch.ones(2, 12, dtype=torch.bool))
    assert on_host == []


def test_dropout_in_training_reaches_the_kernels(on_host, monkeypatch):
    from tests.test_torch_cpu import _FakeCudaGenerator
    generator = _FakeCudaGenerator(seed=3, offset=0)
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: generator)
    model = _llama(attention_dropout=0.1)
    model.set_attn_implementation("cuflash")
    model.train()
    model(_tokens(1, 5))
    assert on_host and all(options["dropout_p"] == 0.1 for _, options in on_host)
    assert generator.offset == 4 * len(on_host)  # a new mask per layer
    on_host.clear()
    model.eval()
    model(_tokens(1, 5))  # evaluation passes dropout=0
    assert on_host and all("dropout_p" not in options for _, options in on_host)


def test_float32_under_autocast_runs_in_bfloat16(on_host):
    q, k, v = _qkv(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = cuflash.transformers.attention_forward(_Layer(), q, k, v, None)
    assert out.dtype == torch.bfloat16


def test_import_cuflash_does_not_import_transformers():
    code = "import sys, cuflash, cuflash.torch; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "cuflash.transformers")  # restored after the test
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'cuflash\[transformers\]'") as info:
        importlib.import_module("cuflash.transformers")
    assert info.value.name == "transformers"
