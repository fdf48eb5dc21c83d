"""Each persistent Hopper forward variant once per head dim (64, 128) with and without a causal mask, on more tiles
than SMs, checked against the float64 reference on a few rows: a first step for a device call that changes the
persistent walk, run under a short timeout so that a hang costs a minute rather than the whole run (the dynamic
walk hung every persistent call and spent the whole device budget in the suite's timeouts)."""
import sys

import numpy as np

sys.path.insert(0, ".")


def main() -> int:
    import cupy
    from cuflash import reference
    from cuflash.ops import forward_sm90
    variants = [v for v in forward_sm90.VARIANTS if forward_sm90.variant_options(v, 64).get("persistent")]
    rng = np.random.default_rng(0)
    worst = 0.0
    for d in (64, 128):
        b, s, h = 4, 1000, 40  # 8 query blocks x 160 pairs: 1,280 tiles
        q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, d)), dtype=cupy.float16) for _ in range(3))
        for variant in variants:
            for causal in (False, True):
                out = forward_sm90.attention_sm90(q, k, v, causal=causal, variant=variant)
                cupy.cuda.get_current_stream().synchronize()
                # the last 64 rows of the first sequence (the longest under the mask): with the mask aligned to the
                # bottom right, 64 queries against all keys are exactly those rows
                rows = slice(s - 64, s)
                ref = reference.attention(q[:1, rows].get(), k[:1].get(), v[:1].get(), causal=causal)
                err = float(np.abs(out[:1, rows].get().astype(np.float64) - ref).max())
                worst = max(worst, err)
                print(f"{variant:20s} d={d} causal={causal}: max err {err:.2e}", flush=True)
    print(f"worst {worst:.2e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
