// A stand-in CUDA driver (`libcuda.so`) for testing the CUDA executor's plumbing on a machine
// without a GPU (tests/cuda_fake_driver.rs). It implements the driver calls the executor and
// cudarc make, on host memory, strictly:
// - every copy, memset and free must fall inside (or name) a live allocation of the right
//   kind, otherwise CUDA_ERROR_INVALID_VALUE, so out-of-bounds or stale pointers fail loudly;
// - calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is current on
//   the calling thread;
// - work is asynchronous as on a GPU: copies, memsets, launches and event records are queued
//   on their stream and run only when something waits for them (a stream, context or event
//   synchronisation, a copy into pageable host memory, a free). A caller that reads pinned
//   memory, or reuses an input, before waiting sees what a GPU would give it: stale data.
//   Pageable sources are staged at enqueue, as the driver does.
// - each stream has a queue of its own, and a happens-before race checker watches them
//   (streams.h: scheduling modes, vector clocks, race reports).
// - device memory is POSIX shared memory (one object per cuMemAlloc, unlinked on cuMemFree),
//   so that CUDA IPC is real: cuIpcGetMemHandle names the object, and cuIpcOpenMemHandle in
//   another process maps the same bytes. As on CUDA, a handle cannot be opened in the process
//   that exported it (CUDA_ERROR_INVALID_CONTEXT), an opened mapping is closed with
//   cuIpcCloseMemHandle (cuMemFree refuses it), and an exporter's cuMemFree does not unmap
//   the importers' mappings.
// "Modules" are not CUBINs: an image is the text `CPHEMU1\n<host library>\n<entry>\n<sizes>\n`
// naming a kernel render compiled for the host emulator (cuda_emu.h) and its parameter sizes;
// cuLaunchKernel runs it through the emulator's launch entry.

#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct FakeCtx* CUcontext;
typedef struct FakeStream* CUstream;
typedef struct FakeEvent* CUevent;
typedef struct FakeModule* CUmodule;
typedef struct FakeFunction* CUfunction;

enum : CUresult {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  INVALID_DEVICE = 101,
  INVALID_IMAGE = 200,
  INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400,
  NOT_FOUND = 500,
  NOT_READY = 600,
  LAUNCH_TIMEOUT = 702,
  LAUNCH_FAILED = 719,
  NOT_SUPPORTED = 801,
};

// Mirrors CpEmuLaunch in templates/cuda_emu.h (ABI version 1).
struct CpEmuLaunch {
  uint32_t abi_version;
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t dyn_shared_bytes;
  uint32_t flags;
  uint32_t num_params;
  uint64_t stack_bytes;
  const uint64_t* param_sizes;
  char* err_buf;
  uint64_t err_cap;
};
typedef int (*EmuEntry)(const CpEmuLaunch*, void**);

struct FakeCtx {
  int device;
};
struct FakeStream {
  int alive;
  int priority;  // 0, or negative for a stream made at a greater priority
  unsigned long long waits;  // cuStreamWaitEvent calls issued on it (a test hook reads it)
  uint32_t slot;  // its queue and clock (streams.h)
};
// What processes share of an interprocess event (CU_EVENT_INTERPROCESS), in a shared-memory
// object: how many times its owner has recorded it, and how many of those have run.
struct IpcEventState {
  std::atomic<uint64_t> recorded;
  std::atomic<uint64_t> completed;
};
struct FakeEvent {
  double seconds;
  bool recorded;
  CUstream stream;  // where it was last recorded
  uint32_t slot = 0;  // the recording's stream slot and work id (0: never recorded)
  uint64_t id = 0;
  std::vector<uint64_t> clock;  // the recording stream's vector clock then
  // Interprocess: the shared state (null for a plain event), its object's serial, and
  // whether this process opened another's handle (it may only wait on it then).
  IpcEventState* ipc = nullptr;
  uint64_t ipc_serial = 0;
  bool imported = false;
};
struct FakeModule {
  void* lib;
  std::string entry;
  std::vector<uint64_t> sizes;
};
struct FakeFunction {
  FakeModule* module;
  EmuEntry entry;
};

namespace {
enum Kind { DEVICE, HOST };
struct Alloc {
  size_t len;
  Kind kind;
  size_t map_len = 0;     // device memory: the shared-memory mapping's length
  uint64_t serial = 0;    // device memory of this process: names its shared-memory object
  bool imported = false;  // opened from another process's IPC handle
  int opens = 0;          // imported: cuIpcOpenMemHandle calls not yet closed
  uint64_t ipc_key = 0;   // imported: the exporter's (pid << 32 | serial)
};
std::mutex g_mu;
std::map<uintptr_t, Alloc> g_allocs;
bool g_init = false;
FakeCtx g_primary{0};
int g_primary_refs = 0;
thread_local CUcontext t_current = nullptr;
// The first error queued work met (sticky, like a fault).
CUresult g_sticky = OK;
}  // namespace

#include "streams.h"

uint32_t sched::slot_of(CUstream h) {
  // 0 is the legacy default stream; 1 and 2 (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are
  // taken as it too.
  return (uintptr_t)h <= 2 ? sched::LEGACY : h->slot;
}

