// kvferry transfer kernels: gather a selection of a KV pool into one contiguous staging buffer,
// and scatter a staging buffer into a selection of a pool. The contract is the CPU kernel's
// (src/kernel/mod.rs): a selection is a page list, a token range, a local layer range and a
// local head range; staging is `[layer][plane][page block][block order]`, the block order being
// token-major `[token][head][head_bytes]` or head-major `[head][token][head_bytes]` over the
// page block's selected tokens and heads.
//
// Compiled at run time by NVRTC (src/kernel/cuda), and on the host as C++ through
// kernels/host_shim.h for the byte-for-byte tests. Hence: no headers (NVRTC from the PyPI wheel
// ships none), no __shared__, no __syncthreads, no warp intrinsics; a thread's work depends only
// on its indices.
//
// Launch geometry (computed by src/kernel/cuda/launch.rs):
//   gridDim.x  = selected layers x planes x page blocks: one *segment* per CUDA block, a segment
//                being the selected tokens and heads of one page of one plane;
//   gridDim.y  = splits of a large segment, so that a thread copies a handful of 16-byte units;
//   blockDim.x = 32..256 threads, a multiple of 32, sized to the largest segment.
// Within a segment the bytes are a set of *rows*, each contiguous on both sides; each thread
// copies units of the widest width (16, 8, 4, 2 or 1 bytes) that divides both base addresses
// and every row stride, then the bytes of a row past the last whole unit (the scalar tail).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// A 16-byte unit, loaded and stored as one vector access (ld/st.v2.u64).
struct __align__(16) kvf_v16 {
    u64 lo;
    u64 hi;
};

// Kernel parameters, passed by value. Mirrored by `KvXferParams` in src/kernel/cuda/launch.rs
// (#[repr(C)]): keep the two in the same order.
struct KvXferParams {
    u64 planes;       // address of u64[pool layers * planes]: base address of every plane
    u64 pages;        // address of u32[page_blocks]: the pool page of each page block
    u64 staging;      // address of the staging buffer
    u64 page_stride;  // bytes between page p and page p + 1 of one plane
    u32 page_size;    // tokens per page
    u32 pool_heads;   // heads the pool holds
    u32 head_bytes;   // bytes of one head of one token
    u32 cell_bytes;   // bytes from one head of a token to the next in a page: head_bytes, or
                      // num_planes x head_bytes where K and V share cells (vLLM 0.32 on CUDA)
    u32 num_planes;   // planes per layer: 2 (K, V) or 1 (MLA latent)
    u32 layer0;       // first selected local layer
    u32 head0;        // first selected local head
    u32 heads;        // selected heads
    u32 page_blocks;  // page blocks per plane
    u32 first_token;  // first selected token, counted from the start of the first page block's page
    u32 end_token;    // end of the selected tokens, same origin
    u32 pool_order;   // 0: token-major pages, 1: head-major pages
    u32 wire_order;   // 0: token-major staging blocks, 1: head-major staging blocks
};

#define KVF_TOKEN_MAJOR 0u

// One segment's rows: row k sits at `pool + (k / inner) * outer_stride + (k % inner) *
// inner_stride` in the pool and at `staging + k * run` in staging.
struct KvfRows {
    u8* pool;
    u8* staging;
    u32 rows;
    u32 inner;
    u32 outer_stride;
    u32 inner_stride;
    u32 run;
};

template <typename T, bool GATHER>
__device__ __forceinline__ void kvf_copy_units(const KvfRows& r, u32 start, u32 step) {
    const u32 width = (u32)sizeof(T);
    const u32 units = r.run / width;
    const u32 total = r.rows * units;
    for (u32 v = start; v < total; v += step) {
        const u32 k = v / units;
        const u32 at = (v - k * units) * width;
        u32 outer = k;
        u32 inner = 0;
        if (r.inner > 1) {
            outer = k / r.inner;
            inner = k - outer * r.inner;
        }
        T* p = (T*)(r.pool + outer * r.outer_stride + inner * r.inner_stride + at);
        T* s = (T*)(r.staging + (u64)k * r.run + at);
        if (GATHER) {
            *s = *p;
        } else {
            *p = *s;
        }
    }
    // The scalar tail: bytes of a row past its last whole unit. Only single-row segments have
    // one (the staging stride of a multi-row segment is a multiple of the width).
    const u32 tail = r.run - units * width;
    if (tail != 0) {
        const u32 body = units * width;
        for (u32 v = start; v < r.rows * tail; v += step) {
            const u32 k = v / tail;
            const u32 at = body + (v - k * tail);
            u32 outer = k;
            u32 inner = 0;
            if (r.inner > 1) {
                outer = k / r.inner;
                inner = k - outer * r.inner;
            }
            u8* p = r.pool + outer * r.outer_stride + inner * r.inner_stride + at;
            u8* s = r.staging + (u64)k * r.run + at;
            if (GATHER) {
                *s = *p;
            } else {
                *p = *s;
            }
        }
    }
}

