// The CUDA driver emulator's memory: device allocations, pinned host memory, the virtual memory
// management API (reserve, create, map, access, shareable handles) and CUDA IPC.
//
// Device addresses lie inside one reserved PROT_NONE range, so host code that dereferences a
// device pointer crashes. Every device address range (a region) has a host mirror of the same
// length that the emulator reaches by translating the address. The bytes behind a region are
// memfds, never anonymous memory, so that another process can map the same pages: CUDA IPC
// handles name the exporter's memfd (opened through /proc/PID/fd), shareable handles are dups
// of it. Freed ranges are never handed out again, and a guard gap follows each region, so a
// stale or overrun device pointer never reaches another allocation.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "emu.h"

namespace {

using namespace emu;

constexpr size_t kReserve = size_t(1) << 40;  // the reserved device address range (1 TiB)
constexpr size_t kBaseAlign = size_t(1) << 30;  // its start, so that offsets align addresses
constexpr size_t kGranularity = size_t(2) << 20;  // the VMM API's granularity, as on devices
constexpr size_t kAllocAlign = size_t(64) << 10;  // cuMemAlloc's: 64 KiB, like the driver's
constexpr const char* kMemfdPrefix = "kvferry-cuda-emu-";
constexpr uint32_t kIpcMagic = 0x4b564645;  // "KVFE"

std::atomic<size_t> g_used{0};  // bytes of device memory created in this process
std::atomic<uint64_t> g_serial{0};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Device memory's bytes: a memfd. Created here (counted as used) or imported from another
// process (a shareable handle, an IPC handle).
struct Backing {
    int fd;
    size_t bytes;
    uint64_t serial;  // the number in the memfd's name; IPC handles check it
    bool local;

    ~Backing() {
        close(fd);
        if (local) g_used -= bytes;
    }
};

// Null when the device is full (or the memfd cannot be made).
std::shared_ptr<Backing> create_backing(size_t bytes) {
    size_t used = g_used.load();
    do {
        if (bytes > kDeviceBytes - used) return nullptr;
    } while (!g_used.compare_exchange_weak(used, used + bytes));
    uint64_t serial = ++g_serial;
    std::string name = kMemfdPrefix + std::to_string(serial);
    int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, off_t(bytes)) == 0)
        return std::shared_ptr<Backing>(new Backing{fd, bytes, serial, true});
    if (fd >= 0) close(fd);
    g_used -= bytes;
    return nullptr;
}

// The serial in the name of the memfd at `link` (a /proc/.../fd/N path); 0 if it is not one
// of the emulator's.
uint64_t memfd_serial(const std::string& link) {
    char target[256];
    ssize_t n = readlink(link.c_str(), target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = 0;
    std::string want = std::string("/memfd:") + kMemfdPrefix;
    if (strncmp(target, want.c_str(), want.size()) != 0) return 0;
    return strtoull(target + want.size(), nullptr, 10);
}

// A memfd of the emulator's received from elsewhere (`fd` is kept).
std::shared_ptr<Backing> adopt_backing(int fd) {
    uint64_t serial = memfd_serial("/proc/self/fd/" + std::to_string(fd));
    struct stat st;
    if (!serial || fstat(fd, &st) != 0) return nullptr;
    return std::shared_ptr<Backing>(new Backing{fd, size_t(st.st_size), serial, false});
}

enum class Kind { Alloc, Ipc, Reserved };

// An exporter's allocation: its process (pid and start time) and memfd serial.
struct IpcKey {
    int32_t pid = 0;
    uint64_t start_time = 0;
    uint64_t serial = 0;
    bool operator==(const IpcKey& o) const { return pid == o.pid && start_time == o.start_time && serial == o.serial; }
};

// A VMM allocation handle: its memory, whether it may be exported as a POSIX fd, and the device
// it was created for.
struct VmmHandle {
    std::shared_ptr<Backing> backing;
    bool shareable;
    int device;
};

// A piece of a reservation mapped by cuMemMap: the handle it maps (cuMemRetainAllocationHandle
// gives it back).
struct Piece {
    size_t bytes;
    VmmHandle handle;
    bool accessible = false;  // cuMemSetAccess granted read/write
};

struct Region {
    Kind kind;
    size_t bytes;
    uint8_t* host;  // the host mirror
    int device;
    std::shared_ptr<Backing> backing;  // Alloc, Ipc: the whole region
    std::map<size_t, Piece> pieces;    // Reserved: by offset
    int opens = 0;                     // Ipc: cuIpcOpenMemHandle calls not yet closed
    IpcKey ipc_key;                    // Ipc: what was opened
};

// Host memory the driver allocated (cuMemHostAlloc) or registered (cuMemHostRegister).
struct Pinned {
    size_t bytes;
    bool allocated;
};

// The 64 bytes of a CUipcMemHandle.
struct IpcHandle {
    uint32_t magic;
    int32_t pid;
    uint64_t start_time;  // the exporter's, so that a reused pid is not taken for it
    int32_t fd;           // the exporter's memfd
    int32_t device;
    uint64_t serial;
    uint64_t bytes;
    char unused[24];
};
static_assert(sizeof(IpcHandle) == 64, "CUipcMemHandle is 64 bytes");

// A process's start time (field 22 of /proc/PID/stat); 0 if it does not exist.
uint64_t start_time(int pid) {
    std::string path = "/proc/" + std::to_string(pid) + "/stat";
    FILE* f = fopen(path.c_str(), "r");
    if (!f) return 0;
    char buf[1024];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char* p = strrchr(buf, ')');  // the command name may hold spaces
    if (!p) return 0;
    unsigned long long t = 0;
    // After ")": state (3), then fields 4..21, then starttime (22).
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &t) != 1)
        return 0;
    return t;
}

