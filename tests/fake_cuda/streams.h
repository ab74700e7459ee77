// Streams as a GPU may run them, for the stand-in driver (libcuda.cpp includes this once).
//
// Every stream has its own queue. Work on one stream runs in order; across streams only
// events (cuEventRecord + cuStreamWaitEvent), synchronisations and the legacy default
// stream order it. When something waits, the scheduler runs queued work chosen by the mode
// in FAKE_CUDA_SCHED (seeded by FAKE_CUDA_SEED):
// - `eager`: everything queued, in the order it was enqueued (one global queue: the stand-in
//   as it was before streams had queues of their own);
// - `lazy` (the default): only what the wait needs (the waited stream's work up to the point
//   waited for, and whatever that work waits for), in enqueue order;
// - `adversarial`: what the wait needs, the ready stream of lowest priority first, so a
//   stream of greater priority (the cache's load stream) is held back as long as allowed;
// - `random`: any ready work, needed or not, picked at random, until the wait is met.
//
// A happens-before race checker watches every piece of queued work. Each declares the bytes
// it reads and writes: copies and memsets by their ranges, launches through what the
// executor declares (`fake_cuda_declare_accesses`, the reaches of the kernel's signature).
// Each stream carries a vector clock, advanced by its work and joined by waits; the host is
// one more clock, joined by synchronisations (and by a completed cuEventQuery), and work
// enqueued by the host is ordered after what the host has seen. Two accesses of overlapping
// bytes, at least one a write, neither ordered before the other, are a race: reported on
// stderr with both streams and the host call sites that enqueued them (symbolised with
// addr2line), and counted. A free of memory that unordered work still uses is one too.
// FAKE_CUDA_SITES=0 records no call sites; FAKE_CUDA_RACES=off checks nothing (timings of the
// executor's host side only). A
// process that ends with races it did not take (`fake_cuda_take_races`) exits with status 86,
// so a test that raced fails even when its verification passed.
//
// Pages of a pool that a launch reaches through page ids ("sparse" accesses: a page table's
// pointers, page-organised buffers) are not known to the executor: they are checked against
// frees only. Their races show as mismatches under `adversarial`, which verification counts.
//
// The host's clock is one for the whole process: host threads are taken as ordered by time
// (ranks that are threads order themselves through their group, which the driver cannot see).

#include <execinfo.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <random>

