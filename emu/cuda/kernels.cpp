// Modules and launches for the CUDA driver emulator: a module is the PTX that NVRTC produced
// (its `.entry` names are read from the text); a launch of `kv_gather` or `kv_scatter` runs
// kernels/kv_transfer.cu compiled for the host (kernels/host_shim.h) on the stream's worker,
// with the launch's grid, block and parameters. The kernel reads and writes device memory, so
// the device addresses in its parameters, and the plane addresses stored in device memory that
// `planes` points to, are translated to the allocations' host mappings first, once every byte
// the launch would touch was found inside usable device memory (else the context's sticky
// ILLEGAL_ADDRESS, as a device's memory protection would raise).

#include "host_shim.h"
#include "kv_transfer.cu"

#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "emu.h"

namespace {

struct Module {
    std::set<std::string> entries;
};

struct Function {
    bool gather;
};

Function g_gather{true}, g_scatter{false};

// The modules loaded and not unloaded: a handle is checked against them.
std::mutex g_modules_lock;
std::set<Module*> g_modules;

Module* module_of(CUmodule module) {
    std::lock_guard<std::mutex> g(g_modules_lock);
    auto it = g_modules.find(reinterpret_cast<Module*>(module));
    return it == g_modules.end() ? nullptr : *it;
}

// Whether every byte the launch's `segments` touch lies in usable device memory, as a device's
// memory protection demands: each segment's pool rows and staging run are checked before the
// kernel runs. `p` holds device addresses; `table` and `pages` are host copies of its tables.
bool in_bounds(KvXferParams p, const std::vector<u64>& table, const u32* pages, u32 segments) {
    p.planes = reinterpret_cast<u64>(table.data());
    p.pages = reinterpret_cast<u64>(pages);
    for (u32 seg = 0; seg < segments; ++seg) {
        const u32 plane_index = seg / p.page_blocks;
        const u64 entry = u64(p.layer0 + plane_index / p.num_planes) * p.num_planes + plane_index % p.num_planes;
        if (entry >= table.size()) return false;
        const KvfRows r = kvf_segment(p, seg);
        if (r.rows == 0) continue;
        // The last row's end, in 128 bits: parameters may be anything.
        const unsigned __int128 end = (unsigned __int128)((r.rows - 1) / r.inner) * r.outer_stride +
                                      (unsigned __int128)((r.rows - 1) % r.inner) * r.inner_stride + r.run;
        if (end > ~u64(0) || !emu::translate(reinterpret_cast<u64>(r.pool), u64(end))) return false;
        if (!emu::translate(reinterpret_cast<u64>(r.staging), u64(r.rows) * r.run)) return false;
    }
    return true;
}

}  // namespace

extern "C" {

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
    if (CUresult r = emu::ready()) return r;
    if (!module || !image) return emu::INVALID_VALUE;
    std::string ptx(static_cast<const char*>(image));
    if (ptx.find(".version") == std::string::npos) return emu::INVALID_IMAGE;
    auto m = std::make_unique<Module>();
    for (size_t at = ptx.find(".entry"); at != std::string::npos; at = ptx.find(".entry", at + 6)) {
        size_t start = ptx.find_first_not_of(" \t", at + 6);
        size_t end = start == std::string::npos ? start : ptx.find_first_of("( \t\n", start);
        if (end == std::string::npos) return emu::INVALID_IMAGE;
        m->entries.insert(ptx.substr(start, end - start));
    }
    std::lock_guard<std::mutex> g(g_modules_lock);
    g_modules.insert(m.get());
    *module = reinterpret_cast<CUmodule>(m.release());
    return emu::SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
    if (CUresult r = emu::ready()) return r;
    std::lock_guard<std::mutex> g(g_modules_lock);
    if (!g_modules.erase(reinterpret_cast<Module*>(module))) return emu::INVALID_HANDLE;
    delete reinterpret_cast<Module*>(module);
    return emu::SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule module, const char* name) {
    if (CUresult r = emu::ready()) return r;
    if (!f || !name) return emu::INVALID_VALUE;
    Module* m = module_of(module);
    if (!m) return emu::INVALID_HANDLE;
    if (!m->entries.count(name)) return emu::NOT_FOUND;
    std::string n(name);
    if (n == "kv_gather") *f = reinterpret_cast<CUfunction>(&g_gather);
    else if (n == "kv_scatter") *f = reinterpret_cast<CUfunction>(&g_scatter);
    else return emu::NOT_FOUND;  // an entry the emulator has no host code for
    return emu::SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                        unsigned int by, unsigned int bz, unsigned int /*shared*/, CUstream s, void** params,
                        void** extra) {
    if (CUresult r = emu::ready()) return r;
    if (!f) return emu::INVALID_HANDLE;
    if (!params || extra) return emu::INVALID_VALUE;
    if (gx == 0 || gy == 0 || gz != 1 || bx == 0 || bx > 1024 || by != 1 || bz != 1) return emu::INVALID_VALUE;
    bool gather = reinterpret_cast<Function*>(f)->gather;
    KvXferParams p;
    std::memcpy(&p, params[0], sizeof p);
    emu::enqueue(s, [=]() mutable {
        // Translated when the launch runs: the memory must be live then, as on a device.
        auto [table, table_bytes] = emu::rest(p.planes);
        auto* pages = static_cast<u32*>(emu::translate(p.pages, size_t(p.page_blocks) * sizeof(u32)));
        auto* staging = emu::translate(p.staging, 1);
        if (!table || !pages || !staging || p.page_blocks == 0 || p.num_planes == 0) return emu::fault();
        std::vector<u64> planes(static_cast<u64*>(table), static_cast<u64*>(table) + table_bytes / sizeof(u64));
        if (!in_bounds(p, planes, pages, gx)) return emu::fault();
        for (u64& plane : planes) plane = reinterpret_cast<u64>(plane ? emu::translate(plane, 1) : nullptr);
        p.planes = reinterpret_cast<u64>(planes.data());
        p.pages = reinterpret_cast<u64>(pages);
        p.staging = reinterpret_cast<u64>(staging);
        kvf_host_launch(gather ? kv_gather : kv_scatter, kvf_dim3{gx, gy, 1}, kvf_dim3{bx, 1, 1}, p);
    });
    return emu::SUCCESS;
}

}  // extern "C"