struct Memory {
    std::mutex lock;
    uint8_t* base = nullptr;  // the reserved PROT_NONE range
    size_t next = 0;          // offset of the next region
    std::map<CUdeviceptr, Region> regions;
    std::map<uintptr_t, Pinned> pinned;  // host allocations and registrations
    std::map<uint64_t, VmmHandle> handles;  // VMM allocation handles
    uint64_t next_handle = 0;

    CUresult init() {
        void* p = mmap(nullptr, kReserve + kBaseAlign, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return OUT_OF_MEMORY;
        base = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(p), kBaseAlign));
        // Every allocation holds a memfd open: allow as many as the hard limit does.
        struct rlimit files;
        if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
            files.rlim_cur = files.rlim_max;
            setrlimit(RLIMIT_NOFILE, &files);
        }
        return SUCCESS;
    }

    // A fresh device address range of `bytes` aligned to `align` (lock held); 0 when the
    // reserved range is used up.
    CUdeviceptr take_range(size_t bytes, size_t align) {
        size_t start = round_up(next, align);
        if (start > kReserve || bytes > kReserve - start) return 0;
        next = start + bytes + kAllocAlign;  // a guard gap
        return reinterpret_cast<CUdeviceptr>(base + start);
    }

    // The region holding `d` (lock held); null if none.
    std::pair<const CUdeviceptr, Region>* find(CUdeviceptr d) {
        auto it = regions.upper_bound(d);
        if (it == regions.begin()) return nullptr;
        --it;
        if (d >= it->first + it->second.bytes) return nullptr;
        return &*it;
    }

    // The mapped piece of a reservation that holds `d`, and its device address (lock held);
    // null if `d` lies in no region or in an unmapped part of a reservation. For an
    // allocation or an opened IPC handle, the whole region is the piece: `region` is set.
    struct Holding {
        CUdeviceptr start = 0;
        size_t bytes = 0;
        Region* region = nullptr;
        Piece* piece = nullptr;  // only in a reservation
    };
    Holding holding(CUdeviceptr d) {
        auto* r = find(d);
        if (!r) return {};
        if (r->second.kind != Kind::Reserved) return {r->first, r->second.bytes, &r->second, nullptr};
        auto& pieces = r->second.pieces;
        auto it = pieces.upper_bound(d - r->first);
        if (it == pieces.begin()) return {};
        --it;
        if (d - r->first >= it->first + it->second.bytes) return {};
        return {r->first + it->first, it->second.bytes, &r->second, &it->second};
    }

    // The host address of `d` and how many bytes from it are usable (lock held).
    std::pair<void*, size_t> host_of(CUdeviceptr d) {
        auto* r = find(d);
        if (r) {
            Region& g = r->second;
            size_t off = d - r->first;
            if (g.kind != Kind::Reserved) return {g.host + off, g.bytes - off};
            // A reservation: the accessible pieces that follow one another from `off` on.
            size_t end = off;
            for (auto& [at, piece] : g.pieces) {
                if (at + piece.bytes <= end) continue;
                if (at > end || !piece.accessible) break;
                end = at + piece.bytes;
            }
            if (end == off) return {nullptr, 0};
            return {g.host + off, end - off};
        }
        auto p = pinned.upper_bound(uintptr_t(d));
        if (p != pinned.begin()) {
            --p;
            if (d >= p->first && d < p->first + p->second.bytes)
                return {reinterpret_cast<void*>(d), p->first + p->second.bytes - d};
        }
        return {nullptr, 0};
    }

    CUresult alloc(CUdeviceptr* out, size_t bytes, int device) {
        if (!out || bytes == 0) return INVALID_VALUE;
        size_t rounded = round_up(bytes, kAllocAlign);
        auto backing = create_backing(rounded);
        if (!backing) return OUT_OF_MEMORY;
        void* host = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, backing->fd, 0);
        if (host == MAP_FAILED) return OUT_OF_MEMORY;
        std::lock_guard<std::mutex> g(lock);
        CUdeviceptr d = take_range(rounded, kAllocAlign);
        if (!d) {
            munmap(host, rounded);
            return OUT_OF_MEMORY;
        }
        regions[d] = Region{Kind::Alloc, bytes, static_cast<uint8_t*>(host), device, backing, {}, 0, {}};
        *out = d;
        return SUCCESS;
    }

    // An IPC handle this process has open already: counted once more (lock held).
    bool reopen(const IpcKey& key, CUdeviceptr* out) {
        for (auto& [d, region] : regions) {
            if (region.kind == Kind::Ipc && region.ipc_key == key) {
                region.opens++;
                *out = d;
                return true;
            }
        }
        return false;
    }

    // Removes the region at `d` of `kind` (its base); INVALID_VALUE if there is none.
    CUresult drop(CUdeviceptr d, Kind kind) {
        std::lock_guard<std::mutex> g(lock);
        auto it = regions.find(d);
        if (it == regions.end() || it->second.kind != kind) return INVALID_VALUE;
        Region& r = it->second;
        if (kind == Kind::Ipc && --r.opens > 0) return SUCCESS;
        if (kind == Kind::Reserved && !r.pieces.empty()) return INVALID_VALUE;  // unmap first
        munmap(r.host, round_up(r.bytes, kAllocAlign));
        regions.erase(it);
        return SUCCESS;
    }
};

