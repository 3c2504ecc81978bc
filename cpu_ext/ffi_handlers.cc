// XLA FFI handlers: y[..., rows] = x[..., cols] · Wᵀ for a GGUF weight W [rows, cols] (see qmatmul.h, ffi_common.h),
// and the same for a group of weights sharing x, type and cols (a layer's q/k/v, or gate/up): one call quantizes x
// once and splits the rows of all of them over the threads, instead of paying a call, a quantization and a thread
// hand-off per weight (the default model's decode: 4.9 -> 4.2 ms per token for 4 calls per layer instead of 7).
// The weights come as GGUF rows (attribute interleave = 1) or repacked eight rows to a group (interleave = 8,
// qmatmul.h, jaxinfer.quant.pack_rows_x8), which the repacked kernels dot with any number of tokens.
#include <string>

#include "ffi_common.h"
#include "repacked_products.h"

namespace jaxinfer_cpu {
namespace {

constexpr size_t kMaxGroup = 8;

// One weight of a group: its blocks, row size and row count, and where its outputs go.
struct Product {
  const uint8_t* w;
  int64_t row_bytes, rows;
  float* y;
};

// Rows a task dots with all of its tokens before it moves on: with more than four tokens (a server's decode step over
// its busy slots, a micro-batch) the tile's weights come from memory once and from L1 for the later groups of four;
// a whole band per group read a 30 MB output matrix from memory once per group.
constexpr int64_t kTileRows = 32;

// Asks for row r's bytes, into L2: the tile after the current one is fetched while this one computes (two rows
// interleaved, four tokens each, left the hardware prefetchers behind with weights from memory).
inline void prefetch_row(const uint8_t* row, int64_t row_bytes) {
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
}

// ys of every product = x · Wᵀ. Each task is a band of rows, counted across the products in order, for all m tokens,
// in tiles of kTileRows rows; each row is dotted with four tokens at a time.
void multiply(ffi::ThreadPool& pool, const RowDot& dot, const Product* products, size_t n_products, int64_t m) {
  int64_t total = 0;
  for (size_t i = 0; i < n_products; ++i) total += products[i].rows;
  const int64_t band = rows_per_task(pool, total);
  Product own[kMaxGroup];
  std::copy(products, products + n_products, own);
  parallel_for(pool, (total + band - 1) / band, [=](int64_t task) {
    int64_t start = 0;  // first row of product i in the count across products
    for (size_t i = 0; i < n_products; start += own[i].rows, ++i) {
      const int64_t r0 = std::max(task * band - start, int64_t{0});
      const int64_t r1 = std::min((task + 1) * band - start, own[i].rows);
      const Product& p = own[i];
      for (int64_t tile = r0; tile < r1; tile += kTileRows) {
        const int64_t tile_end = std::min(tile + kTileRows, r1);
        int64_t t = 0;
        for (; t + 4 <= m; t += 4) {
          int64_t r = tile;
          for (; r + 2 <= tile_end; r += 2) {
            if (t == 0 && r + kTileRows + 1 < r1) {
              prefetch_row(p.w + (r + kTileRows) * p.row_bytes, 2 * p.row_bytes);
            }
            float out[8];
            dot.two_by_four(p.w + r * p.row_bytes, p.row_bytes, t, out);
            for (int k = 0; k < 4; ++k) p.y[(t + k) * p.rows + r] = out[k], p.y[(t + k) * p.rows + r + 1] = out[4 + k];
          }
          for (; r < tile_end; ++r) {
            float out[4];
            dot.four(p.w + r * p.row_bytes, t, out);
            for (int k = 0; k < 4; ++k) p.y[(t + k) * p.rows + r] = out[k];
          }
        }
        for (; t < m; ++t) {
          for (int64_t r = tile; r < tile_end; ++r) p.y[t * p.rows + r] = dot(p.w + r * p.row_bytes, t);
        }
      }
    }
  });
}

}  // namespace

// Declared in repacked_products.h, which says what it checks.
ffi::Error check_any_weight(const std::string& op, const ffi::AnyBuffer& w, int64_t qtype, int64_t rows,
                            int64_t cols, int64_t interleave, TypeInfo* info, int64_t* row_bytes) {
  if (interleave == 1) return check_weight(op, w, qtype, rows, cols, info, row_bytes);
  if (interleave != kInterleave || x8_block_bytes(qtype) == 0) {
    return ffi::Error::InvalidArgument(op + ": interleave must be 1, or 8 for Q4_0/Q4_1/Q8_0/IQ4_NL/Q4_K/Q5_K/Q6_K/"
                                       "IQ4_XS; got " + std::to_string(interleave) + " for GGML type " +
                                       std::to_string(qtype));
  }
  type_info(qtype, info);
  if (rows <= 0 || rows > (int64_t{1} << 30) || cols <= 0 || cols % info->block_size != 0 ||
      cols > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(op + ": rows=" + std::to_string(rows) + " must be positive and cols=" +
                                       std::to_string(cols) + " a positive multiple of " +
                                       std::to_string(info->block_size));
  }
  *row_bytes = cols / info->block_size * info->type_size;
  const int64_t groups = (rows + kInterleave - 1) / kInterleave, group_bytes = cols / info->block_size *
                                                                               x8_block_bytes(qtype);
  const auto dims = w.dimensions();
  if (w.element_type() != ffi::DataType::U8 || dims.size() != 2 || dims[0] != groups || dims[1] != group_bytes) {
    return ffi::Error::InvalidArgument(op + ": a weight repacked in groups of eight rows must be u8 [" +
                                       std::to_string(groups) + ", " + std::to_string(group_bytes) + "]");
  }
  return ffi::Error::Success();
}

namespace {

// Checks x [..., cols] and returns the number of tokens m in *m.
ffi::Error check_x(const std::string& op, const ffi::Buffer<ffi::F32>& x, int64_t cols, int64_t* m) {
  if (!tokens_of(x.dimensions(), cols, m)) {
    return ffi::Error::InvalidArgument(op + ": x must be [..., " + std::to_string(cols) + "]");
  }
  return ffi::Error::Success();
}

ffi::Error check_output(const std::string& op, const ffi::AnyBuffer& y, int64_t m, int64_t rows) {
  if (y.element_type() != ffi::DataType::F32 || !holds(y.element_count(), m, rows)) {
    return ffi::Error::InvalidArgument(op + ": output must be f32 [..., " + std::to_string(rows) + "]");
  }
  return ffi::Error::Success();
}

// Quantizes x and runs the products: the repacked product loop (repacked_products.h) for repacked weights, else
// multiply.
void run_products(ffi::ThreadPool& pool, const TypeInfo& info, int64_t qtype, int64_t interleave, const float* x,
                  int64_t m, int64_t cols, const Product* products, size_t n) {
  Scratch& scratch = thread_scratch();
  if (interleave == kInterleave) {
    X8Product x8[kMaxGroup];
    for (size_t i = 0; i < n; ++i) x8[i] = {products[i].w, products[i].rows, products[i].y, products[i].rows, 0, m};
    return run_x8_products(pool, info, qtype, x, m, cols, x8, n, scratch);
  }
  const RowDot dot(pool, best_kernels(), info, x, m, cols, scratch);
  multiply(pool, dot, products, n, m);
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> y, int64_t qtype, int64_t rows, int64_t cols,
                               int64_t interleave) {
  TypeInfo info;
  int64_t row_bytes, m;
  if (ffi::Error error = check_any_weight("quantized_matmul", w, qtype, rows, cols, interleave, &info, &row_bytes);
      error.failure()) {
    return error;
  }
  if (ffi::Error error = check_x("quantized_matmul", x, cols, &m); error.failure()) return error;
  if (ffi::Error error = check_output("quantized_matmul", *y, m, rows); error.failure()) return error;
  const Product product{static_cast<const uint8_t*>(w.untyped_data()), row_bytes, rows,
                        static_cast<float*>(y->untyped_data())};
  run_products(pool, info, qtype, interleave, x.typed_data(), m, cols, &product, 1);
  return ffi::Error::Success();
}

ffi::Error QuantizedMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                                    ffi::RemainingRets ys, int64_t qtype, ffi::Span<const int64_t> rows,
                                    int64_t cols, int64_t interleave) {
  const std::string op = "quantized_matmul_group";
  const size_t n = ws.size();
  if (n == 0 || n > kMaxGroup || ys.size() != n || rows.size() != n) {
    return ffi::Error::InvalidArgument(op + ": 1 to " + std::to_string(kMaxGroup) + " weights, one output and one "
                                       "row count each; got " + std::to_string(n) + " weights, " +
                                       std::to_string(ys.size()) + " outputs, " + std::to_string(rows.size()) +
                                       " row counts");
  }
  int64_t m;
  if (ffi::Error error = check_x(op, x, cols, &m); error.failure()) return error;
  TypeInfo info;
  Product products[kMaxGroup];
  for (size_t i = 0; i < n; ++i) {
    const auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(op + ": weights and outputs are buffers");
    int64_t row_bytes;
    if (ffi::Error error = check_any_weight(op, *w, qtype, rows[i], cols, interleave, &info, &row_bytes);
        error.failure()) {
      return error;
    }
    if (ffi::Error error = check_output(op, **y, m, rows[i]); error.failure()) return error;
    products[i] = {static_cast<const uint8_t*>(w->untyped_data()), row_bytes, rows[i],
                   static_cast<float*>((*y)->untyped_data())};
  }
  run_products(pool, info, qtype, interleave, x.typed_data(), m, cols, products, n);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, jaxinfer_cpu::QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., cols]
                                  .Arg<ffi::AnyBuffer>()         // W: u8 blocks [rows, bytes] or f16/f32 [rows, cols],
                                                                 // or repacked u8 [ceil(rows / 8), 8 bytes]
                                  .Ret<ffi::AnyBuffer>()         // y [..., rows], f32
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("interleave"));  // 1: GGUF rows; 8: groups of eight rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulGroup, jaxinfer_cpu::QuantizedMatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., cols]
                                  .RemainingArgs()               // W_1 .. W_n, as QuantizedMatmul's W
                                  .RemainingRets()               // y_1 .. y_n [..., rows_i], f32
                                  .Attr<int64_t>("qtype")
                                  .Attr<ffi::Span<const int64_t>>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("interleave"));
