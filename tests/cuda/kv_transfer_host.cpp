// kernels/kv_transfer.cu compiled for the host: the CUDA source unchanged, preceded by the host
// shim, plus one C entry point that the emulation test (tests/cuda/kernel_cuda_emu.rs) loads.
#include "host_shim.h"
#include "kv_transfer.cu"

// Runs kv_gather (gather != 0) or kv_scatter over a grid_x x grid_y grid of block_x threads.
extern "C" void kvf_host_transfer(int gather, unsigned int grid_x, unsigned int grid_y,
                                  unsigned int block_x, const KvXferParams* params) {
    kvf_host_launch(gather ? kv_gather : kv_scatter, kvf_dim3{grid_x, grid_y, 1},
                    kvf_dim3{block_x, 1, 1}, *params);
}