// Never destroyed: stream workers may still translate addresses while the process exits.
Memory& g_mem = *new Memory();

// Makes [p, p + bytes) of a host mirror an inaccessible hole again.
bool hole(uint8_t* p, size_t bytes) {
    return mmap(p, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != MAP_FAILED;
}

}  // namespace

namespace emu {

CUresult memory_init() { return g_mem.init(); }

void* translate(CUdeviceptr d, size_t n) {
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto [host, bytes] = g_mem.host_of(d);
    return host && n <= bytes ? host : nullptr;
}

std::pair<void*, size_t> rest(CUdeviceptr d) {
    std::lock_guard<std::mutex> g(g_mem.lock);
    return g_mem.host_of(d);
}

uint64_t process_start_time(int pid) { return start_time(pid); }

bool is_device(CUdeviceptr d) {
    return g_mem.base && d >= reinterpret_cast<CUdeviceptr>(g_mem.base) &&
           d < reinterpret_cast<CUdeviceptr>(g_mem.base + kReserve);
}

}  // namespace emu

extern "C" {

// ---- device memory ---------------------------------------------------------------------------

CUresult cuMemAlloc_v2(CUdeviceptr* d, size_t bytes) {
    if (CUresult r = ready()) return r;
    return g_mem.alloc(d, bytes, current_device());
}

CUresult cuMemFree_v2(CUdeviceptr d) {
    if (CUresult r = ready()) return r;
    // The driver waits for the device before freeing: work in flight may still use it.
    synchronize_device();
    return g_mem.drop(d, Kind::Alloc);
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    if (CUresult r = ready()) return r;
    if (!free_bytes || !total) return INVALID_VALUE;
    *total = kDeviceBytes;
    size_t used = g_used.load();
    *free_bytes = used < kDeviceBytes ? kDeviceBytes - used : 0;
    return SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* bytes, CUdeviceptr d) {
    if (CUresult r = ready()) return r;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto held = g_mem.holding(d);  // a reservation's range is its mapped piece's
    if (!held.region) return NOT_FOUND;
    if (base) *base = held.start;
    if (bytes) *bytes = held.bytes;
    return SUCCESS;
}

// ---- pointer attributes ----------------------------------------------------------------------

namespace {

// The CU_POINTER_ATTRIBUTE_* the emulator answers.
enum PointerAttribute : int {
    kContext = 1,
    kMemoryType = 2,
    kDevicePointer = 3,
    kHostPointer = 4,
    kSyncMemops = 6,
    kBufferId = 7,
    kIsManaged = 8,
    kDeviceOrdinal = 9,
    kLegacyIpcCapable = 10,
    kRangeStart = 11,
    kRangeSize = 12,
    kMapped = 13,
    kAllowedHandleTypes = 14,
    kMempoolHandle = 17,
};
constexpr unsigned kMemoryTypeHost = 1, kMemoryTypeDevice = 2;  // CUmemorytype

// What the driver knows of an address: the allocation holding it (a cuMemAlloc, an opened IPC
// handle, a mapped VMM piece, pinned host memory), or nothing.
struct Pointer {
    bool device = false, pinned = false;
    CUdeviceptr start = 0;
    size_t bytes = 0;
    int ordinal = 0;
    bool ipc_capable = false;
    bool exports_fd = false;  // a VMM piece whose handle may be exported as a POSIX fd
};

Pointer pointer_of(CUdeviceptr d) {
    std::lock_guard<std::mutex> g(g_mem.lock);
    Pointer p;
    if (auto held = g_mem.holding(d); held.region) {
        p.device = true;
        p.start = held.start;
        p.bytes = held.bytes;
        p.ordinal = held.region->device;
        p.ipc_capable = held.region->kind == Kind::Alloc;
        p.exports_fd = held.piece && held.piece->handle.shareable;
        return p;
    }
    auto it = g_mem.pinned.upper_bound(uintptr_t(d));
    if (it != g_mem.pinned.begin()) {
        --it;
        if (d >= it->first && d < it->first + it->second.bytes) {
            p.pinned = true;
            p.start = it->first;
            p.bytes = it->second.bytes;
        }
    }
    return p;
}

// The size of an attribute's value as the driver writes it; 0 for one the emulator does not answer.
size_t attribute_size(int attr) {
    switch (attr) {
        case kMemoryType: case kSyncMemops: case kIsManaged: case kDeviceOrdinal: case kLegacyIpcCapable:
        case kMapped:
            return sizeof(int);
        case kContext: case kDevicePointer: case kHostPointer: case kBufferId: case kRangeStart: case kRangeSize:
        case kAllowedHandleTypes: case kMempoolHandle:
            return sizeof(void*);
        default:
            return 0;
    }
}

// One attribute of `p` into `data` (the driver's type for each); INVALID_VALUE for memory the
// driver does not know or an attribute it does not answer for it.
// `d` is the address asked about: its device and host pointers are itself (unified addressing).
CUresult attribute(const Pointer& p, CUdeviceptr d, int attr, void* data) {
    if (!p.device && !p.pinned) return INVALID_VALUE;
    auto put = [data](auto v) { memcpy(data, &v, sizeof v); };
    switch (attr) {
        case kContext: put(primary_context(p.ordinal)); break;
        case kMemoryType: put(p.device ? kMemoryTypeDevice : kMemoryTypeHost); break;
        case kDevicePointer: put(d); break;
        case kHostPointer:
            if (p.device) return INVALID_VALUE;
            put(reinterpret_cast<void*>(d));
            break;
        case kSyncMemops: put(int(1)); break;
        case kBufferId: put(static_cast<unsigned long long>(p.start)); break;  // never reused
        case kIsManaged: put(int(0)); break;
        case kDeviceOrdinal: put(int(p.ordinal)); break;
        case kLegacyIpcCapable: put(int(p.ipc_capable)); break;
        case kRangeStart: put(p.start); break;
        case kRangeSize: put(p.bytes); break;
        case kMapped: put(int(1)); break;
        case kAllowedHandleTypes: put(static_cast<unsigned long long>(p.exports_fd));  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: 1
            break;
        case kMempoolHandle: put(static_cast<void*>(nullptr)); break;  // no memory pools here
        default:
            fprintf(stderr, "kvferry CUDA emulator: pointer attribute %d is not emulated\n", attr);
            return INVALID_VALUE;
    }
    return SUCCESS;
}

}  // namespace

CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr d) {
    if (CUresult r = initialised()) return r;
    if (!data) return INVALID_VALUE;
    return attribute(pointer_of(d), d, attr, data);
}