namespace sched {

enum Mode { EAGER, LAZY, ADVERSARIAL, RANDOM };

// Clock slots: 0 is the host, 1 the legacy default stream, then one per created stream.
constexpr uint32_t HOST = 0;
constexpr uint32_t LEGACY = 1;

// A vector clock: entry i is the last piece of work of slot i that is ordered before.
// Clock values are global work ids, which increase along every slot.
struct Clock {
  std::vector<uint64_t> v;
  uint64_t at(uint32_t slot) const { return slot < v.size() ? v[slot] : 0; }
  void set(uint32_t slot, uint64_t x) {
    if (v.size() <= slot) v.resize(slot + 1, 0);
    v[slot] = x;
  }
  void join(const Clock& o) {
    if (v.size() < o.v.size()) v.resize(o.v.size(), 0);
    for (size_t i = 0; i < o.v.size(); ++i) v[i] = std::max(v[i], o.v[i]);
  }
};

// What a report says about one piece of work.
struct Info {
  uint64_t id;
  uint32_t slot;
  std::string what;
  std::vector<void*> site;  // return addresses of the host call that enqueued it
};
using InfoRef = std::shared_ptr<const Info>;

// One access of the shadow memory: which work, with its slot and clock value.
struct Epoch {
  uint32_t slot;
  uint64_t clock;
  InfoRef info;
};

struct Access {
  uintptr_t addr;
  size_t len;
  bool write;
  bool sparse;
};

// Work queued on a stream. `deps` are (slot, id) pairs that must have run first (an event
// waited on, the legacy stream's implicit order); `run` is empty for a wait marker.
struct Work {
  uint64_t id;
  std::function<CUresult()> run;
  std::vector<std::pair<uint32_t, uint64_t>> deps;
};

struct Queue {
  int priority = 0;
  bool blocking = false;
  bool alive = true;
  std::deque<Work> work;
  uint64_t done = 0;   // the last id that ran (ids run in order along a stream)
  uint64_t last = 0;   // the last id enqueued
  Clock clock;
};

// Shadow memory: disjoint byte ranges, each with its last write and the reads since.
struct Cell {
  uintptr_t end;
  std::optional<Epoch> write;
  std::vector<Epoch> reads;
};

struct State {
  std::mutex mu;
  Mode mode = LAZY;
  std::mt19937_64 rng{0};
  std::vector<Queue> queues;  // by slot; slot 0 (the host) has no queue
  Clock host;
  uint64_t next_id = 0;
  std::map<uintptr_t, Cell> shadow;
  // Coarse ranges of sparse accesses: (start) -> (end, epoch); checked against frees only.
  std::multimap<uintptr_t, std::pair<uintptr_t, Epoch>> sparse;
  std::atomic<unsigned long long> races{0};
  std::atomic<unsigned long long> undeclared{0};
  std::atomic<unsigned long long> ctx_syncs{0};
  bool capture_sites = true;
  // FAKE_CUDA_RACES=off: no access is checked (to time the executor's host side alone).
  bool check = true;
};

State& st() {
  static State* s = [] {
    State* s = new State;
    s->queues.resize(2);
    const char* m = getenv("FAKE_CUDA_SCHED");
    std::string mode = m ? m : "lazy";
    if (mode == "eager") s->mode = EAGER;
    else if (mode == "lazy" || mode.empty()) s->mode = LAZY;
    else if (mode == "adversarial") s->mode = ADVERSARIAL;
    else if (mode == "random") s->mode = RANDOM;
    else {
      fprintf(stderr, "fake libcuda: FAKE_CUDA_SCHED=%s is not eager, lazy, adversarial or random\n",
              mode.c_str());
      abort();
    }
    if (const char* seed = getenv("FAKE_CUDA_SEED")) s->rng.seed(strtoull(seed, nullptr, 0));
    const char* sites = getenv("FAKE_CUDA_SITES");
    s->capture_sites = !(sites && sites[0] == '0');
    const char* races = getenv("FAKE_CUDA_RACES");
    s->check = !(races && std::string(races) == "off");
    if (!s->check) s->capture_sites = false;
    return s;
  }();
  return *s;
}

// The symbolised frames of a call site (addr2line over the mapped objects), skipping the
// driver's own and the Rust runtime's frames; at most `max` lines.
std::string symbolise(const std::vector<void*>& site, size_t max) {
  std::string out;
  size_t shown = 0;
  for (void* pc : site) {
    if (shown >= max) break;
    Dl_info di;
    if (!dladdr(pc, &di) || !di.dli_fname) continue;
    std::string file = di.dli_fname;
    if (file.find("libcuda.so") != std::string::npos) continue;
    uintptr_t off = (uintptr_t)pc - (uintptr_t)di.dli_fbase - 1;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "addr2line -f -C -i -e '%s' 0x%lx 2>/dev/null", file.c_str(),
             (unsigned long)off);
    FILE* p = popen(cmd, "r");
    std::string text;
    if (p) {
      char line[1024];
      while (fgets(line, sizeof line, p)) text += line;
      pclose(p);
    }
    // Pairs of lines: function, then file:line; keep the innermost.
    std::istringstream lines(text);
    std::string fn, where;
    std::getline(lines, fn);
    std::getline(lines, where);
    if (fn.empty() || fn == "??") {
      fn = file + "+" + std::to_string(off);
    }
    if (fn.find("std::") == 0 || fn.find("core::") == 0 || fn.find("cudarc::") == 0 ||
        fn.find("<cudarc::") == 0 || fn.find("alloc::") == 0) {
      continue;
    }
    out += "      " + fn + (where.empty() || where.find("??") == 0 ? "" : "  " + where) + "\n";
    shown++;
  }
  return out;
}

std::string describe(const Epoch& e, bool write) {
  std::string s = (write ? "write by #" : "read by #") + std::to_string(e.info->id) + " " +
                  e.info->what + " on " +
                  (e.slot == HOST ? std::string("the host")
                   : e.slot == LEGACY ? std::string("the legacy default stream")
                                      : "stream " + std::to_string(e.slot));
  return s + "\n" + symbolise(e.info->site, 8);
}

void report(const Epoch& earlier, bool earlier_write, const Epoch& now, bool now_write,
            uintptr_t addr, size_t len) {
  State& s = st();
  s.races++;
  fprintf(stderr,
          "fake libcuda: RACE on bytes [%#lx, +%zu): neither access is ordered before the other\n"
          "    %s    %s",
          (unsigned long)addr, len, describe(now, now_write).c_str(),
          describe(earlier, earlier_write).c_str());
}

