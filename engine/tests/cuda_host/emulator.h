// A host emulation of the CUDA execution model, enough to run kernels.cu as C++: blocks run one
// after another; each thread of a block is an OS thread; __syncthreads is a barrier across them;
// __shared__ variables are statics and dynamic shared memory is one static buffer, both shared
// by the threads of the running block. The warp-level instructions the tensor-core kernels use
// (mma.sync, ldmatrix, shfl.sync, cp.async) follow PTX's definitions: the 32 lanes of a warp
// meet at a barrier of their own and each computes its result from every lane's operands, by
// the documented fragment layouts. Used by engine/tests/cuda_host.rs to check the kernels'
// logic where there is no GPU.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static

struct uint3 {
    unsigned x, y, z;
};

inline thread_local uint3 threadIdx;
inline uint3 blockIdx, blockDim, gridDim;
inline std::barrier<>* block_barrier;
inline float dynamic_shared[1 << 16];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline void __trap() {
    std::fprintf(stderr, "a kernel trapped\n");
    std::abort();
}

// The warps of the running block: a barrier each, and one slot per thread for the operands it
// hands the other lanes of its warp.
struct LaneSlot {
    const void* ptr;
    unsigned regs[6];
    float value;
};
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<LaneSlot> lane_slots;

inline void warp_meet() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
inline unsigned lane_id() { return threadIdx.x % 32; }
inline LaneSlot& my_slot() { return lane_slots[threadIdx.x]; }
inline const LaneSlot& slot_of(unsigned lane) { return lane_slots[threadIdx.x / 32 * 32 + lane]; }

// shfl.sync.bfly: the value of the lane whose index is this lane's xor `mask`.
inline float warp_xor(float v, int mask) {
    my_slot().value = v;
    warp_meet();
    float r = slot_of(lane_id() ^ mask).value;
    warp_meet();
    return r;
}

inline unsigned bf16_pair(unsigned short lo, unsigned short hi) { return lo | (unsigned)hi << 16; }

// ldmatrix.m8n8.x4.b16: lanes 8m..8m+7 give the addresses of rows 0..7 of matrix m; register m
// of lane l gets row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix m.
inline void ldmatrix_x4(unsigned r[4], const unsigned short* p) {
    my_slot().ptr = p;
    warp_meet();
    unsigned l = lane_id();
    for (unsigned m = 0; m < 4; ++m) {
        auto row = static_cast<const unsigned short*>(slot_of(m * 8 + l / 4).ptr);
        r[m] = bf16_pair(row[2 * (l % 4)], row[2 * (l % 4) + 1]);
    }
    warp_meet();
}

// ldmatrix with .trans: register m of lane l gets rows 2 (l % 4) and 2 (l % 4) + 1, column
// l / 4 of matrix m.
inline void ldmatrix_x4_trans(unsigned r[4], const unsigned short* p) {
    my_slot().ptr = p;
    warp_meet();
    unsigned l = lane_id();
    for (unsigned m = 0; m < 4; ++m) {
        auto lo = static_cast<const unsigned short*>(slot_of(m * 8 + 2 * (l % 4)).ptr);
        auto hi = static_cast<const unsigned short*>(slot_of(m * 8 + 2 * (l % 4) + 1).ptr);
        r[m] = bf16_pair(lo[l / 4], hi[l / 4]);
    }
    warp_meet();
}

inline float bf16_half(unsigned reg, unsigned k) {
    unsigned bits = k % 2 ? reg >> 16 : reg & 0xffffu;
    return __uint_as_float(bits << 16);
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, c += a * b. Lane l holds A's rows l / 4 (a[0],
// a[2]) and l / 4 + 8 (a[1], a[3]) at columns 2 (l % 4) + {0, 1} (a[0], a[1]) and those + 8
// (a[2], a[3]); B's column l / 4 at rows 2 (l % 4) + {0, 1} (b[0]) and those + 8 (b[1]); C's rows
// l / 4 (c[0], c[1]) and l / 4 + 8 (c[2], c[3]) at columns 2 (l % 4) + {0, 1}. Products are exact
// in f32; the emulation sums them in k order and adds the sum to c.
inline void mma_bf16_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    LaneSlot& mine = my_slot();
    for (int i = 0; i < 4; ++i) mine.regs[i] = a[i];
    mine.regs[4] = b[0];
    mine.regs[5] = b[1];
    warp_meet();
    unsigned l = lane_id();
    float d[4];
    for (unsigned e = 0; e < 4; ++e) {
        unsigned row = l / 4 + e / 2 * 8, col = 2 * (l % 4) + e % 2;
        float sum = 0.0f;
        for (unsigned k = 0; k < 16; ++k) {
            float x = bf16_half(slot_of(row % 8 * 4 + k % 8 / 2).regs[row / 8 + 2 * (k / 8)], k);
            float y = bf16_half(slot_of(col * 4 + k % 8 / 2).regs[4 + k / 8], k);
            sum += x * y;
        }
        d[e] = c[e] + sum;
    }
    warp_meet();
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// cp.async: a thread's copies wait in their commit groups and land only when the thread waits
// for them, so a kernel reading a tile before waiting reads the poison, as a GPU might.
struct PendingCopy {
    void* dst;
    const void* src;
};
inline thread_local std::vector<PendingCopy> open_copies;
inline thread_local std::vector<std::vector<PendingCopy>> committed_copies;

inline void cp_async16(void* dst, const void* src) { open_copies.push_back({dst, src}); }
inline void cp_async_commit() {
    committed_copies.push_back(std::move(open_copies));
    open_copies.clear();
}
// Lands every committed group but the newest N.
template <int N> inline void cp_async_wait() {
    while (committed_copies.size() > N) {
        for (const PendingCopy& c : committed_copies.front()) std::memcpy(c.dst, c.src, 16);
        committed_copies.erase(committed_copies.begin());
    }
}

// Runs `kernel` on every block of `grid`, `threads` threads each, with `shared_bytes` of
// dynamic shared memory (poisoned with NaNs, so reading what was never written shows).
template <class Kernel> void launch(uint3 grid, unsigned threads, size_t shared_bytes, Kernel kernel) {
    if (shared_bytes > sizeof(dynamic_shared)) throw std::runtime_error("dynamic shared memory too large");
    gridDim = grid;
    blockDim = {threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                std::memset(dynamic_shared, 0xff, sizeof(dynamic_shared));
                std::barrier<> barrier(threads);
                block_barrier = &barrier;
                warp_barriers.clear();
                for (unsigned w = 0; w < (threads + 31) / 32; ++w)
                    warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - 32 * w)));
                lane_slots.assign(threads, LaneSlot{});
                std::vector<std::thread> running;
                for (unsigned t = 0; t < threads; ++t)
                    running.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        kernel();
                        if (!open_copies.empty() || !committed_copies.empty()) {
                            std::fprintf(stderr, "thread %u ended with cp.async copies never waited for\n", t);
                            std::abort();
                        }
                    });
                for (auto& t : running) t.join();
            }
}