// Unlike cuPointerGetAttribute, memory the driver does not know is no error: its attributes
// read as zero (a null context, memory type 0), as the driver documents.
CUresult cuPointerGetAttributes(unsigned int count, int* attrs, void** data, CUdeviceptr d) {
    if (CUresult r = initialised()) return r;
    if (!attrs || !data) return INVALID_VALUE;
    Pointer p = pointer_of(d);
    for (unsigned i = 0; i < count; ++i) {
        if (!data[i]) continue;
        if (attribute(p, d, attrs[i], data[i]) == SUCCESS) continue;
        if (p.device || p.pinned) return INVALID_VALUE;
        // Unknown memory: the attribute's zero (CU_DEVICE_INVALID for the device), at its size.
        size_t size = attribute_size(attrs[i]);
        if (size == 0) {
            fprintf(stderr, "kvferry CUDA emulator: pointer attribute %d is not emulated\n", attrs[i]);
            return INVALID_VALUE;
        }
        memset(data[i], 0, size);
        if (attrs[i] == kDeviceOrdinal) {
            int none = -2;
            memcpy(data[i], &none, sizeof none);
        }
    }
    return SUCCESS;
}

// Synchronous memory operations on device memory always synchronize here (every copy is
// ordered on its stream): setting CU_POINTER_ATTRIBUTE_SYNC_MEMOPS is accepted and changes
// nothing.
CUresult cuPointerSetAttribute(const void* value, int attr, CUdeviceptr d) {
    if (CUresult r = ready()) return r;
    if (!value || attr != kSyncMemops || !pointer_of(d).device) return INVALID_VALUE;
    return SUCCESS;
}