bool ordered(const Epoch& e, const Clock& c) { return e.clock <= c.at(e.slot); }

// Splits the shadow so that `at` starts a cell (when inside one).
void split(std::map<uintptr_t, Cell>& sh, uintptr_t at) {
  auto it = sh.upper_bound(at);
  if (it == sh.begin()) return;
  --it;
  if (it->first < at && at < it->second.end) {
    Cell right = it->second;
    it->second.end = at;
    sh.emplace(at, std::move(right));
  }
}

// Checks one access of work `now` (whose clock is `c`) against the shadow, then records it.
// Caller holds the state lock.
void check(const Access& a, const Epoch& now, const Clock& c) {
  if (a.len == 0) return;
  State& s = st();
  uintptr_t lo = a.addr, hi = a.addr + a.len;
  if (a.sparse) {
    s.sparse.emplace(lo, std::make_pair(hi, now));
    return;
  }
  auto& sh = s.shadow;
  split(sh, lo);
  split(sh, hi);
  // Fill the gaps in [lo, hi) with fresh cells.
  uintptr_t at = lo;
  auto it = sh.lower_bound(lo);
  std::vector<std::pair<uintptr_t, uintptr_t>> gaps;
  while (at < hi) {
    if (it == sh.end() || it->first >= hi) {
      gaps.push_back({at, hi});
      break;
    }
    if (it->first > at) gaps.push_back({at, it->first});
    at = it->second.end;
    ++it;
  }
  for (auto& g : gaps) sh.emplace(g.first, Cell{g.second, std::nullopt, {}});
  bool reported = false;
  for (it = sh.lower_bound(lo); it != sh.end() && it->first < hi; ++it) {
    Cell& cell = it->second;
    if (!reported && cell.write && cell.write->slot != now.slot && !ordered(*cell.write, c)) {
      report(*cell.write, true, now, a.write, it->first, cell.end - it->first);
      reported = true;
    }
    if (a.write) {
      for (const Epoch& r : cell.reads) {
        if (!reported && r.slot != now.slot && !ordered(r, c)) {
          report(r, false, now, true, it->first, cell.end - it->first);
          reported = true;
        }
      }
      cell.write = now;
      cell.reads.clear();
    } else {
      bool replaced = false;
      for (Epoch& r : cell.reads) {
        if (r.slot == now.slot) {
          r = now;
          replaced = true;
        }
      }
      // Reads ordered before this one need no keeping.
      if (!replaced) {
        cell.reads.erase(std::remove_if(cell.reads.begin(), cell.reads.end(),
                                        [&](const Epoch& r) { return ordered(r, c); }),
                         cell.reads.end());
        cell.reads.push_back(now);
      }
    }
  }
  // Merge neighbours that now say the same, so the shadow stays as coarse as the accesses.
  auto first = sh.lower_bound(lo);
  if (first != sh.begin()) --first;
  for (auto cur = first; cur != sh.end() && cur->first <= hi;) {
    auto next = std::next(cur);
    if (next == sh.end()) break;
    Cell& x = cur->second;
    Cell& y = next->second;
    bool same_write = (!x.write && !y.write) ||
                      (x.write && y.write && x.write->info == y.write->info);
    bool same_reads = x.reads.size() == y.reads.size() &&
                      std::equal(x.reads.begin(), x.reads.end(), y.reads.begin(),
                                 [](const Epoch& p, const Epoch& q) { return p.info == q.info; });
    if (x.end == next->first && same_write && same_reads) {
      x.end = y.end;
      sh.erase(next);
    } else {
      cur = next;
    }
  }
}