// Describes the rows of segment `seg` (layer-major, then plane, then page block).
__device__ __forceinline__ KvfRows kvf_segment(const KvXferParams& p, u32 seg) {
    const u32 block = seg % p.page_blocks;
    const u32 plane_index = seg / p.page_blocks;  // selected layer * planes + plane
    const u32 plane = plane_index % p.num_planes;
    const u32 layer = plane_index / p.num_planes;

    const u32 page_start = block * p.page_size;
    const u32 t0 = block == 0 ? p.first_token : page_start;
    const u32 t1 = p.end_token < page_start + p.page_size ? p.end_token : page_start + p.page_size;
    const u32 in_page = t0 - page_start;
    const u32 nt = t1 - t0;
    const u32 nh = p.heads;
    const u32 hb = p.head_bytes;
    const u32 held = p.pool_heads;
    const u32 ps = p.page_size;

    const u64* planes = (const u64*)p.planes;
    const u32* pages = (const u32*)p.pages;
    u8* block_base = (u8*)(planes[(u64)(p.layer0 + layer) * p.num_planes + plane]) +
                     (u64)pages[block] * p.page_stride;
    const u64 plane_bytes = (u64)(p.end_token - p.first_token) * nh * hb;
    const u64 staged = (u64)plane_index * plane_bytes + (u64)(t0 - p.first_token) * nh * hb;

    KvfRows r;
    r.staging = (u8*)p.staging + staged;
    const bool pool_tm = p.pool_order == KVF_TOKEN_MAJOR;
    const bool wire_tm = p.wire_order == KVF_TOKEN_MAJOR;
    const u32 cb = p.cell_bytes;
    const u32 first = pool_tm ? (in_page * held + p.head0) * cb : (p.head0 * ps + in_page) * cb;
    r.pool = block_base + first;
    // Pool distances between consecutive tokens and between consecutive heads.
    const u32 token_stride = pool_tm ? held * cb : cb;
    const u32 head_stride = pool_tm ? cb : ps * cb;
    // One head of one token per row, in the wire's order: token outer (token-major staging)
    // or head outer (head-major staging).
    r.rows = nt * nh;
    r.run = hb;
    if (wire_tm) {
        r.inner = nh;
        r.outer_stride = token_stride;
        r.inner_stride = head_stride;
    } else {
        r.inner = nt;
        r.outer_stride = head_stride;
        r.inner_stride = token_stride;
    }
    // Inner rows adjacent in the pool: each outer row is one run (a token's selected heads in
    // a token-major page, a head's selected tokens in a head-major page).
    if (r.inner > 1 && r.inner_stride == r.run) {
        r.run *= r.inner;
        r.rows /= r.inner;
        r.inner = 1;
        r.inner_stride = 0;
    }
    if (r.inner == 1) r.inner_stride = 0;
    // A single outer row whose inner rows are adjacent, or adjacent outer rows: one run.
    if (r.inner > 1 && r.inner == r.rows) {
        r.outer_stride = r.inner_stride;
        r.inner = 1;
        r.inner_stride = 0;
    }
    if (r.inner == 1 && (r.rows == 1 || r.outer_stride == r.run)) {
        r.run *= r.rows;
        r.rows = 1;
        r.outer_stride = 0;
    }
    return r;
}

template <bool GATHER>
__device__ __forceinline__ void kvf_transfer(const KvXferParams& p) {
    const KvfRows r = kvf_segment(p, blockIdx.x);
    const u32 start = blockIdx.y * blockDim.x + threadIdx.x;
    const u32 step = gridDim.y * blockDim.x;
    // Every address a unit touches is a sum of these, so their common alignment is the unit's.
    u64 align = (u64)r.pool | (u64)r.staging;
    if (r.rows > 1) {
        align |= r.run | r.outer_stride | r.inner_stride;
    }
    if ((align & 15) == 0) {
        kvf_copy_units<kvf_v16, GATHER>(r, start, step);
    } else if ((align & 7) == 0) {
        kvf_copy_units<u64, GATHER>(r, start, step);
    } else if ((align & 3) == 0) {
        kvf_copy_units<u32, GATHER>(r, start, step);
    } else if ((align & 1) == 0) {
        kvf_copy_units<u16, GATHER>(r, start, step);
    } else {
        kvf_copy_units<u8, GATHER>(r, start, step);
    }
}

// Pool -> staging.
extern "C" __global__ void kv_gather(const KvXferParams p) { kvf_transfer<true>(p); }

// Staging -> pool.
extern "C" __global__ void kv_scatter(const KvXferParams p) { kvf_transfer<false>(p); }
