// cuda_src/dropout.cuh on the host: 32 threads stand in for a warp's lanes (__shfl_xor_sync through a barrier), each
// computing its lane's keep bits with the kernels' own code; tests/test_dropout_warp.py compares them with
// cuflash.reference.dropout_keep. Usage:
//     dropout_warp SEED OFFSET BH THRESHOLD rows|frags|cols NT R C
// prints, per lane, keep_rows<NT>'s words (rows), the elements drop_fragments leaves of all-ones A fragments of NT / 2
// 16-key tiles in keep_rows' bit order (frags), or keep_mask_cols<NT>'s bits (cols) for tile (R, C).
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // CUDA's: bytes of (y:x), no sign mode
    const unsigned long long both = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((both >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
template <class T>
T __ldg(const T* p) {
    return *p;
}

static std::barrier<>* warp_barrier;
static unsigned warp_slots[32];
thread_local int this_lane;
inline unsigned __shfl_xor_sync(unsigned, unsigned value, int mask) {
    warp_slots[this_lane] = value;
    warp_barrier->arrive_and_wait();
    const unsigned other = warp_slots[this_lane ^ mask];
    warp_barrier->arrive_and_wait();
    return other;
}

#include "dropout.cuh"
using namespace cuflash;

template <int NT>
void run(const Dropout& dropout, char mode, int r, int c, unsigned (*out)[4]) {
    std::barrier<> barrier(32);
    warp_barrier = &barrier;
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
        lanes.emplace_back([&, lane] {
            this_lane = lane;
            if (mode == 'r' && NT % 2 == 0) {
                u32 words[(4 * NT + 31) / 32];
                dropout.keep_rows<NT>(words, r, c, lane);
                for (int i = 0; i < (4 * NT + 31) / 32; ++i) out[lane][i] = words[i];
            } else if (mode == 'f') {
                u32 pa[(NT + 1) / 2][4];
                std::memset(pa, 0xFF, sizeof(pa));
                dropout.drop_fragments(pa, r, c, lane);
                for (int n = 0; n < NT; ++n)  // element [n][e]: register 2 (n % 2) + e / 2 of tile n / 2, half e % 2
                    for (int e = 0; e < 4; ++e)
                        if ((pa[n / 2][2 * (n % 2) + e / 2] >> (16 * (e % 2))) & 0xFFFFu)
                            out[lane][(4 * n + e) / 32] |= 1u << ((4 * n + e) % 32);
            } else if constexpr (NT <= 8) {
                out[lane][0] = dropout.keep_mask_cols<NT>(c, r, lane);
            }
        });
    for (auto& t : lanes) t.join();
}

int main(int argc, char** argv) {
    if (argc != 9) return 2;
    const long long seed = (long long)std::strtoull(argv[1], nullptr, 10);
    const long long offset = (long long)std::strtoull(argv[2], nullptr, 10);
    const int bh = std::atoi(argv[3]), threshold = std::atoi(argv[4]);
    const char mode = argv[5][0];  // r(ows), f(rags), c(ols)
    const int nt = std::atoi(argv[6]), r = std::atoi(argv[7]), c = std::atoi(argv[8]);
    const Dropout dropout(seed, offset, bh, threshold);
    unsigned out[32][4] = {};
    switch (nt) {
        case 2: run<2>(dropout, mode, r, c, out); break;
        case 4: run<4>(dropout, mode, r, c, out); break;
        case 6: run<6>(dropout, mode, r, c, out); break;
        case 8: run<8>(dropout, mode, r, c, out); break;
        case 10: run<10>(dropout, mode, r, c, out); break;
        case 16: run<16>(dropout, mode, r, c, out); break;
        default: return 2;
    }
    for (int lane = 0; lane < 32; ++lane)
        std::printf("%u %u %u %u\n", out[lane][0], out[lane][1], out[lane][2], out[lane][3]);
    return 0;
}