// Forgets [lo, hi) (freed memory, or a new allocation at an address used before), after
// checking that everything that touched it is ordered before the host (a free is a write
// by the host). Caller holds the state lock.
void forget(uintptr_t lo, uintptr_t hi, bool check_free, const char* what) {
  State& s = st();
  if (check_free && s.check) {
    uint64_t id = ++s.next_id;
    s.host.set(HOST, id);
    auto info = std::make_shared<Info>(Info{id, HOST, what, {}});
    Epoch now{HOST, id, info};
    bool reported = false;
    auto it = s.shadow.upper_bound(lo);
    if (it != s.shadow.begin()) --it;
    for (; it != s.shadow.end() && it->first < hi && !reported; ++it) {
      if (it->second.end <= lo) continue;
      if (it->second.write && !ordered(*it->second.write, s.host)) {
        report(*it->second.write, true, now, true, it->first, it->second.end - it->first);
        reported = true;
      }
      for (const Epoch& r : it->second.reads) {
        if (!reported && !ordered(r, s.host)) {
          report(r, false, now, true, it->first, it->second.end - it->first);
          reported = true;
        }
      }
    }
    for (auto& [start, span] : s.sparse) {
      if (reported) break;
      if (start < hi && span.first > lo && !ordered(span.second, s.host)) {
        report(span.second, false, now, true, std::max(start, lo),
               std::min(span.first, hi) - std::max(start, lo));
        reported = true;
      }
    }
  }
  split(s.shadow, lo);
  split(s.shadow, hi);
  s.shadow.erase(s.shadow.lower_bound(lo), s.shadow.lower_bound(hi));
  for (auto it = s.sparse.begin(); it != s.sparse.end();) {
    if (it->first < hi && it->second.first > lo) it = s.sparse.erase(it);
    else ++it;
  }
}

// Drops sparse records that every clock has passed (nothing can race with them any more).
void prune_sparse() {
  State& s = st();
  if (s.sparse.size() < 4096) return;
  for (auto it = s.sparse.begin(); it != s.sparse.end();) {
    if (ordered(it->second.second, s.host)) it = s.sparse.erase(it);
    else ++it;
  }
}

uint32_t slot_of(CUstream h);

std::vector<void*> capture() {
  std::vector<void*> site;
  if (!st().capture_sites) return site;
  void* frames[40];
  int n = backtrace(frames, 40);
  site.assign(frames + 1, frames + n);
  return site;
}

// Enqueues `run` on stream `h`, after checking its accesses. Returns the work's id.
uint64_t enqueue(CUstream h, std::function<CUresult()> run, const std::vector<Access>& accesses,
                 std::string what, Clock* clock_out = nullptr, uint32_t* slot_out = nullptr) {
  std::vector<void*> site = capture();
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  uint32_t slot = slot_of(h);
  Queue& q = s.queues[slot];
  std::vector<std::pair<uint32_t, uint64_t>> deps;
  // Work the host enqueues comes after what the host has seen.
  q.clock.join(s.host);
  // The legacy default stream waits for the blocking streams, and they for it.
  if (slot == LEGACY) {
    for (uint32_t i = 2; i < s.queues.size(); ++i) {
      Queue& o = s.queues[i];
      if (o.alive && o.blocking && o.last) {
        q.clock.join(o.clock);
        deps.push_back({i, o.last});
      }
    }
  } else if (q.blocking && s.queues[LEGACY].last) {
    q.clock.join(s.queues[LEGACY].clock);
    deps.push_back({LEGACY, s.queues[LEGACY].last});
  }
  uint64_t id = ++s.next_id;
  q.clock.set(slot, id);
  static const bool trace = getenv("FAKE_CUDA_TRACE") != nullptr;
  if (trace) {
    fprintf(stderr, "fake libcuda: #%llu on slot %u: %s", (unsigned long long)id, slot,
            what.c_str());
    for (const Access& a : accesses) {
      fprintf(stderr, " %s[%#lx,+%zu)", a.sparse ? "sparse-" : a.write ? "w" : "r",
              (unsigned long)a.addr, a.len);
    }
    fprintf(stderr, "\n");
  }
  auto info = std::make_shared<Info>(Info{id, slot, std::move(what), std::move(site)});
  Epoch now{slot, id, info};
  if (s.check) {
    for (const Access& a : accesses) check(a, now, q.clock);
  }
  q.work.push_back(Work{id, std::move(run), std::move(deps)});
  q.last = id;
  if (clock_out) *clock_out = q.clock;
  if (slot_out) *slot_out = slot;
  prune_sparse();
  return id;
}

// Makes stream `h` wait for work `(slot, id)` whose clock was `c` (an event's recording).
void wait_for(CUstream h, uint32_t slot, uint64_t id, const Clock& c) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  uint32_t me = slot_of(h);
  Queue& q = s.queues[me];
  q.clock.join(c);
  uint64_t marker = ++s.next_id;
  if (getenv("FAKE_CUDA_TRACE")) {
    fprintf(stderr, "fake libcuda: #%llu on slot %u: wait for #%llu of slot %u\n",
            (unsigned long long)marker, me, (unsigned long long)id, slot);
  }
  q.clock.set(me, marker);
  q.work.push_back(Work{marker, {}, {{slot, id}}});
  q.last = marker;
}

