// Backward attention on Hopper (sm_90a): TMA loads and wgmma.
//
// The main kernel of the backward only; bwd_aux.cu's preprocess (D = rowsum(dO * O), lse in log2) and dQ convert
// run around it, with the portable kernel's workspace and parameters (BwdParams, params.cuh). Grid (slots, KV
// heads, sequences) as bwd.cu, but CTA x owns key blocks x, 2 slots - 1 - x, 2 slots + x, ... (run) of BN = 128
// keys, as two warpgroups of 64 keys each, and loops over the query heads of its KV head and their BM-row query
// blocks that see the keys (BM 64, or 128 at d = 64 without a score mod: twice the work per step for the same fixed
// cost of barriers and waits).
// Per query block, with K and V resident and Q, dO, lse, D double-buffered (TMA; a producer warpgroup loads and adds
// dQ, WS, but at d = 64 with 64 query rows, where thread 0 issues and the warpgroups meet at a CTA barrier each step):
//     S^T  = K_w Q^T      wgmma m64n{BM} ss (A = this warpgroup's keys, K-major; B = Q, K-major)
//     dP^T = V_w dO^T     wgmma m64n{BM} ss
//     P^T = exp2(S^T scale - lse), masked; dS^T = P^T (dP^T - D) softmax_scale    (per query column)
//     dV  += P^T dO       wgmma rs (P^T from registers, the forward's P V; dO MN-major)
//     dK  += dS^T Q       wgmma rs
//     dQ  += dS K         wgmma ss, both MN-major: dS^T goes to shared memory (rows of keys, 64 queries = one
//                         128-byte swizzled line; BM / 64 such panels), K is read transposed; added to dq_accum
//                         by the producer's dQ warp, TMA bulk reductions from a staging tile of 64 x 64 per
//                         warpgroup (stage_dq)
// dQ is split between the warpgroups (after both stored dS^T) by 64-column panel at d = 128 and 256 and by 64-row
// half at d = 64 with 128 rows, so that each dQ element gets one addition per step; at d = 64 with 64 rows (mods
// with dropout) each warpgroup adds its own 64 keys' part to every element, with vector reductions (add_dq_red).
// Softcap and ALiBi (SCORE_MOD: score_mod.cuh's modify per element, its derivative straight into dS, both products
// waited for first: mod_probabilities) at every head dim, with the head dim's query rows a step (at d = 64, 128,
// or 64 with dropout too). Head dims D = 64, 128 and 256
// (DSPLIT: 64 keys per CTA, the warpgroups splitting the head dim; step_split), and the multiples of 8 down to the
// one before (at D = 64 from 40): the TMA boxes zero-fill the columns past p.headdim,
// dK and dV leave them out, and dQ's TMA additions are clipped at the accumulator's head dim.
// Dropout (DROPOUT kernels, d = 64, 128 and 256 with the head dim's query rows: 128 at d = 64, 64 with a score mod
// there): dV takes P M / keep and dS^T = P^T (dP^T M / keep - D), with M's bits regenerated per step (dropout.cuh)
// while S^T and dP^T compute.
// Deterministic mode (BwdParams::deterministic): 1, each slot adds into its own fp32 slice in program order; 2 (not
// with add_dq_red), every CTA adds its tile as int32 fixed point into one accumulator (fixed_dq.cuh), in any order:
// only the FIXED kernels, which run only that mode, so that the others carry none of its code (a run-time test of
// the mode slows the atomic kernel down: docs/perf-notes.md).
// The kernel is assembled from parts, each in its own header:
//  - bwd_sm90_layout.cuh  the parameters, the named barriers, the shared-memory layout (BwdSm90Smem);
//  - bwd_sm90_block.cuh   the CTA (BwdSm90): its constants and state, the loads, masks and probabilities, the step
//                         at d = 64 and 128, dK and dV out, the walk over key blocks, the lockstep CTA;
//  - bwd_sm90_dq.cuh      dQ: added to dq_accum by vector reductions, or stored to a staging tile for the dQ warp;
//  - bwd_sm90_split.cuh   the step at d = 256 (DSPLIT);
//  - bwd_sm90_ws.cuh      the warp-specialized CTA (WS): a producer warpgroup's roles, the consumers' walk over key
//                         blocks.
#include "bwd_sm90_block.cuh"
#include "bwd_sm90_dq.cuh"
#include "bwd_sm90_split.cuh"
#include "bwd_sm90_ws.cuh"

namespace cuflash {

template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__global__ void __launch_bounds__((BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::THREADS), 1) bwd_sm90_kernel(const __grid_constant__ BwdSm90Params P) {
    extern __shared__ __align__(1024) char smem[];
    BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT> block(P);
    block.run(smem);
}

// The dynamic shared memory (bytes) a launch of bwd_sm90_kernel with the same template arguments requests: the
// launcher reads it from the compiled module (name expression "&cuflash::bwd_sm90_smem_bytes<...>").
template <class T, int D, int BM, bool BAND, bool SCORE_MOD, bool FIXED, bool DROPOUT>
__device__ const unsigned bwd_sm90_smem_bytes = BwdSm90<T, D, BM, BAND, SCORE_MOD, FIXED, DROPOUT>::SMEM_BYTES;

}  // namespace cuflash