namespace {
// Runs every queued piece of work (frees, unloads: nothing may touch memory after it goes);
// returns the sticky error, if any. The host's clock does not move: a free must still be
// ordered after the work by the program itself (the checker reports it otherwise).
CUresult flush() { return sched::drive({}, true, &g_sticky); }

// Runs the work a wait on stream `s` needs, then the host has seen all of it.
CUresult sync_stream(CUstream s) {
  auto& state = sched::st();
  uint32_t slot = sched::slot_of(s);
  uint64_t last;
  {
    std::lock_guard<std::mutex> g(state.mu);
    last = state.queues[slot].last;
  }
  CUresult r = sched::drive({{slot, last}}, false, &g_sticky);
  std::lock_guard<std::mutex> g(state.mu);
  state.host.join(state.queues[slot].clock);
  return r;
}

using Accesses = std::vector<sched::Access>;
sched::Access reads(uintptr_t a, size_t n) { return {a, n, false, false}; }
sched::Access writes(uintptr_t a, size_t n) { return {a, n, true, false}; }

// Queues `op` on stream `s` with the bytes it reads and writes.
uint64_t queue_work(CUstream s, std::function<CUresult()> op, Accesses accesses, std::string what) {
  return sched::enqueue(s, std::move(op), accesses, std::move(what));
}

// Accesses a launch declared (fake_cuda_declare_accesses), for the next launch of this thread.
thread_local Accesses t_declared;
thread_local bool t_has_declared = false;

// The allocation [addr, addr + len) lies in, if any, of kind `kind` (or any kind when < 0).
bool inside(uintptr_t addr, size_t len, int kind) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.upper_bound(addr);
  if (it == g_allocs.begin()) return false;
  --it;
  if (kind >= 0 && it->second.kind != kind) return false;
  return addr >= it->first && addr + len <= it->first + it->second.len && addr + len >= addr;
}

CUresult need_ctx() { return t_current ? OK : INVALID_CONTEXT; }

uint64_t g_next_serial = 1;

// The shared-memory object behind device allocation `serial` of process `pid`.
std::string shm_name(uint64_t pid, uint64_t serial) {
  return "/fake-cuda-" + std::to_string(pid) + "-" + std::to_string(serial);
}

size_t page_round(size_t len) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return (len + page - 1) / page * page;
}

// A CUipcMemHandle of the stand-in: which process's which allocation, and its size.
struct IpcHandle {
  char magic[8];  // "FAKEIPC\0"
  uint64_t pid;
  uint64_t serial;
  uint64_t len;
  char unused[32];
};
static_assert(sizeof(IpcHandle) == 64, "a CUipcMemHandle is 64 bytes");
struct CUipcMemHandle_st {
  char reserved[64];
};

double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

CUresult alloc(size_t len, Kind kind, void** out) {
  if (!g_init) return NOT_INITIALIZED;
  if (need_ctx()) return INVALID_CONTEXT;
  if (len == 0) return INVALID_VALUE;
  if (kind == HOST) {
    void* p = aligned_alloc(256, (len + 255) / 256 * 256);
    if (!p) return OUT_OF_MEMORY;
    {
      std::lock_guard<std::mutex> g(sched::st().mu);
      sched::forget((uintptr_t)p, (uintptr_t)p + len, false, "");
    }
    std::lock_guard<std::mutex> g(g_mu);
    g_allocs[(uintptr_t)p] = Alloc{len, kind};
    *out = p;
    return OK;
  }
  // Device memory: a shared-memory object, so that another process can open its IPC handle.
  std::lock_guard<std::mutex> g(g_mu);
  uint64_t serial = g_next_serial++;
  std::string name = shm_name((uint64_t)getpid(), serial);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return OUT_OF_MEMORY;
  size_t map_len = page_round(len);
  void* p = MAP_FAILED;
  if (ftruncate(fd, (off_t)map_len) == 0) {
    p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return OUT_OF_MEMORY;
  }
  Alloc a{len, kind};
  a.map_len = map_len;
  a.serial = serial;
  g_allocs[(uintptr_t)p] = a;
  {
    std::lock_guard<std::mutex> s(sched::st().mu);
    sched::forget((uintptr_t)p, (uintptr_t)p + len, false, "");
  }
  *out = p;
  return OK;
}

CUresult release(uintptr_t p, Kind kind) {
  if (need_ctx()) return INVALID_CONTEXT;
  flush();  // frees wait for the work that may still use the memory
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.find(p);
  // Another process's memory is closed with cuIpcCloseMemHandle, never freed.
  if (it == g_allocs.end() || it->second.kind != kind || it->second.imported) {
    return INVALID_VALUE;
  }
  Alloc a = it->second;
  g_allocs.erase(it);
  {
    // A free is the host writing the memory: everything that used it must be ordered first.
    std::lock_guard<std::mutex> s(sched::st().mu);
    sched::forget(p, p + a.len, true, kind == HOST ? "cuMemFreeHost" : "cuMemFree");
  }
  if (kind == HOST) {
    free((void*)p);
  } else {
    // Importers' mappings outlive the name, as a peer's mapping outlives cuMemFree.
    munmap((void*)p, a.map_len);
    shm_unlink(shm_name((uint64_t)getpid(), a.serial).c_str());
  }
  return OK;
}
}  // namespace

