// What the body heap's counting (compute/body_heap.h, compute/body_malloc.cc) costs every
// allocation of a process, against tcmalloc's own entry points in the same run. The executables
// replace operator new and malloc so that a body's allocations can be counted and refused; outside
// bodies, which is nearly every allocation of a worker, the replacement should cost next to nothing.
//
//   build/bin/alloc_bench [--pairs 20000000] [--threads 1,2] [--repeats 5]
//
// Each row is nanoseconds per allocation and free, the median of the repeats, the two forms
// alternating: the process's operator new and delete (ours) against tcmalloc's tc_new and
// tc_delete; its malloc and free (ours) against tc_malloc and tc_free; and the process's operator
// new inside a body's heap scope that counts without a budget, where every allocation is counted.
// Built only where executables link tcmalloc.
#include <gperftools/tcmalloc.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "compute/body_heap.h"
#include "tools/flags.h"

namespace pathways {
namespace {

// Sizes of 16 to 527 bytes, and 64 blocks kept alive at a time, so that frees do not simply
// return the block the next allocation takes.
constexpr int kLive = 64;
inline size_t SizeOf(int64_t i) { return 16 + static_cast<size_t>(i & 511); }

struct Form {
  const char* name;
  void* (*allocate)(size_t);
  void (*release)(void*);
  bool in_body = false;
};

void* OurNew(size_t n) { return ::operator new(n); }
void OurDelete(void* p) { ::operator delete(p); }
void* TcNew(size_t n) { return tc_new(n); }
void TcDelete(void* p) { tc_delete(p); }
void* OurMalloc(size_t n) { return std::malloc(n); }
void OurFree(void* p) { std::free(p); }
void* TcMalloc(size_t n) { return tc_malloc(n); }
void TcFree(void* p) { tc_free(p); }

// Nanoseconds per allocation and free, over `threads` threads doing `pairs` each.
double Measure(const Form& form, int threads, int64_t pairs) {
  auto work = [&] {
    std::optional<ScopedBodyHeap> heap;
    if (form.in_body) heap.emplace(/*budget=*/nullptr);
    std::vector<void*> live(kLive, nullptr);
    for (int64_t i = 0; i < pairs; ++i) {
      void* p = form.allocate(SizeOf(i));
      static_cast<volatile char*>(p)[0] = 1;
      void*& slot = live[i % kLive];
      if (slot != nullptr) form.release(slot);
      slot = p;
    }
    for (void* p : live) {
      if (p != nullptr) form.release(p);
    }
  };
  const double seconds = bench::Seconds([&] {
    std::vector<std::thread> running;
    for (int t = 0; t < threads; ++t) running.emplace_back(work);
    for (std::thread& t : running) t.join();
  });
  return seconds * 1e9 / static_cast<double>(pairs);
}

int Main(int argc, char** argv) {
  const Flags flags = bench::FlagsOrExit(argc, argv, {"pairs", "threads", "repeats"});
  const int64_t pairs = bench::IntFlagOrExit(flags, "pairs", 20'000'000);
  const int64_t repeats = bench::IntFlagOrExit(flags, "repeats", 5);
  const std::vector<int> thread_counts =
      flags.Get("threads").empty() ? std::vector<int>{1, 2} : bench::IntListFlagOrExit(flags, "threads", 1, 64);
  const std::vector<std::pair<Form, Form>> rows = {
      {{"operator new/delete", OurNew, OurDelete}, {"tc_new/tc_delete", TcNew, TcDelete}},
      {{"malloc/free", OurMalloc, OurFree}, {"tc_malloc/tc_free", TcMalloc, TcFree}},
      {{"operator new/delete in a body", OurNew, OurDelete, /*in_body=*/true}, {"tc_new/tc_delete", TcNew, TcDelete}},
  };
  std::printf("### Allocation and free, ns per pair (median of %lld; malloc counted: %s)\n\n",
              static_cast<long long>(repeats), BodyHeapCountsMalloc() ? "yes" : "no");
  std::printf("| threads | ours | ns | tcmalloc's own | ns | ours / tcmalloc's |\n|---|---|---|---|---|---|\n");
  for (int threads : thread_counts) {
    for (const auto& [ours, theirs] : rows) {
      std::vector<double> a, b;
      for (int64_t r = 0; r < repeats; ++r) {
        a.push_back(Measure(ours, threads, pairs));
        b.push_back(Measure(theirs, threads, pairs));
      }
      const double x = bench::Median(a), y = bench::Median(b);
      std::printf("| %d | %s | %.2f | %s | %.2f | %.2fx |\n", threads, ours.name, x, theirs.name, y, x / y);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