bool ran(const State& s, uint32_t slot, uint64_t id) { return s.queues[slot].done >= id; }

// Held for a whole drive: a synchronisation returns only once the work it needs has run,
// including work another thread's drive took off a queue and is running now.
std::mutex g_drive_mu;

// Runs queued work, chosen by the mode, until every target (slot, id) has run; with `all`,
// until every queue is empty. Returns the first error the work met, if any (sticky).
CUresult drive(std::vector<std::pair<uint32_t, uint64_t>> targets, bool all, CUresult* sticky) {
  std::lock_guard<std::mutex> serial(g_drive_mu);
  State& s = st();
  for (;;) {
    Work w;
    uint32_t slot = 0;
    {
      std::lock_guard<std::mutex> g(s.mu);
      if (all) {
        targets.clear();
        for (uint32_t i = 1; i < s.queues.size(); ++i) {
          if (!s.queues[i].work.empty()) targets.push_back({i, s.queues[i].last});
        }
      }
      bool met = std::all_of(targets.begin(), targets.end(),
                             [&](auto& t) { return ran(s, t.first, t.second); });
      if (met) return *sticky;
      // What the wait needs: per slot, the last id that must run (with what it waits for).
      std::vector<uint64_t> need(s.queues.size(), 0);
      if (s.mode == EAGER) {
        for (uint32_t i = 1; i < s.queues.size(); ++i) need[i] = s.queues[i].last;
      } else {
        for (auto& t : targets) need[t.first] = std::max(need[t.first], t.second);
        for (bool grew = true; grew;) {
          grew = false;
          for (uint32_t i = 1; i < s.queues.size(); ++i) {
            for (const Work& x : s.queues[i].work) {
              if (x.id > need[i]) break;
              for (auto& d : x.deps) {
                if (d.second > need[d.first] && !ran(s, d.first, d.second)) {
                  need[d.first] = d.second;
                  grew = true;
                }
              }
            }
          }
        }
      }
      // Ready: the head of a queue whose dependencies have run.
      std::vector<uint32_t> ready;
      for (uint32_t i = 1; i < s.queues.size(); ++i) {
        const Queue& q = s.queues[i];
        if (q.work.empty()) continue;
        const Work& head = q.work.front();
        bool deps_met = std::all_of(head.deps.begin(), head.deps.end(),
                                    [&](auto& d) { return ran(s, d.first, d.second); });
        bool needed = head.id <= need[i] || s.mode == RANDOM;
        if (deps_met && needed) ready.push_back(i);
      }
      if (ready.empty()) {
        fprintf(stderr, "fake libcuda: scheduler stuck (no ready work for a wait)\n");
        abort();
      }
      uint32_t pick = ready[0];
      switch (s.mode) {
        case EAGER:
        case LAZY:
          for (uint32_t i : ready) {
            if (s.queues[i].work.front().id < s.queues[pick].work.front().id) pick = i;
          }
          break;
        case ADVERSARIAL:
          // The lowest priority (numerically greatest) first; among equals the oldest work.
          for (uint32_t i : ready) {
            const Queue& a = s.queues[i];
            const Queue& b = s.queues[pick];
            if (a.priority > b.priority ||
                (a.priority == b.priority && a.work.front().id < b.work.front().id)) {
              pick = i;
            }
          }
          break;
        case RANDOM:
          pick = ready[s.rng() % ready.size()];
          break;
      }
      w = std::move(s.queues[pick].work.front());
      s.queues[pick].work.pop_front();
      slot = pick;
    }
    // Run outside the lock: other threads keep enqueueing (their drives wait on g_drive_mu).
    CUresult r = w.run ? w.run() : OK;
    std::lock_guard<std::mutex> g(s.mu);
    if (r != OK && *sticky == OK) *sticky = r;
    s.queues[slot].done = w.id;
  }
}

// A new stream's slot.
uint32_t add_stream(int priority, bool blocking) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  Queue q;
  q.priority = priority;
  q.blocking = blocking;
  q.clock.join(s.host);
  s.queues.push_back(std::move(q));
  return (uint32_t)s.queues.size() - 1;
}

}  // namespace sched
