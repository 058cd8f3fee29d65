// A standalone probe of the sorted softmax kernel (jaxcsr/kernels/csrc/softmax.cc) on
// a Cora-sized pattern: no XLA, no jit call around it. Built against whichever
// csrc folder -I names; the README here gives the commands and the results.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "softmax.cc"

using namespace jaxcsr::cpu;

int main(int argc, char** argv) {
  const int64_t m = argc > 1 ? atol(argv[1]) : 2708, entries = argc > 2 ? atol(argv[2]) : 10556;
  const int64_t h = argc > 3 ? atol(argv[3]) : 1;
  std::mt19937 gen(0);
  std::vector<int32_t> rows(entries);
  for (auto& r : rows) r = static_cast<int32_t>(gen() % m);
  std::sort(rows.begin(), rows.end());
  std::vector<int32_t> indptr(m + 1, 0);
  for (auto r : rows) indptr[r + 1]++;
  for (int64_t i = 0; i < m; ++i) indptr[i + 1] += indptr[i];
  std::normal_distribution<float> normal;
  std::vector<float> x(entries * h), y(entries * h), scratch(kRowBuffer + 16);
  for (auto& v : x) v = normal(gen);
  std::vector<double> us;
  for (int rep = 0; rep < 201; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    run_best<SoftmaxSorted<F32, F32>>(indptr.data(), x.data(), static_cast<const float*>(nullptr),
                                      y.data(), h, int64_t{0}, m, scratch.data(), entries);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(us.begin(), us.end());
  std::printf("rows %ld entries %ld heads %ld: median %.1f us\n", static_cast<long>(m),
              static_cast<long>(entries), static_cast<long>(h), us[100]);
}