extern "C" {

CUresult cuGetErrorString(CUresult e, const char** s) {
  static const char* names[] = {"fake driver: error"};
  *s = names[0];
  (void)e;
  return OK;
}
CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

CUresult cuInit(unsigned flags) {
  if (flags != 0) return INVALID_VALUE;
  // Test hook: act as another library would (34 = the toolkit's stub libcuda).
  if (const char* r = getenv("FAKE_CUDA_INIT_RESULT")) return atoi(r);
  g_init = true;
  return OK;
}
CUresult cuDriverGetVersion(int* v) {
  *v = 12080;
  return OK;
}
CUresult cuDeviceGetCount(int* n) {
  if (!g_init) return NOT_INITIALIZED;
  *n = 1;
  return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (!g_init) return NOT_INITIALIZED;
  if (ordinal != 0) return INVALID_DEVICE;
  *d = 0;
  return OK;
}
// Test hook: FAKE_CUDA_PCI_BUS_ID (default 0000:00:00.0).
CUresult cuDeviceGetPCIBusId(char* id, int len, CUdevice d) {
  if (d != 0) return INVALID_DEVICE;
  if (!id || len <= 0) return INVALID_VALUE;
  const char* b = getenv("FAKE_CUDA_PCI_BUS_ID");
  snprintf(id, (size_t)len, "%s", b ? b : "0000:00:00.0");
  return OK;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
  if (d != 0) return INVALID_DEVICE;
  snprintf(name, (size_t)len, "Fake H200 (cp-hicache test driver)");
  return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attrib, CUdevice d) {
  if (d != 0) return INVALID_DEVICE;
  // Test hook: FAKE_CUDA_CC="major.minor" (default 9.0, an H200).
  int major = 9, minor = 0;
  if (const char* cc = getenv("FAKE_CUDA_CC")) sscanf(cc, "%d.%d", &major, &minor);
  switch (attrib) {
    case 75: *v = major; break;  // COMPUTE_CAPABILITY_MAJOR
    case 76: *v = minor; break;  // COMPUTE_CAPABILITY_MINOR
    case 16: *v = 132; break;  // MULTIPROCESSOR_COUNT
    case 115: *v = 1; break;  // MEMORY_POOLS_SUPPORTED
    default: *v = 0;
  }
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (!g_init) return NOT_INITIALIZED;
  if (d != 0) return INVALID_DEVICE;
  g_primary_refs++;
  *c = &g_primary;
  return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  if (d != 0 || g_primary_refs == 0) return INVALID_VALUE;
  g_primary_refs--;
  return OK;
}
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = t_current;
  return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  if (c && c != &g_primary) return INVALID_CONTEXT;
  t_current = c;
  return OK;
}
CUresult cuCtxSynchronize(void) {
  if (need_ctx()) return INVALID_CONTEXT;
  auto& state = sched::st();
  state.ctx_syncs++;
  CUresult r = flush();
  std::lock_guard<std::mutex> g(state.mu);
  for (auto& q : state.queues) state.host.join(q.clock);
  return r;
}

// cuStreamWaitEvent calls ordering one stream after another's event (a test hook reads it).
std::atomic<unsigned long long> g_cross_waits{0};

// Work (launches and copies) enqueued on a stream of greater priority, waits issued on one,
// and waits on another stream for an event last recorded on one (test hooks read them).
std::atomic<unsigned long long> g_prioritised_work{0};
std::atomic<unsigned long long> g_waits_on_prioritised{0};
std::atomic<unsigned long long> g_waits_for_prioritised{0};
// cuEventCreate calls (a test hook reads it: pooled events keep it constant).
std::atomic<unsigned long long> g_events_created{0};
// cuStreamWaitEvent calls still to refuse (fake_cuda_fail_stream_waits): a wait that the
// device could not take, for the paths that must then order another way.
std::atomic<int> g_fail_waits{0};

void count_work(CUstream s) {
  if (s && s->priority < 0) g_prioritised_work++;
}

CUresult cuStreamCreate(CUstream* s, unsigned flags) {
  if (need_ctx()) return INVALID_CONTEXT;
  *s = new FakeStream{1, 0, 0, sched::add_stream(0, !(flags & 1))};
  return OK;
}
// As on current GPUs: priorities 0 (least) to -5 (greatest).
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return OK;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int priority) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (priority < -5 || priority > 0) return INVALID_VALUE;
  *s = new FakeStream{1, priority, 0, sched::add_stream(priority, !(flags & 1))};
  return OK;
}
CUresult cuStreamDestroy_v2(CUstream s) {
  if (!s || !s->alive) return INVALID_HANDLE;
  // The stream's work still runs (as on a GPU), before its queue goes.
  flush();
  {
    auto& state = sched::st();
    std::lock_guard<std::mutex> g(state.mu);
    state.queues[s->slot].alive = false;
  }
  s->alive = 0;
  delete s;
  return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
  if ((uintptr_t)s > 2 && !s->alive) return INVALID_HANDLE;
  return need_ctx() ? INVALID_CONTEXT : sync_stream(s);
}

