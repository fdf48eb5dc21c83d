"""Train the same small GPT twice -- attention by cuflash, then by PyTorch SDPA -- from the same
initial weights on the same batches, and print both loss curves side by side.

    python examples/torch_gpt.py [--steps 300] [--compile]     # from the repository root, on a GPU

The data is synthetic: token t repeats token t - 16 with probability 0.9, so the loss can only fall from
log(vocab) towards its floor through attention. bf16 autocast.
The curves should track each other to within bf16 noise; they cannot be bitwise equal (different kernels).
"""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import cuflash.torch
    from cuflash.runtime import require_gpu
    require_gpu()  # CuPy installed and a CUDA device present, or one line saying what is missing
except (ImportError, RuntimeError) as err:
    sys.exit(f"torch_gpt.py: {err}")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)  # (b, s, h, d)
        if self.attention == "cuflash":
            a = cuflash.torch.attention(q, k, v, causal=True)
        else:  # SDPA wants (b, h, s, d); its is_causal equals ours when seqlen_q == seqlen_k
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        x = x + self.proj(a.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab, seqlen, dim, heads, layers, attention):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(seqlen, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_batches(steps, batch, seqlen, vocab, lag=16, p_copy=0.9, seed=0):
    """Token t repeats token t - lag with probability p_copy, else is uniform: only attention can predict it.
    Returns the batches (the same for both runs) and the loss floor, the entropy of a predictable token."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = steps * batch
    seq = torch.randint(vocab, (n, seqlen + 1), device="cuda", generator=g)
    copy = torch.rand(n, seqlen + 1, device="cuda", generator=g) < p_copy
    for t in range(lag, seqlen + 1):
        seq[:, t] = torch.where(copy[:, t], seq[:, t - lag], seq[:, t])
    hit = p_copy + (1 - p_copy) / vocab
    miss = (1 - p_copy) / vocab
    floor = -(hit * math.log(hit) + (vocab - 1) * miss * math.log(miss))
    floor = (lag * math.log(vocab) + (seqlen - lag) * floor) / seqlen  # the first lag tokens are unpredictable
    return list(seq.split(batch)), floor


def train(attention, state, batches, args):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.seqlen, args.dim, args.heads, args.layers, attention).cuda()
    model.load_state_dict(state)
    step_model = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for seq in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return [x.item() for x in losses], time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    args = p.parse_args()

    batches, floor = copy_batches(args.steps, args.batch, args.seqlen, args.vocab)
    torch.manual_seed(0)
    state = GPT(args.vocab, args.seqlen, args.dim, args.heads, args.layers, "sdpa").state_dict()
    state = {k: v.cuda() for k, v in state.items()}

    runs = {name: train(name, state, batches, args) for name in ("cuflash", "sdpa")}
    (ours, t_ours), (sdpa, t_sdpa) = runs["cuflash"], runs["sdpa"]
    print(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, seqlen {args.seqlen}, batch {args.batch}, "
          f"bf16 autocast{', torch.compile' if args.compile else ''}")
    print(f"data: token t repeats token t-16 with probability 0.9 (attention must find it); "
          f"loss floor {floor:.3f}, uniform guess {math.log(args.vocab):.3f}")
    print(f"{'step':>5} {'cuflash':>9} {'sdpa':>9} {'diff':>9}")
    for i in sorted(set(range(0, args.steps, max(1, args.steps // 15))) | {args.steps - 1}):
        print(f"{i:5d} {ours[i]:9.4f} {sdpa[i]:9.4f} {ours[i] - sdpa[i]:+9.4f}")
    tail = max(1, args.steps // 10)
    mean_ours, mean_sdpa = sum(ours[-tail:]) / tail, sum(sdpa[-tail:]) / tail
    worst = max(abs(a - b) for a, b in zip(ours, sdpa))
    print(f"mean loss of the last {tail} steps: cuflash {mean_ours:.4f}, sdpa {mean_sdpa:.4f}; "
          f"largest per-step difference {worst:.4f}")
    print(f"time: cuflash {t_ours:.1f} s, sdpa {t_sdpa:.1f} s (first steps include kernel compilation)")
    learned = mean_sdpa < 0.5 * (math.log(args.vocab) + floor)
    ok = abs(mean_ours - mean_sdpa) < 0.05 + 0.02 * mean_sdpa
    print(f"SDPA model learned the copy: {'yes' if learned else 'not yet (more --steps)'}; "
          f"losses track: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