// ---- pinned host memory ----------------------------------------------------------------------

CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int /*flags*/) {
    if (CUresult r = ready()) return r;
    if (!p || bytes == 0) return INVALID_VALUE;
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_mem.lock);
    g_mem.pinned[uintptr_t(m)] = Pinned{bytes, true};
    *p = m;
    return SUCCESS;
}

CUresult cuMemFreeHost(void* p) {
    if (CUresult r = ready()) return r;
    synchronize_device();  // as cuMemFree: work in flight may still use it
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto it = g_mem.pinned.find(uintptr_t(p));
    if (it == g_mem.pinned.end() || !it->second.allocated) return INVALID_VALUE;
    munmap(p, it->second.bytes);
    g_mem.pinned.erase(it);
    return SUCCESS;
}

CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned int /*flags*/) {
    if (CUresult r = ready()) return r;
    if (!p || bytes == 0 || bytes > UINTPTR_MAX - uintptr_t(p)) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto next = g_mem.pinned.lower_bound(uintptr_t(p));
    bool overlaps = (next != g_mem.pinned.end() && next->first < uintptr_t(p) + bytes) ||
                    (next != g_mem.pinned.begin() &&
                     std::prev(next)->first + std::prev(next)->second.bytes > uintptr_t(p));
    if (overlaps) return HOST_MEMORY_ALREADY_REGISTERED;
    g_mem.pinned[uintptr_t(p)] = Pinned{bytes, false};
    return SUCCESS;
}

CUresult cuMemHostUnregister(void* p) {
    if (CUresult r = ready()) return r;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto it = g_mem.pinned.find(uintptr_t(p));
    if (it == g_mem.pinned.end() || it->second.allocated) return HOST_MEMORY_NOT_REGISTERED;
    g_mem.pinned.erase(it);
    return SUCCESS;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int flags) {
    if (CUresult r = ready()) return r;
    if (!d || flags != 0) return INVALID_VALUE;
    if (is_device(CUdeviceptr(uintptr_t(p))) || !translate(CUdeviceptr(uintptr_t(p)), 1)) return INVALID_VALUE;
    *d = CUdeviceptr(uintptr_t(p));  // unified addressing: the host address
    return SUCCESS;
}

