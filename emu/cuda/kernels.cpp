// Modules and launches for the CUDA driver emulator: a module is the PTX that NVRTC produced
// (its `.entry` names are read from the text); a launch of `kv_gather` or `kv_scatter` runs
// kernels/kv_transfer.cu compiled for the host (kernels/host_shim.h) on the stream's worker,
// with the launch's grid, block and parameters. The kernel reads and writes device memory, so
// the device addresses in its parameters, and the plane addresses stored in device memory that
// `planes` points to, are translated to the allocations' host mappings first.

#include "host_shim.h"
#include "kv_transfer.cu"

#include <cstring>
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

}  // namespace

extern "C" {

CUresult cuModuleLoadData(CUmodule* module, const void* image) {
    if (CUresult r = emu::ready()) return r;
    if (!module || !image) return emu::INVALID_VALUE;
    std::string ptx(static_cast<const char*>(image));
    if (ptx.find(".version") == std::string::npos) return emu::INVALID_IMAGE;
    auto* m = new Module();
    for (size_t at = ptx.find(".entry"); at != std::string::npos; at = ptx.find(".entry", at + 6)) {
        size_t start = ptx.find_first_not_of(" \t", at + 6);
        size_t end = ptx.find_first_of("( \t\n", start);
        m->entries.insert(ptx.substr(start, end - start));
    }
    *module = reinterpret_cast<CUmodule>(m);
    return emu::SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
    if (CUresult r = emu::ready()) return r;
    if (!module) return emu::INVALID_HANDLE;
    delete reinterpret_cast<Module*>(module);
    return emu::SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule module, const char* name) {
    if (CUresult r = emu::ready()) return r;
    if (!f || !module || !name) return emu::INVALID_VALUE;
    auto* m = reinterpret_cast<Module*>(module);
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
        auto* planes = static_cast<u64*>(emu::translate_rest(p.planes));
        size_t count = emu::bytes_from(p.planes) / sizeof(u64);
        auto* pages = emu::translate(p.pages, size_t(p.page_blocks) * sizeof(u32));
        auto* staging = emu::translate(p.staging, 1);
        if (!planes || !pages || !staging) return emu::fault();
        std::vector<u64> host_planes(count);
        for (size_t i = 0; i < count; ++i) {
            void* h = planes[i] ? emu::translate(planes[i], 1) : nullptr;
            host_planes[i] = reinterpret_cast<u64>(h);
        }
        p.planes = reinterpret_cast<u64>(host_planes.data());
        p.pages = reinterpret_cast<u64>(pages);
        p.staging = reinterpret_cast<u64>(staging);
        kvf_host_launch(gather ? kv_gather : kv_scatter, kvf_dim3{gx, gy, 1}, kvf_dim3{bx, 1, 1}, p);
    });
    return emu::SUCCESS;
}

}  // extern "C"