// An interprocess event's shared object: "/fake-cuda-ev-<pid>-<serial>".
std::string ipc_event_name(uint64_t pid, uint64_t serial) {
  return "/fake-cuda-ev-" + std::to_string(pid) + "-" + std::to_string(serial);
}
// Maps an interprocess event's shared object (creating it when `create`), or null.
IpcEventState* map_ipc_event(const std::string& name, bool create) {
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  void* p = MAP_FAILED;
  if (!create || ftruncate(fd, (off_t)sizeof(IpcEventState)) == 0) {
    p = mmap(nullptr, sizeof(IpcEventState), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return nullptr;
  }
  return (IpcEventState*)p;
}
std::atomic<unsigned long long> g_ipc_event_waits{0};
// Host waits on another process's event (cuEventSynchronize): the fence's fallback.
std::atomic<unsigned long long> g_ipc_event_syncs{0};
// cuStreamWaitEvent calls on another process's event still to refuse
// (fake_cuda_fail_ipc_waits), leaving this process's own waits alone.
std::atomic<int> g_fail_ipc_waits{0};
// The distinct interprocess events (as opened here) a stream has waited on, under g_mu.
std::set<const void*> g_ipc_waited;
// Which cuIpcOpenEventHandle call from now is refused (fake_cuda_fail_ipc_event_open_at):
// 0 the next one, -1 none. A peer's event that will not open, for start-up's failure path.
std::atomic<int> g_fail_ipc_open_at{-1};
// Interprocess events of this process (created here, or another process's opened here) not
// yet destroyed: what a failed start-up must give back.
std::atomic<long long> g_live_ipc_events{0};

CUresult cuEventCreate(CUevent* e, unsigned flags) {
  if (need_ctx()) return INVALID_CONTEXT;
  constexpr unsigned DISABLE_TIMING = 0x2, INTERPROCESS = 0x4;
  // As on CUDA: an interprocess event must not take timing.
  if ((flags & INTERPROCESS) && !(flags & DISABLE_TIMING)) return INVALID_VALUE;
  auto* ev = new FakeEvent{0.0, false, nullptr};
  if (flags & INTERPROCESS) {
    {
      std::lock_guard<std::mutex> g(g_mu);
      ev->ipc_serial = g_next_serial++;
    }
    ev->ipc = map_ipc_event(ipc_event_name((uint64_t)getpid(), ev->ipc_serial), true);
    if (!ev->ipc) {
      delete ev;
      return OUT_OF_MEMORY;
    }
    g_live_ipc_events++;
  }
  g_events_created++;
  *e = ev;
  return OK;
}
// A CUipcEventHandle of the stand-in: which process's which event.
struct CUipcEventHandle_st {
  char reserved[64];
};
CUresult cuIpcGetEventHandle(CUipcEventHandle_st* handle, CUevent e) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!handle || !e || !e->ipc || e->imported) return INVALID_HANDLE;
  IpcHandle h{};
  memcpy(h.magic, "FAKEEVT", 8);
  h.pid = (uint64_t)getpid();
  h.serial = e->ipc_serial;
  memcpy(handle->reserved, &h, sizeof h);
  return OK;
}
CUresult cuIpcOpenEventHandle(CUevent* e, CUipcEventHandle_st handle) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!e) return INVALID_VALUE;
  IpcHandle h;
  memcpy(&h, handle.reserved, sizeof h);
  if (memcmp(h.magic, "FAKEEVT", 8) != 0) return INVALID_VALUE;
  // As for memory: a handle is for another process.
  if (h.pid == (uint64_t)getpid()) return INVALID_CONTEXT;
  // A refusal the test asked for: as for a handle whose event is gone.
  for (int k = g_fail_ipc_open_at.load(); k >= 0;) {
    if (g_fail_ipc_open_at.compare_exchange_weak(k, k - 1)) {
      if (k == 0) return INVALID_VALUE;
      break;
    }
  }
  IpcEventState* st = map_ipc_event(ipc_event_name(h.pid, h.serial), false);
  if (!st) return INVALID_VALUE;
  auto* ev = new FakeEvent{0.0, false, nullptr};
  ev->ipc = st;
  ev->imported = true;
  g_live_ipc_events++;
  *e = ev;
  return OK;
}
// Waits on the host until the owner's recording `target` of an interprocess event has run.
CUresult wait_ipc(IpcEventState* st, uint64_t target) {
  for (int i = 0; st->completed.load() < target; ++i) {
    if (i == 60000) {
      fprintf(stderr, "fake libcuda: an interprocess event's recording %llu never ran (60 s)\n",
              (unsigned long long)target);
      return LAUNCH_TIMEOUT;
    }
    usleep(1000);
  }
  return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  if (!e || ((uintptr_t)s > 2 && !s->alive)) return INVALID_HANDLE;
  if (e->imported) return INVALID_HANDLE;  // only its owner records an interprocess event
  e->recorded = false;
  e->stream = s;
  sched::Clock clock;
  uint64_t id = sched::enqueue(
      s,
      [e]() {
        e->seconds = now();
        e->recorded = true;
        return OK;
      },
      {}, "cuEventRecord", &clock, &e->slot);
  e->id = id;
  e->clock = clock.v;
  if (e->ipc) {
    // Another process may wait for this recording, and this process's queues run only when
    // something here waits: the work up to the recording runs now (later work stays
    // queued, so a recording made before the work it should cover still shows).
    uint64_t seq = e->ipc->recorded.fetch_add(1) + 1;
    CUresult r = sched::drive({{e->slot, id}}, false, &g_sticky);
    if (r != OK) return r;
    uint64_t done = e->ipc->completed.load();
    while (done < seq && !e->ipc->completed.compare_exchange_weak(done, seq)) {
    }
  }
  return OK;
}
// Whether the event's last recording has run (a never-recorded event counts as complete).
bool event_reached(CUevent e) {
  auto& state = sched::st();
  std::lock_guard<std::mutex> g(state.mu);
  return e->id == 0 || sched::ran(state, e->slot, e->id);
}
// The host has seen the event's recording complete: what came before it is ordered before
// everything the host does from now on.
void host_saw(CUevent e) {
  auto& state = sched::st();
  std::lock_guard<std::mutex> g(state.mu);
  state.host.join(sched::Clock{e->clock});
}
CUresult cuEventSynchronize(CUevent e) {
  if (!e) return INVALID_HANDLE;
  if (e->imported) {
    g_ipc_event_syncs++;
    return wait_ipc(e->ipc, e->ipc->recorded.load());
  }
  CUresult r = g_sticky;
  if (e->id != 0) r = sched::drive({{e->slot, e->id}}, false, &g_sticky);
  host_saw(e);
  return r;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!e || ((uintptr_t)s > 2 && !s->alive) || flags != 0) return INVALID_HANDLE;
  // Refused with no effect: nothing enqueued on `s` waits for the event.
  for (int left = g_fail_waits.load(); left > 0;) {
    if (g_fail_waits.compare_exchange_weak(left, left - 1)) return NOT_SUPPORTED;
  }
  if (e->imported) {
    for (int left = g_fail_ipc_waits.load(); left > 0;) {
      if (g_fail_ipc_waits.compare_exchange_weak(left, left - 1)) return NOT_SUPPORTED;
    }
    // Another process's event: work enqueued on `s` from now on runs after the owner's
    // recordings so far have run.
    g_ipc_event_waits++;
    {
      std::lock_guard<std::mutex> g(g_mu);
      g_ipc_waited.insert(e->ipc);
    }
    if ((uintptr_t)s > 2) s->waits++;
    IpcEventState* st = e->ipc;
    uint64_t target = st->recorded.load();
    sched::enqueue(s, [st, target]() { return wait_ipc(st, target); }, {},
                   "cuStreamWaitEvent (another process's event)");
    return OK;
  }
  if (e->stream != s) g_cross_waits++;
  bool real = (uintptr_t)s > 2;
  if (real) s->waits++;
  if (real && s->priority < 0) g_waits_on_prioritised++;
  if ((uintptr_t)e->stream > 2 && e->stream->priority < 0 && e->stream != s) {
    g_waits_for_prioritised++;
  }
  // Work enqueued on `s` from now on waits for the event's recording (if it was recorded).
  if (e->id != 0) sched::wait_for(s, e->slot, e->id, sched::Clock{e->clock});
  return OK;
}
// A query does not make the stream progress: like a GPU that is behind, an event stays
// NOT_READY until something waits for the work before it.
CUresult cuEventQuery(CUevent e) {
  if (!e) return INVALID_HANDLE;
  if (e->imported) return e->ipc->completed.load() >= e->ipc->recorded.load() ? OK : NOT_READY;
  if (g_sticky != OK) return g_sticky;
  if (!event_reached(e)) return NOT_READY;
  host_saw(e);
  return OK;
}
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  // Like the driver: both events must have completed (the caller waits on them first).
  if (!a || !b || !a->recorded || !b->recorded) return INVALID_HANDLE;
  *ms = (float)((b->seconds - a->seconds) * 1e3);
  return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }
