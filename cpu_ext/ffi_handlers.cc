// XLA FFI handler: y[..., rows] = x[..., cols] · Wᵀ for a GGUF weight W [rows, cols] (see qmatmul.h, ffi_common.h).
#include "ffi_common.h"

namespace jaxinfer_cpu {
namespace {

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows, int64_t cols) {
  TypeInfo info;
  int64_t row_bytes;
  if (ffi::Error error = check_weight("quantized_matmul", w, qtype, rows, cols, &info, &row_bytes); error.failure()) {
    return error;
  }
  const auto x_dims = x.dimensions();
  if (x_dims.size() < 1 || x_dims[x_dims.size() - 1] != cols) {
    return ffi::Error::InvalidArgument("quantized_matmul: x must be [..., " + std::to_string(cols) + "]");
  }
  const int64_t m = x.element_count() / cols;
  if (y->element_count() != static_cast<size_t>(m * rows)) {
    return ffi::Error::InvalidArgument("quantized_matmul: output must be [..., " + std::to_string(rows) + "]");
  }

  const auto* ws = static_cast<const uint8_t*>(w.untyped_data());
  float* ys = y->typed_data();
  const RowDot dot(pool, best_kernels(), info, x.typed_data(), m, cols, thread_scratch().xq);
  // Each task is a band of output rows for all m tokens: the band's weights are read from memory once, and each
  // row is dotted with four tokens at a time.
  const int64_t band = rows_per_task(pool, rows);
  parallel_for(pool, (rows + band - 1) / band, [=](int64_t task) {
    const int64_t r0 = task * band, r1 = std::min(rows, r0 + band);
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) {
      for (int64_t r = r0; r < r1; ++r) {
        float out[4];
        dot.four(ws + r * row_bytes, t, out);
        for (int i = 0; i < 4; ++i) ys[(t + i) * rows + r] = out[i];
      }
    }
    for (; t < m; ++t) {
      for (int64_t r = r0; r < r1; ++r) ys[t * rows + r] = dot(ws + r * row_bytes, t);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, jaxinfer_cpu::QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., cols]
                                  .Arg<ffi::AnyBuffer>()         // W: uint8 blocks [rows, bytes], or f16/f32 [rows, cols]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., rows]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));
