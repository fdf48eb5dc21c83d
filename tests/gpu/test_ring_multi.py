"""Ring attention across GPUs: torchrun with 2 and 4 ranks over NCCL, and cuflash.jax_ring over every local GPU,
forward and backward against single-GPU attention on the gathered sequence. Skips with fewer than 2 GPUs.

Run by pytest, each torchrun case starts this file as its workers (``python -m torch.distributed.run
--nproc-per-node N tests/gpu/test_ring_multi.py LAYOUT CAUSAL``); each rank checks its own shard and exits non-zero
on a mismatch.
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


needs_gpus = lambda n: pytest.mark.skipif(_gpus() < n, reason=f"needs {n} GPUs")  # noqa: E731


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout,causal", [("contiguous", False), ("contiguous", True), ("zigzag", True)])
def test_torchrun_ring_matches_single_gpu_attention(world, layout, causal):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, has {_gpus()}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                          os.path.abspath(__file__), layout, str(causal)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("ring ok") == world


@needs_gpus(2)
def test_jax_ring_over_several_gpus():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    import cuflash.jax
    import cuflash.jax_ring
    try:
        devices = jax.devices("gpu")
    except RuntimeError as err:
        pytest.skip(f"JAX has no GPU backend here: {err}")
    world = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    spec = jax.sharding.PartitionSpec(None, "sp")
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    s = 2 * 256 * world
    q, dout = (jax.random.normal(key, (1, s, 8, 128), jnp.float32).astype(jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, s, 8, 128), jnp.float32).astype(jnp.bfloat16) for key in keys[2:])
    order = cuflash.jax_ring.zigzag_order(s, world)
    undo = np.argsort(order)
    attend = jax.shard_map(lambda q, k, v: cuflash.jax_ring.ring_attention(q, k, v, "sp", causal=True,
                                                                           layout="zigzag"),
                           mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * dout[:, order].astype(jnp.float32)).sum()  # noqa: E731
    out = jax.jit(attend)(q[:, order], k[:, order], v[:, order])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[:, order], k[:, order], v[:, order])
    one = lambda q, k, v: (cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32)  # noqa: E731
                           * dout.astype(jnp.float32)).sum()
    one_out = cuflash.jax.attention(q, k, v, causal=True)
    one_grads = jax.grad(one, argnums=(0, 1, 2))(q, k, v)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    assert np.abs(f64(out)[:, undo] - f64(one_out)).max() < 3e-2
    for got, ref in zip(grads, one_grads):
        err = np.abs(f64(got)[:, undo] - f64(ref)).max() / max(1.0, np.abs(f64(ref)).max())
        assert err < 6e-2


def _worker(layout: str, causal: bool) -> None:
    """One torchrun rank: its shard of out and of the gradients against cuflash.torch.attention on the whole
    sequence (computed on every rank from the same seed): the ring's error against float32 math is at most twice
    single-GPU attention's plus the rounding of its merge (``world`` partial results, each rounded once to bf16)."""
    import torch
    import torch.distributed as dist

    import cuflash.torch
    import cuflash.torch_distributed as cfd
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = 2 * 1000 * world
    q, dout = (torch.randn(2, s, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, s, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

    mine = [cfd.shard(x, layout=layout).requires_grad_() for x in (q, k, v)]
    out = cfd.ring_attention(*mine, causal=causal, layout=layout)
    out.backward(cfd.shard(dout, layout=layout))

    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    one = cuflash.torch.attention(*whole, causal=causal)
    one.backward(dout)
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    g = q.shape[2] // k.shape[2]
    math_out = torch.nn.functional.scaled_dot_product_attention(
        exact[0].transpose(1, 2), exact[1].transpose(1, 2).repeat_interleave(g, 1),
        exact[2].transpose(1, 2).repeat_interleave(g, 1), is_causal=causal).transpose(1, 2)
    math_out.backward(dout.float())

    def check(name, got, single, want):
        mine_err = (got.float() - cfd.shard(want, layout=layout)).abs().max().item()
        single_err = (single.float() - want).abs().max().item()
        floor = world * 2.0 ** -8 * want.abs().max().item()
        assert mine_err <= 2 * single_err + floor, \
            f"rank {rank} {name}: {mine_err} vs single GPU {single_err}, merge floor {floor}"

    check("out", out, one, math_out.detach())
    for name, x, single, want in zip(("dq", "dk", "dv"), mine, whole, exact):
        check(name, x.grad, single.grad, want.grad)
    dist.destroy_process_group()
    print(f"ring ok rank {rank}", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2] == "True")