CUresult cuEventDestroy_v2(CUevent e) {
  if (!e) return INVALID_HANDLE;
  flush();
  if (e->ipc) {
    g_live_ipc_events--;
    munmap(e->ipc, sizeof(IpcEventState));
    if (!e->imported) shm_unlink(ipc_event_name((uint64_t)getpid(), e->ipc_serial).c_str());
  }
  delete e;
  return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t len) {
  void* out = nullptr;
  CUresult r = alloc(len, DEVICE, &out);
  if (r == OK) *p = (CUdeviceptr)(uintptr_t)out;
  return r;
}
CUresult cuMemFree_v2(CUdeviceptr p) { return release((uintptr_t)p, DEVICE); }
CUresult cuMemHostAlloc(void** p, size_t len, unsigned flags) {
  if (!(flags & 0x02)) return INVALID_VALUE;  // the executor maps host pools: DEVICEMAP
  return alloc(len, HOST, p);
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
  if (flags != 0 || !inside((uintptr_t)p, 1, HOST)) return INVALID_VALUE;
  *d = (CUdeviceptr)(uintptr_t)p;
  return OK;
}
CUresult cuMemFreeHost(void* p) { return release((uintptr_t)p, HOST); }

CUresult cuIpcGetMemHandle(CUipcMemHandle_st* handle, CUdeviceptr d) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!handle) return INVALID_VALUE;
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.find((uintptr_t)d);
  // The base of a device allocation of this process (not one opened from a peer).
  if (it == g_allocs.end() || it->second.kind != DEVICE || it->second.imported) {
    return INVALID_VALUE;
  }
  IpcHandle h{};
  memcpy(h.magic, "FAKEIPC", 8);
  h.pid = (uint64_t)getpid();
  h.serial = it->second.serial;
  h.len = it->second.len;
  memcpy(handle->reserved, &h, sizeof h);
  return OK;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* d, CUipcMemHandle_st handle, unsigned flags) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!d || flags != 1) return INVALID_VALUE;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
  IpcHandle h;
  memcpy(&h, handle.reserved, sizeof h);
  if (memcmp(h.magic, "FAKEIPC", 8) != 0 || h.len == 0) return INVALID_VALUE;
  // As on CUDA: the exporting process cannot open its own handle.
  if (h.pid == (uint64_t)getpid()) return INVALID_CONTEXT;
  std::lock_guard<std::mutex> g(g_mu);
  uint64_t key = h.pid << 32 | h.serial;
  for (auto& [addr, a] : g_allocs) {
    if (a.imported && a.ipc_key == key) {
      // Opened again: the same mapping, counted (closed once per open).
      a.opens++;
      *d = (CUdeviceptr)addr;
      return OK;
    }
  }
  int fd = shm_open(shm_name(h.pid, h.serial).c_str(), O_RDWR, 0);
  if (fd < 0) return INVALID_HANDLE;  // freed by its owner, or never made
  struct stat st;
  size_t map_len = page_round(h.len);
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size >= map_len) {
    p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (p == MAP_FAILED) return INVALID_HANDLE;
  Alloc a{h.len, DEVICE};
  a.map_len = map_len;
  a.imported = true;
  a.opens = 1;
  a.ipc_key = key;
  g_allocs[(uintptr_t)p] = a;
  *d = (CUdeviceptr)(uintptr_t)p;
  return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr d) {
  if (need_ctx()) return INVALID_CONTEXT;
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.upper_bound((uintptr_t)d);
  if (it == g_allocs.begin()) return NOT_FOUND;
  --it;
  if (it->second.kind != DEVICE || (uintptr_t)d >= it->first + it->second.len) return NOT_FOUND;
  if (base) *base = (CUdeviceptr)it->first;
  if (size) *size = it->second.len;
  return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr d) {
  if (need_ctx()) return INVALID_CONTEXT;
  flush();  // work queued on the mapping runs before it goes
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.find((uintptr_t)d);
  if (it == g_allocs.end() || !it->second.imported) return INVALID_VALUE;
  if (--it->second.opens > 0) return OK;
  {
    std::lock_guard<std::mutex> s(sched::st().mu);
    sched::forget((uintptr_t)d, (uintptr_t)d + it->second.len, true, "cuIpcCloseMemHandle");
  }
  munmap((void*)d, it->second.map_len);
  g_allocs.erase(it);
  return OK;
}

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
  if (need_ctx() || !inside((uintptr_t)d, n, DEVICE)) return INVALID_VALUE;
  queue_work(
      s,
      [d, v, n] {
        memset((void*)(uintptr_t)d, v, n);
        return OK;
      },
      {writes(d, n)}, "cuMemsetD8Async " + std::to_string(n) + " B");
  return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* src, size_t n, CUstream s) {
  if (need_ctx() || !inside((uintptr_t)d, n, DEVICE)) return INVALID_VALUE;
  count_work(s);
  if (inside((uintptr_t)src, n, HOST)) {
    // Pinned source: read by DMA when the copy runs, so overwriting it before then is a bug
    // that shows as wrong bytes on the device.
    queue_work(
        s,
        [d, src, n] {
          memcpy((void*)(uintptr_t)d, src, n);
          return OK;
        },
        {reads((uintptr_t)src, n), writes(d, n)},
        "cuMemcpyHtoDAsync " + std::to_string(n) + " B from pinned memory");
    return OK;
  }
  // Pageable source: staged now, so the caller may reuse it when this returns.
  auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                              (const unsigned char*)src + n);
  queue_work(
      s,
      [d, staged] {
        memcpy((void*)(uintptr_t)d, staged->data(), staged->size());
        return OK;
      },
      {writes(d, n)}, "cuMemcpyHtoDAsync " + std::to_string(n) + " B");
  return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr s, size_t n, CUstream st) {
  if (need_ctx() || !inside((uintptr_t)s, n, DEVICE)) return INVALID_VALUE;
  // Pageable destination: the copy runs after the stream's earlier work and completes before
  // this returns (the host has then seen the stream up to it).
  auto out = std::make_shared<CUresult>(OK);
  queue_work(
      st,
      [dst, s, n] {
        memcpy(dst, (const void*)(uintptr_t)s, n);
        return OK;
      },
      {reads(s, n)}, "cuMemcpyDtoHAsync " + std::to_string(n) + " B to pageable memory");
  return sync_stream(st);
}
// cuMemcpyAsync calls so far (test hook below): the executor issues one per merged region
// where it does not batch.
std::atomic<unsigned long long> g_copy_calls{0};
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  if (need_ctx() || !inside((uintptr_t)d, n, -1) || !inside((uintptr_t)s, n, -1)) {
    return INVALID_VALUE;
  }
  ++g_copy_calls;
  count_work(st);
  queue_work(
      st,
      [d, s, n] {
        memmove((void*)(uintptr_t)d, (const void*)(uintptr_t)s, n);
        return OK;
      },
      {reads(s, n), writes(d, n)}, "cuMemcpyAsync " + std::to_string(n) + " B");
  return OK;
}

