// What the native kernels share: widening a value's stored element type to float32, and
// running a prepared job asynchronously on XLA's thread pool.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace scalescope {

namespace ffi = xla::ffi;

// Widening of the stored element type to float32, one chunk at a time.
struct Loader {
  ffi::DataType dtype;
  const void* data;
  const float* lut;  // 8-bit types: the float32 value of each of the 256 bit patterns

  void load(int64_t start, int64_t count, float* out) const {
    switch (dtype) {
      case ffi::DataType::F16: {
        const _Float16* p = static_cast<const _Float16*>(data) + start;
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= count; i += 8) {
          __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
          _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
        }
#endif
        for (; i < count; ++i) out[i] = static_cast<float>(p[i]);
        break;
      }
      case ffi::DataType::BF16: {
        const uint16_t* p = static_cast<const uint16_t*>(data) + start;
        uint32_t* o = reinterpret_cast<uint32_t*>(out);
        for (int64_t i = 0; i < count; ++i) o[i] = static_cast<uint32_t>(p[i]) << 16;
        break;
      }
      case ffi::DataType::F32:
        std::memcpy(out, static_cast<const float*>(data) + start, count * 4);
        break;
      default: {  // 8-bit float types
        const uint8_t* p = static_cast<const uint8_t*>(data) + start;
        for (int64_t i = 0; i < count; ++i) out[i] = lut[p[i]];
      }
    }
  }
};

// Runs `run(job)` on XLA's thread pool and returns a future that only the readers of the
// results wait for (or the preparation's error at once), so a kernel runs beside the rest
// of the program instead of on its critical path.
template <typename Job>
ffi::Future run_async(ffi::ThreadPool& pool, ffi::Error prepared, const Job& job,
                      void (*run)(const Job&)) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (prepared.failure()) {
    promise.SetError(std::move(prepared));
    return future;
  }
  pool.Schedule([job, promise, run]() mutable {
    run(job);
    promise.SetAvailable();
  });
  return future;
}

}  // namespace scalescope
