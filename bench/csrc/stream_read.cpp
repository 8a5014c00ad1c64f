// The plain-read peer of bench/small_linear.py --read-peer: read (address, bytes) once, split over
// ATen's threads in the same contiguous runs of 64-row blocks that small_linear.cpp gives each thread,
// four 64-byte vectors added per step, and return the sum (so the compiler keeps every load). What a
// batch-1 product over the same packed weight would cost if it did no arithmetic at all.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

double stream_read(int64_t address, int64_t nbytes, int64_t block_bytes) {
  TORCH_CHECK(block_bytes > 0 && block_bytes % 256 == 0 && nbytes % block_bytes == 0,
              "stream_read: bytes must be whole blocks of a multiple of 256 bytes");
  std::vector<double> part(static_cast<size_t>(at::get_num_threads()), 0.0);
  at::parallel_for(0, nbytes / block_bytes, 1, [&](int64_t b0, int64_t b1) {
    const char* p = reinterpret_cast<const char*>(address) + b0 * block_bytes;
    const char* end = reinterpret_cast<const char*>(address) + b1 * block_bytes;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; p < end; p += 256) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(reinterpret_cast<const float*>(p)));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(reinterpret_cast<const float*>(p + 64)));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(reinterpret_cast<const float*>(p + 128)));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(reinterpret_cast<const float*>(p + 192)));
    }
    part[at::get_thread_num()] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  });
  double sum = 0.0;
  for (double v : part) sum += v;
  return sum;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_read", &stream_read, "read a buffer once in small_linear's thread split; its float sum");
}