// cuMemcpyBatchAsync (CUDA 12.8): built without it under -DFAKE_CUDA_NO_BATCH, so the
// executor's per-region fallback runs against a driver that lacks the symbol. Every range is
// checked before any copy is queued (a bad batch queues nothing; *fail_idx names the copy).
#ifndef FAKE_CUDA_NO_BATCH
struct CUmemLocation_fake { int type; int id; };
struct CUmemcpyAttributes_fake {
  int src_access_order;
  CUmemLocation_fake src_loc, dst_loc;
  unsigned flags;
};
unsigned long long g_batch_calls = 0;
unsigned long long g_batch_refusals = 0;
CUresult cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                            CUmemcpyAttributes_fake* attrs, size_t* attr_idxs, size_t num_attrs,
                            size_t* fail_idx, CUstream st) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attr_idxs || num_attrs == 0 ||
      num_attrs > count || attr_idxs[0] != 0 || attrs[0].src_access_order == 0) {
    return INVALID_VALUE;
  }
  // A platform without batched copies for these memory kinds: the whole batch is refused,
  // no copy named, nothing queued (set by a test).
  const char* unsupported = getenv("FAKE_CUDA_BATCH_NOT_SUPPORTED");
  if (unsupported && unsupported[0] == '1') {
    g_batch_refusals++;
    if (fail_idx) *fail_idx = SIZE_MAX;
    return NOT_SUPPORTED;
  }
  for (size_t i = 0; i < count; ++i) {
    if (!inside((uintptr_t)dsts[i], sizes[i], -1) || !inside((uintptr_t)srcs[i], sizes[i], -1)) {
      if (fail_idx) *fail_idx = i;
      return INVALID_VALUE;
    }
  }
  for (size_t i = 0; i < count; ++i) {
    CUdeviceptr d = dsts[i], s = srcs[i];
    size_t n = sizes[i];
    queue_work(
        st,
        [d, s, n] {
          memmove((void*)(uintptr_t)d, (const void*)(uintptr_t)s, n);
          return OK;
        },
        {reads(s, n), writes(d, n)},
        "cuMemcpyBatchAsync copy " + std::to_string(i) + " of " + std::to_string(count) + ", " +
            std::to_string(n) + " B");
  }
  ++g_batch_calls;
  count_work(st);
  return OK;
}
#endif

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  if (need_ctx()) return INVALID_CONTEXT;
  const char* text = (const char*)image;
  if (strncmp(text, "CPHEMU1\n", 8) != 0) return INVALID_IMAGE;
  std::istringstream in(text + 8);
  std::string path, entry, sizes;
  std::getline(in, path);
  std::getline(in, entry);
  std::getline(in, sizes);
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) return INVALID_IMAGE;
  FakeModule* mod = new FakeModule{lib, entry, {}};
  std::istringstream ss(sizes);
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (!tok.empty()) mod->sizes.push_back(strtoull(tok.c_str(), nullptr, 10));
  }
  *m = mod;
  return OK;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
  if (!m || m->entry != name) return NOT_FOUND;
  std::string sym = std::string(name) + "__emu_launch";
  void* e = dlsym(m->lib, sym.c_str());
  if (!e) return NOT_FOUND;
  *f = new FakeFunction{m, (EmuEntry)e};
  return OK;
}
CUresult cuModuleUnload(CUmodule m) {
  if (!m) return INVALID_HANDLE;
  flush();
  dlclose(m->lib);
  delete m;  // functions of the module are leaked on purpose: handles die with the module
  return OK;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream s, void** params,
                        void** extra) {
  if (need_ctx()) return INVALID_CONTEXT;
  if (!f || extra || (s && !s->alive)) return INVALID_VALUE;
  count_work(s);
  // Parameter values are copied at launch, as the driver does; the kernel runs later.
  const std::vector<uint64_t>& sizes = f->module->sizes;
  auto values = std::make_shared<std::vector<std::vector<unsigned char>>>();
  for (size_t i = 0; i < sizes.size(); ++i) {
    const unsigned char* p = (const unsigned char*)params[i];
    values->emplace_back(p, p + sizes[i]);
  }
  const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  std::vector<unsigned> shape(grid, grid + 3);
  shape.insert(shape.end(), block, block + 3);
  Accesses accesses;
  if (t_has_declared) {
    accesses.swap(t_declared);
    t_has_declared = false;
  } else {
    sched::st().undeclared++;
  }
  queue_work(s, [f, values, shape, shared] {
    char err[4096] = {0};
    std::vector<void*> ptrs;
    for (auto& v : *values) ptrs.push_back(v.data());
    CpEmuLaunch cfg{};
    cfg.abi_version = 1;
    for (int i = 0; i < 3; ++i) cfg.grid[i] = shape[i], cfg.block[i] = shape[3 + i];
    cfg.dyn_shared_bytes = shared;
    cfg.num_params = (uint32_t)f->module->sizes.size();
    cfg.param_sizes = f->module->sizes.data();
    cfg.err_buf = err;
    cfg.err_cap = sizeof err;
    int status = f->entry(&cfg, ptrs.data());
    if (status == 0) return OK;
    fprintf(stderr, "fake libcuda: kernel %s failed (%d): %s\n", f->module->entry.c_str(),
            status, err);
    return LAUNCH_FAILED;
  }, accesses, "cuLaunchKernel " + f->module->entry);
  return OK;
}

}  // extern "C"