// ---- virtual memory management ---------------------------------------------------------------

// The fields of CUmemAllocationProp and CUmemAccessDesc the emulator reads.
struct MemLocation {
    int type;  // 1: a device
    int id;
};
struct AllocationProp {
    int type;                  // 1: pinned device memory
    int requested_handle_types;  // bit 1: a POSIX file descriptor
    MemLocation location;
    void* win32;
    unsigned char flags[8];
};
struct AccessDesc {
    MemLocation location;
    int flags;  // 0: none, 3: read and write
};
constexpr int kPosixFd = 1;

bool valid_prop(const AllocationProp* prop) {
    return prop && prop->type == 1 && prop->location.type == 1 && prop->location.id >= 0 &&
           prop->location.id < kDevices;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const AllocationProp* prop, int /*option*/) {
    if (CUresult r = ready()) return r;
    if (!granularity || !valid_prop(prop)) return INVALID_VALUE;
    *granularity = kGranularity;
    return SUCCESS;
}

CUresult cuMemCreate(unsigned long long* handle, size_t bytes, const AllocationProp* prop, unsigned long long flags) {
    if (CUresult r = ready()) return r;
    if (!handle || !valid_prop(prop) || flags != 0 || bytes == 0 || bytes % kGranularity) return INVALID_VALUE;
    if ((prop->requested_handle_types & ~kPosixFd) != 0) return NOT_SUPPORTED;
    auto backing = create_backing(bytes);
    if (!backing) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_mem.lock);
    *handle = ++g_mem.next_handle;
    g_mem.handles[*handle] = VmmHandle{backing, prop->requested_handle_types == kPosixFd, prop->location.id};
    return SUCCESS;
}

