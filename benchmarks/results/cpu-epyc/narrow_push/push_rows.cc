// A standalone probe of the push body for narrow rows (jaxcsr/kernels/csrc/products.cc,
// PushRows): 1M uniform ids into ``m`` rows of ``f`` float32 features, in 4 pieces of
// consecutive ids into 4 partials, on one thread (as the library's static push takes
// them), no XLA around it. Built against whichever csrc folder -I names; the README
// here gives the commands and the results.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "products.cc"

using namespace jaxcsr::cpu;

int main(int argc, char** argv) {
  const int64_t n = 1000000, m = argc > 1 ? atol(argv[1]) : 10000;
  const int64_t f = argc > 2 ? atol(argv[2]) : 4;
  std::mt19937 gen(0);
  std::vector<int32_t> ids(n);
  for (auto& r : ids) r = static_cast<int32_t>(gen() % m);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(n * f), partials(4 * m * f);
  for (auto& v : x) v = uniform(gen);
  std::vector<double> ms;
  for (int rep = 0; rep < 31; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t p = 0; p < 4; ++p)
      run_wide<PushRows<F32, F32, Sum>>(ids.data(), static_cast<const float*>(nullptr), x.data(),
                                        partials.data() + p * m * f, m, f, f, n * p / 4,
                                        n * (p + 1) / 4);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("rows %ld features %ld: median %.2f ms\n", static_cast<long>(m), static_cast<long>(f), ms[15]);
}
