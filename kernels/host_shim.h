// Host shim: lets kernels/*.cu compile as plain C++ so their indexing runs on the CPU.
//
// Included before a kernel source compiled as C++ (tests/cuda/kv_transfer_host.cpp, built by
// tests/cuda/kernel_cuda_emu.rs). It defines the CUDA keywords the kernels use as nothing, the
// built-in index variables as thread-local variables, and a launcher that runs every thread of
// every block of a grid one after the other. That is a faithful emulation only because the
// kernels use no shared memory, no barriers and no warp intrinsics: each thread's work depends
// on its indices alone.
#pragma once

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) alignas(n)

struct kvf_dim3 {
    unsigned int x, y, z;
};

// Thread-local so that test threads can emulate launches concurrently.
static thread_local kvf_dim3 blockIdx;
static thread_local kvf_dim3 threadIdx;
static thread_local kvf_dim3 blockDim;
static thread_local kvf_dim3 gridDim;

// Runs `kernel(args...)` once per thread of a `grid` x `block` launch (x and y dimensions).
template <typename... Args>
void kvf_host_launch(void (*kernel)(Args...), kvf_dim3 grid, kvf_dim3 block, Args... args) {
    gridDim = grid;
    blockDim = block;
    for (unsigned int by = 0; by < grid.y; ++by) {
        for (unsigned int bx = 0; bx < grid.x; ++bx) {
            blockIdx = kvf_dim3{bx, by, 0};
            for (unsigned int ty = 0; ty < block.y; ++ty) {
                for (unsigned int tx = 0; tx < block.x; ++tx) {
                    threadIdx = kvf_dim3{tx, ty, 0};
                    kernel(args...);
                }
            }
        }
    }
}