// The memory lives on while a mapping uses it.
CUresult cuMemRelease(unsigned long long handle) {
    if (CUresult r = ready()) return r;
    std::lock_guard<std::mutex> g(g_mem.lock);
    return g_mem.handles.erase(handle) ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void* out, unsigned long long handle, int type, unsigned long long flags) {
    if (CUresult r = ready()) return r;
    if (!out || type != kPosixFd || flags != 0) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto it = g_mem.handles.find(handle);
    if (it == g_mem.handles.end() || !it->second.shareable) return INVALID_VALUE;
    int fd = fcntl(it->second.backing->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return OUT_OF_MEMORY;
    *static_cast<int*>(out) = fd;
    return SUCCESS;
}

// The fd stays the caller's to close, as with the driver.
CUresult cuMemImportFromShareableHandle(unsigned long long* handle, void* os_handle, int type) {
    if (CUresult r = ready()) return r;
    if (!handle || type != kPosixFd) return INVALID_VALUE;
    int fd = fcntl(int(reinterpret_cast<intptr_t>(os_handle)), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return INVALID_VALUE;
    auto backing = adopt_backing(fd);
    if (!backing) {
        close(fd);
        return INVALID_VALUE;
    }
    std::lock_guard<std::mutex> g(g_mem.lock);
    *handle = ++g_mem.next_handle;
    g_mem.handles[*handle] = VmmHandle{backing, true, current_device()};
    return SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* out, size_t bytes, size_t alignment, CUdeviceptr /*hint*/,
                             unsigned long long flags) {
    if (CUresult r = ready()) return r;
    if (!out || flags != 0 || bytes == 0 || bytes % kGranularity || (alignment & (alignment - 1))) return INVALID_VALUE;
    void* host = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (host == MAP_FAILED) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_mem.lock);
    CUdeviceptr d = g_mem.take_range(bytes, alignment > kGranularity ? alignment : kGranularity);
    if (!d) {
        munmap(host, bytes);
        return OUT_OF_MEMORY;
    }
    g_mem.regions[d] = Region{Kind::Reserved, bytes, static_cast<uint8_t*>(host), current_device(), nullptr, {}, 0, {}};
    *out = d;
    return SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr d, size_t bytes) {
    if (CUresult r = ready()) return r;
    {
        std::lock_guard<std::mutex> g(g_mem.lock);
        auto it = g_mem.regions.find(d);
        if (it == g_mem.regions.end() || it->second.bytes != bytes) return INVALID_VALUE;
    }
    return g_mem.drop(d, Kind::Reserved);
}

// Maps [offset, offset + bytes) of `handle` at `d`, inside one reservation, where nothing is
// mapped yet. Not accessible until cuMemSetAccess.
CUresult cuMemMap(CUdeviceptr d, size_t bytes, size_t offset, unsigned long long handle, unsigned long long flags) {
    if (CUresult r = ready()) return r;
    if (flags != 0 || bytes == 0 || bytes % kGranularity || offset % kGranularity) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto h = g_mem.handles.find(handle);
    if (h == g_mem.handles.end()) return INVALID_HANDLE;
    const auto& backing = h->second.backing;
    if (offset > backing->bytes || bytes > backing->bytes - offset) return INVALID_VALUE;
    auto* r = g_mem.find(d);
    if (!r || r->second.kind != Kind::Reserved) return INVALID_VALUE;
    Region& region = r->second;
    size_t at = d - r->first;
    if (at % kGranularity || bytes > region.bytes - at) return INVALID_VALUE;
    auto next = region.pieces.lower_bound(at);
    if (next != region.pieces.end() && next->first < at + bytes) return INVALID_VALUE;
    if (next != region.pieces.begin() && std::prev(next)->first + std::prev(next)->second.bytes > at)
        return INVALID_VALUE;
    void* m = mmap(region.host + at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, backing->fd, off_t(offset));
    if (m == MAP_FAILED) {
        hole(region.host + at, bytes);  // the range may be unmapped now: keep it ours
        return OUT_OF_MEMORY;
    }
    region.pieces[at] = Piece{bytes, h->second};
    return SUCCESS;
}

// A new handle to the allocation mapped at `addr` (released by cuMemRelease); memory not
// mapped by cuMemMap is INVALID_VALUE, as the driver answers for cuMemAlloc's.
CUresult cuMemRetainAllocationHandle(unsigned long long* handle, void* addr) {
    if (CUresult r = initialised()) return r;
    if (!handle) return INVALID_VALUE;
    CUdeviceptr d = CUdeviceptr(uintptr_t(addr));
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto held = g_mem.holding(d);
    if (!held.piece) return INVALID_VALUE;
    *handle = ++g_mem.next_handle;
    g_mem.handles[*handle] = held.piece->handle;
    return SUCCESS;
}

CUresult cuMemGetAllocationPropertiesFromHandle(AllocationProp* prop, unsigned long long handle) {
    if (CUresult r = initialised()) return r;
    if (!prop) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto h = g_mem.handles.find(handle);
    if (h == g_mem.handles.end()) return INVALID_HANDLE;
    *prop = AllocationProp{};
    prop->type = 1;
    prop->requested_handle_types = h->second.shareable ? kPosixFd : 0;
    prop->location = MemLocation{1, h->second.device};
    return SUCCESS;
}

// Unmaps whole pieces covering exactly [d, d + bytes).
CUresult cuMemUnmap(CUdeviceptr d, size_t bytes) {
    if (CUresult r = ready()) return r;
    synchronize_device();
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto* r = g_mem.find(d);
    if (!r || r->second.kind != Kind::Reserved) return INVALID_VALUE;
    Region& region = r->second;
    size_t at = d - r->first, end = at;
    auto first = region.pieces.find(at);
    if (first == region.pieces.end()) return INVALID_VALUE;
    auto last = first;
    while (last != region.pieces.end() && last->first == end && end < at + bytes) end += (last++)->second.bytes;
    if (end != at + bytes) return INVALID_VALUE;
    if (!hole(region.host + at, bytes)) return OUT_OF_MEMORY;
    region.pieces.erase(first, last);
    return SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr d, size_t bytes, const AccessDesc* desc, size_t count) {
    if (CUresult r = ready()) return r;
    if (!desc || count == 0) return INVALID_VALUE;
    bool grant = false;
    for (size_t i = 0; i < count; ++i) {
        if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id >= kDevices) return INVALID_VALUE;
        if (desc[i].flags != 0 && desc[i].flags != 3) return INVALID_VALUE;
        grant = grant || desc[i].flags == 3;
    }
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto* r = g_mem.find(d);
    if (!r || r->second.kind != Kind::Reserved) return INVALID_VALUE;
    Region& region = r->second;
    size_t at = d - r->first, end = at;
    // The range must be mapped throughout, in whole pieces.
    auto it = region.pieces.find(at);
    auto first = it;
    while (it != region.pieces.end() && it->first == end && end < at + bytes) end += (it++)->second.bytes;
    if (first == region.pieces.end() || end != at + bytes) return INVALID_VALUE;
    for (auto p = first; p != it; ++p) p->second.accessible = grant;
    return SUCCESS;
}

