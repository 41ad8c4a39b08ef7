// A host emulation of the CUDA execution model, enough to run kernels.cu as C++: blocks run one
// after another; each thread of a block is an OS thread; __syncthreads is a barrier across them;
// __shared__ variables are statics and dynamic shared memory is one static buffer, both shared
// by the threads of the running block. Used by engine/tests/cuda_host.rs to check the kernels'
// logic where there is no GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
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
                std::vector<std::thread> running;
                for (unsigned t = 0; t < threads; ++t)
                    running.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        kernel();
                    });
                for (auto& t : running) t.join();
            }
}