// Test hooks (not driver API).

// The accesses of this thread's next cuLaunchKernel, as `n` triples (address, bytes, flags:
// 1 written, 2 sparse: pages reached through page ids, checked against frees only). The CUDA
// executor declares each launch's reaches here when it runs on the stand-in.
extern "C" void fake_cuda_declare_accesses(const uint64_t* triples, size_t n) {
  t_declared.clear();
  for (size_t i = 0; i < n; ++i) {
    const uint64_t* t = triples + 3 * i;
    t_declared.push_back({(uintptr_t)t[0], (size_t)t[1], (t[2] & 1) != 0, (t[2] & 2) != 0});
  }
  t_has_declared = true;
}

// The host is about to read (write) `n` bytes of pinned memory at `p` from the CPU: work that
// touches them and that the host has not seen complete is a race.
extern "C" void fake_cuda_host_access(uint64_t p, uint64_t n, int write) {
  auto& state = sched::st();
  if (!state.check || n == 0) return;
  std::vector<void*> site = sched::capture();
  std::lock_guard<std::mutex> g(state.mu);
  uint64_t id = ++state.next_id;
  state.host.set(sched::HOST, id);
  auto info = std::make_shared<sched::Info>(
      sched::Info{id, sched::HOST, write ? "a CPU write of pinned memory" : "a CPU read of pinned memory",
                  std::move(site)});
  sched::check({(uintptr_t)p, (size_t)n, write != 0, false}, sched::Epoch{sched::HOST, id, info},
               state.host);
}