// ---- IPC -------------------------------------------------------------------------------------

// The handle of the cuMemAlloc allocation holding `d` (its base or any address inside: UCX's
// cuda_ipc asks with the address it sends from and finds the base with cuMemGetAddressRange);
// memory opened from another process's handle, or mapped by VMM, has none.
CUresult cuIpcGetMemHandle(void* handle, CUdeviceptr d) {
    if (CUresult r = ready()) return r;
    if (!handle) return INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mem.lock);
    auto* it = g_mem.find(d);
    if (!it || it->second.kind != Kind::Alloc) return INVALID_VALUE;
    IpcHandle h{};
    h.magic = kIpcMagic;
    h.pid = getpid();
    h.start_time = start_time(h.pid);
    h.fd = it->second.backing->fd;
    h.device = it->second.device;
    h.serial = it->second.backing->serial;
    h.bytes = it->second.bytes;
    memcpy(handle, &h, sizeof h);
    return SUCCESS;
}

// Maps another process's allocation. The exporter must still run (its memfd is opened through
// /proc); a handle opened again in this process returns the same address, counted.
struct RawIpcHandle {
    char reserved[64];
};

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* out, RawIpcHandle raw, unsigned int flags) {
    if (CUresult r = ready()) return r;
    IpcHandle h;
    memcpy(&h, &raw, sizeof h);
    if (!out || flags != 1) return INVALID_VALUE;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    if (h.magic != kIpcMagic || h.bytes == 0) return INVALID_HANDLE;
    if (h.pid == getpid()) return INVALID_CONTEXT;  // the driver refuses the exporting process
    IpcKey key{h.pid, h.start_time, h.serial};
    {
        std::lock_guard<std::mutex> g(g_mem.lock);
        if (g_mem.reopen(key, out)) return SUCCESS;
    }
    // The exporter is gone (or its pid now names another process), or freed the allocation.
    std::string link = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
    if (start_time(h.pid) != h.start_time || memfd_serial(link) != h.serial) return INVALID_HANDLE;
    int fd = open(link.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_HANDLE;
    auto backing = adopt_backing(fd);
    if (!backing || backing->serial != h.serial || backing->bytes < h.bytes) {
        if (!backing) close(fd);
        return INVALID_HANDLE;
    }
    size_t rounded = round_up(h.bytes, kAllocAlign);
    void* host = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) return MAPPING_FAILED;
    std::lock_guard<std::mutex> g(g_mem.lock);
    CUdeviceptr d = g_mem.reopen(key, out) ? 0 : g_mem.take_range(rounded, kAllocAlign);
    if (!d) {
        munmap(host, rounded);
        return *out ? SUCCESS : OUT_OF_MEMORY;  // another thread opened it meanwhile
    }
    g_mem.regions[d] = Region{Kind::Ipc, size_t(h.bytes), static_cast<uint8_t*>(host), current_device(), backing, {}, 1, key};
    *out = d;
    // Who opened whose memory, for tests that must know which process mapped which (UCX's
    // cuda_ipc maps its peer's buffers; a sidecar agent maps its engine's pool).
    const char* trace = getenv("KVFERRY_CUDA_EMU_TRACE");
    if (trace && strstr(trace, "ipc"))
        fprintf(stderr, "kvferry CUDA emulator: process %d opened an IPC handle of process %d (%llu bytes)\n",
                int(getpid()), int(h.pid), static_cast<unsigned long long>(h.bytes));
    return SUCCESS;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr d) {
    if (CUresult r = ready()) return r;
    synchronize_device();
    return g_mem.drop(d, Kind::Ipc);
}

}  // extern "C"
