"""Generate with a Hugging Face Llama twice -- attn_implementation="cuflash", then "sdpa" -- and print both token
sequences and whether they match.

    python examples/transformers_generate.py [--new-tokens 16] [--batch 4]    # from the repository root, on a GPU

The model is a small Llama-architecture network built from a config with random weights (nothing is downloaded),
in bf16. The prompts are a left-padded batch: the prefill and every decode step attend through cuflash's varlen
kernels (the padding mask's rows gathered), against transformers' DynamicCache. Greedy decoding; the random
weights are scaled so the next token is rarely a near tie. Where the two runs part, the float32 logits of both
choices are printed. It passes (exit 0) when the prompt's logits agree with a float32 copy of the model to bf16
precision: cuflash's error at most twice sdpa's.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import cuflash.transformers
    from cuflash.runtime import require_gpu
    require_gpu()  # CuPy installed and a CUDA device present, or one line saying what is missing
except (ImportError, RuntimeError) as err:
    sys.exit(f"transformers_generate.py: {err}")
import torch  # noqa: E402
import transformers  # noqa: E402


def small_llama(args, dtype):
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # larger than the default init (std 0.02, near-uniform logits): clear greedy choices
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if p.shape[0] == args.vocab else 0.06)
    return model.to(device="cuda", dtype=dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=48, help="prompt length; row i is padded on the left by 7*i tokens")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()

    cuflash.transformers.register()  # attn_implementation="cuflash" for every model from here on
    model = small_llama(args, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=g).cuda()
    mask = torch.ones_like(ids)
    for row in range(args.batch):
        mask[row, :min(7 * row, args.prompt - 1)] = 0
    ids = ids * mask  # token 0 is the pad

    tokens, logits = {}, {}
    for name in ("cuflash", "sdpa"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            tokens[name] = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                          do_sample=False, pad_token_id=0)[:, args.prompt:]
            logits[name] = model(ids, attention_mask=mask).logits.float()[mask.bool()]
    exact_model = small_llama(args, torch.float32)
    with torch.no_grad():
        exact = exact_model(ids, attention_mask=mask).logits[mask.bool()]

    print(f"Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV heads), "
          f"vocab {args.vocab}, random weights, bf16; prompts of {args.prompt} tokens, left-padded")
    for row in range(args.batch):
        ours, theirs = tokens["cuflash"][row], tokens["sdpa"][row]
        same = torch.equal(ours, theirs)
        print(f"row {row} ({int(mask[row].sum())} prompt tokens): {'same' if same else 'DIFFERENT'}")
        print(f"  cuflash {ours.tolist()}")
        print(f"  sdpa    {theirs.tolist()}")
        if not same:  # where they part, what the float32 model thinks of the two choices
            t = int((ours != theirs).nonzero()[0])
            prefix = torch.cat([ids[row][mask[row].bool()], ours[:t]])[None]
            with torch.no_grad():
                last = exact_model(prefix).logits[0, -1]
            a, b = int(ours[t]), int(theirs[t])
            print(f"  new token {t}: float32 logits {a}: {last[a].item():.4f}, {b}: {last[b].item():.4f} "
                  f"(float32 picks {int(last.argmax())})")
    identical = torch.equal(tokens["cuflash"], tokens["sdpa"])
    err, base = ((logits[name] - exact).abs().max().item() for name in ("cuflash", "sdpa"))
    close = err <= 2 * base + 1e-2
    print(f"prompt logits, max |x - float32 model|: cuflash {err:.4f}, sdpa {base:.4f} "
          f"({'within' if close else 'NOT within'} bf16 precision)")
    print(f"generated tokens identical: {'yes' if identical else 'no'}")
    sys.exit(0 if close else 1)


if __name__ == "__main__":
    main()