// Whether the race checker wants launches' accesses (not under FAKE_CUDA_RACES=off).
extern "C" int fake_cuda_checks_races(void) { return sched::st().check ? 1 : 0; }

// Races found so far (see streams.h).
extern "C" unsigned long long fake_cuda_races(void) { return sched::st().races.load(); }

// Races found so far, forgotten: a test that races on purpose takes them, so that the
// process does not exit with status 86 for them.
extern "C" unsigned long long fake_cuda_take_races(void) { return sched::st().races.exchange(0); }

// Launches that declared no accesses (their bytes went unchecked).
extern "C" unsigned long long fake_cuda_undeclared_launches(void) {
  return sched::st().undeclared.load();
}

// cuCtxSynchronize calls so far.
extern "C" unsigned long long fake_cuda_ctx_syncs(void) { return sched::st().ctx_syncs.load(); }

// The scheduling mode in force: 0 eager, 1 lazy, 2 adversarial, 3 random.
extern "C" int fake_cuda_sched_mode(void) { return (int)sched::st().mode; }

namespace {
// A process that raced fails, whatever its tests said.
struct RaceExit {
  ~RaceExit() {
    unsigned long long n = sched::st().races.load();
    if (n > 0) {
      fprintf(stderr, "fake libcuda: %llu race(s) between streams in this process (see above)\n", n);
      fflush(stderr);
      _exit(86);
    }
  }
} g_race_exit;
}  // namespace

// Live allocations, to check that the executor frees everything.
// Batched copy calls so far (0 when built without cuMemcpyBatchAsync).
extern "C" unsigned long long fake_cuda_batch_calls(void) {
#ifndef FAKE_CUDA_NO_BATCH
  return g_batch_calls;
#else
  return 0;
#endif
}

// cuMemcpyBatchAsync calls refused as NOT_SUPPORTED so far.
extern "C" unsigned long long fake_cuda_batch_refusals(void) {
#ifndef FAKE_CUDA_NO_BATCH
  return g_batch_refusals;
#else
  return 0;
#endif
}

// cuStreamWaitEvent calls whose event was recorded on another stream so far.
extern "C" unsigned long long fake_cuda_cross_stream_waits(void) { return g_cross_waits.load(); }

// cuMemcpyAsync calls so far.
extern "C" unsigned long long fake_cuda_copy_calls(void) { return g_copy_calls.load(); }

// Launches and copies enqueued on a stream of greater priority so far.
extern "C" unsigned long long fake_cuda_prioritised_work(void) { return g_prioritised_work.load(); }

// cuStreamWaitEvent calls issued on stream `s` so far (an engine's, handed to the cache).
extern "C" unsigned long long fake_cuda_stream_waits(CUstream s) { return s ? s->waits : 0; }

// cuStreamWaitEvent calls issued on a stream of greater priority so far.
extern "C" unsigned long long fake_cuda_waits_on_prioritised(void) {
  return g_waits_on_prioritised.load();
}

// cuStreamWaitEvent calls issued on another stream for an event recorded on a stream of
// greater priority so far (a consumer waiting for a load's layer).
extern "C" unsigned long long fake_cuda_waits_for_prioritised(void) {
  return g_waits_for_prioritised.load();
}

// cuEventCreate calls so far.
extern "C" unsigned long long fake_cuda_events_created(void) { return g_events_created.load(); }
// Waits enqueued on another process's (interprocess) event.
extern "C" unsigned long long fake_cuda_ipc_event_waits(void) { return g_ipc_event_waits.load(); }
// The next `n` cuStreamWaitEvent calls fail (NOT_SUPPORTED) and order nothing.
extern "C" void fake_cuda_fail_stream_waits(int n) { g_fail_waits.store(n); }
// The next `n` cuStreamWaitEvent calls on another process's event fail (NOT_SUPPORTED).
extern "C" void fake_cuda_fail_ipc_waits(int n) { g_fail_ipc_waits.store(n); }
// The `k`th cuIpcOpenEventHandle call from now (0: the next) fails (INVALID_VALUE); the
// others open as usual. -1 refuses none.
extern "C" void fake_cuda_fail_ipc_event_open_at(int k) { g_fail_ipc_open_at.store(k); }
// Interprocess events created or opened in this process and not yet destroyed.
extern "C" long long fake_cuda_live_ipc_events(void) { return g_live_ipc_events.load(); }
// cuEventSynchronize calls on another process's event so far.
extern "C" unsigned long long fake_cuda_ipc_event_syncs(void) { return g_ipc_event_syncs.load(); }
// The distinct interprocess events of other processes that a stream has waited on so far.
extern "C" unsigned long long fake_cuda_ipc_events_waited(void) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_ipc_waited.size();
}

extern "C" int fake_cuda_live_allocations(void) {
  std::lock_guard<std::mutex> g(g_mu);
  return (int)g_allocs.size();
}
