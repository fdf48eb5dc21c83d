"""cuflash.transformers on a GPU: a small Llama (and Mistral, for the sliding window) in bf16 with
attn_implementation="cuflash" against "sdpa" and a float32 copy; generate's tokens; no copies of q, k, v."""
import inspect

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 256


def _model(config, dtype):
    """Random weights scaled so greedy decoding is far from ties (the default std 0.02 gives near-uniform logits)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if p.shape[0] == VOCAB else 0.06)
    return model.to(device="cuda", dtype=dtype)


def _llama_config(**changes):
    return transformers.LlamaConfig(**dict(dict(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024), **changes))  # head dim 64, GQA 4:1


def _tokens(batch, seqlen, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=g).cuda()


def _logits(model, implementation, *args, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(*args, **kwargs).logits.float()


def _assert_bf16_close(got, sdpa, exact, what):
    """cuflash's error against the float32 model at most twice sdpa's in bf16, plus a small floor."""
    err, base = (got - exact).abs().max().item(), (sdpa - exact).abs().max().item()
    assert err <= 2 * base + 1e-2, f"{what}: max |cuflash - fp32| = {err:.4f}, max |sdpa bf16 - fp32| = {base:.4f}"


@pytest.fixture(scope="module")
def models():
    import cuflash.transformers
    cuflash.transformers.register()
    return _model(_llama_config(), torch.bfloat16), _model(_llama_config(), torch.float32)


def test_dense_forward_matches_sdpa(models):
    model, exact = models
    ids = _tokens(2, 333)
    _assert_bf16_close(_logits(model, "cuflash", ids), _logits(model, "sdpa", ids), _logits(exact, "sdpa", ids),
                       "dense")


def test_padded_batch_matches_sdpa(models):
    model, exact = models
    ids = _tokens(3, 257)
    mask = torch.ones_like(ids)
    mask[0, :100] = 0   # left padding
    mask[1, 200:] = 0   # right padding
    keep = mask.bool()
    got, sdpa, ref = (_logits(m, name, ids, attention_mask=mask)[keep]
                      for m, name in ((model, "cuflash"), (model, "sdpa"), (exact, "sdpa")))
    _assert_bf16_close(got, sdpa, ref, "padded")


def test_packed_sequences_match_separate_runs(models):
    model, exact = models
    lengths = (100, 37, 250)
    ids = _tokens(1, sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    separate = torch.cat([_logits(exact, "sdpa", part) for part in ids.split(lengths, dim=1)], dim=1)
    sdpa = _logits(model, "sdpa", ids, position_ids=position_ids, use_cache=False)
    cu = torch.tensor([0, 100, 137, 387], dtype=torch.int32, device="cuda")
    for kwargs in (dict(), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=250, max_length_k=250)):
        got = _logits(model, "cuflash", ids, position_ids=position_ids, **kwargs)
        _assert_bf16_close(got, sdpa, separate, f"packed {sorted(kwargs)}")


def _assert_same_greedy_tokens(got, want, exact, mask, prompt_len):
    """Equal tokens; where they part, the float32 model must see a near tie between the two choices (the two
    bf16 runs may then break it differently), never a clear winner that one of them missed."""
    if torch.equal(got, want):
        return
    row, step = (got != want).nonzero()[0].tolist()  # the first difference of the first row that has one
    prefix = got[row:row + 1, :step]
    logits = _logits(exact, "sdpa", prefix, attention_mask=mask[row:row + 1, :step] if mask is not None else None)
    last = logits[0, -1]
    gap = (last[got[row, step]] - last[want[row, step]]).abs().item()
    assert gap < 0.02 * last.abs().max().item(), (
        f"greedy tokens part at row {row}, step {step - prompt_len}: cuflash {got[row].tolist()}, "
        f"sdpa {want[row].tolist()}; the float32 logits differ by {gap:.4f} there, no tie")


@pytest.mark.parametrize("padded", [False, True])
def test_generate_gives_the_same_tokens_as_sdpa(models, padded):
    model, exact = models
    ids = _tokens(4, 40, seed=3)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :13] = 0
        mask[3, :39] = 0
    tokens = {}
    for name in ("cuflash", "sdpa"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            tokens[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    full_mask = torch.nn.functional.pad(mask, (0, 8), value=1)
    _assert_same_greedy_tokens(tokens["cuflash"], tokens["sdpa"], exact, full_mask, 40)


def test_q_k_v_reach_the_kernels_without_a_copy(models, monkeypatch):
    """The model's q, k, v (and at decode the DynamicCache's keys and values) are what the kernels read."""
    import cuflash.torch
    import cuflash.transformers
    model, _ = models
    seen, given = [], []
    attention, forward = cuflash.torch.attention, cuflash.transformers.attention_forward

    def record_call(q, k, v, **options):
        seen.append(tuple(x.data_ptr() for x in (q, k, v)))
        return attention(q, k, v, **options)

    def record_inputs(module, query, key, value, *args, **kwargs):
        given.append(tuple(x.data_ptr() for x in (query, key, value)))
        return forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(cuflash.torch, "attention", record_call)
    transformers.AttentionInterface.register("cuflash", record_inputs)
    try:
        model.set_attn_implementation("cuflash")
        cache = transformers.DynamicCache(config=model.config)
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.no_grad():
            model(_tokens(2, 64), use_cache=True, **{name: cache})  # prefill: the dense path
            model(_tokens(2, 1), use_cache=True, **{name: cache})   # one decode step against the cache
    finally:
        cuflash.transformers.register()
    layers = model.config.num_hidden_layers
    assert len(seen) == len(given) == 2 * layers
    assert seen == given
    last = cache.layers[-1]
    assert seen[-1][1:] == (last.keys.data_ptr(), last.values.data_ptr())


def test_training_gradients_match_sdpa(models):
    model, exact = models
    model.train()
    ids = _tokens(2, 129)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    grads = {}
    try:
        for m, name in ((model, "cuflash"), (model, "sdpa"), (exact, "sdpa")):
            m.zero_grad()
            m.set_attn_implementation(name)
            m(ids, attention_mask=mask, labels=ids).loss.backward()
            grads[m is exact, name] = m.model.layers[0].self_attn.q_proj.weight.grad.float()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
        exact.zero_grad(set_to_none=True)
    _assert_bf16_close(grads[False, "cuflash"], grads[False, "sdpa"], grads[True, "sdpa"], "q_proj gradient")


def test_sliding_window_matches_sdpa():
    import cuflash.transformers
    cuflash.transformers.register()
    config = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, sliding_window=64)
    model, exact = (_model(transformers.MistralConfig(**config), dtype) for dtype in (torch.bfloat16, torch.float32))
    ids = _tokens(2, 300)
    _assert_bf16_close(_logits(model, "cuflash", ids), _logits(model, "sdpa", ids), _logits(exact, "sdpa", ids),
                       "sliding window")
