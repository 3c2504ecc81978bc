// What the row-sparse FFN handlers share (sparse_handlers.cc, down_rows.cc): the token and mask arguments of a
// masked call, its active rows, a gather's index, and sums over groups of items that do not depend on which thread
// ran which group.
#pragma once

#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "ffi_common.h"

namespace jaxinfer_cpu {

constexpr int64_t kMaxWeights = 4;  // weights of one masked_matmul_group call (a part's gate and up)

// The weights a masked product reads and the outputs it writes, one pair per weight, by value in its tasks.
struct WeightsAndOutputs {
  const uint8_t* ws[kMaxWeights];
  float* outs[kMaxWeights];
  int64_t n;
};

inline bool same_leading_dims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

inline std::string dims_string(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A mask's bytes. XLA makes PRED bytes 0 or 1, but a caller can hand over any bytes as bool (a uint8 array viewed as
// bool). Read as C++ bool, a byte of 2 is undefined behaviour: the compiler added it to the count of active rows, and
// a count past the rows wrote past the row list. So the handlers read bytes, and any nonzero one means active, as
// numpy and XLA's conversion to int read it (XLA's select looks at the low bit only: no reading agrees with all of
// XLA). Rejecting such bytes instead would take a pass over all m * rows of them, not O(rows).
inline const uint8_t* mask_bytes(const ffi::Buffer<ffi::PRED>& mask) {
  return reinterpret_cast<const uint8_t*>(mask.typed_data());
}

// Rows j < n with mask[t, j] nonzero for some t < m, in increasing order, into s.rows; returns how many.
inline int64_t active_rows(const uint8_t* bytes, int64_t m, int64_t n, Scratch& s) {
  // Read as bytes, the OR over tokens vectorizes; as bool it did not, and took 15 µs of a 300 µs call (8 tokens,
  // 1536 rows).
  const uint8_t* any = bytes;
  if (m > 1) {
    s.active.assign(bytes, bytes + n);
    uint8_t* out = s.active.data();
    for (int64_t t = 1; t < m; ++t) {
      for (int64_t j = 0; j < n; ++j) out[j] |= bytes[t * n + j];
    }
    any = out;
  }
  s.rows.resize(n);
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {  // branch-free: a random mask would mispredict about every other row
    s.rows[count] = static_cast<int32_t>(j);
    count += any[j] != 0;
  }
  return count;
}

// ys [size] = the sum of add_items(i0, i1, y) over ranges of the items [0, n_items), each adding its items into a
// zeroed y.
//
// The items are cut into one group of consecutive items per thread; a task adds one group's, in order, into an
// accumulator of its own (group 0's is ys), and the accumulators are summed in group order at the end. So the result
// does not depend on which thread ran which group, only on the pool's size, through the number of groups. Four groups
// per thread balanced the threads better if one started late, but their accumulators and final sum cost more: one
// token at d = 576, half the rows active, masked_axpy 0.92-0.96 -> 0.80-0.84 of the dense kernel's time and
// neuron_major_axpy 0.62-0.65 -> 0.45-0.47 (8 tokens, d = 4096: 1.33-1.37 -> 1.22-1.29).
template <typename AddItems>
inline void sum_over_groups(ffi::ThreadPool& pool, int64_t n_items, int64_t size, float* ys, Scratch& s,
                     const AddItems& add_items) {
  const int64_t n_groups = std::min(n_items, std::max<int64_t>(1, pool.num_threads()));
  if (n_groups == 0) {
    std::memset(ys, 0, sizeof(float) * size);
    return;
  }
  s.acc.resize(static_cast<size_t>((n_groups - 1) * size));
  float* acc = s.acc.data();
  parallel_for(pool, n_groups, [=](int64_t group) {
    float* y = group == 0 ? ys : acc + (group - 1) * size;
    std::memset(y, 0, sizeof(float) * size);
    add_items(group * n_items / n_groups, (group + 1) * n_items / n_groups, y);
  });
  for (int64_t g = 1; g < n_groups; ++g) {
    for (int64_t i = 0; i < size; ++i) ys[i] += acc[(g - 1) * size + i];
  }
}

// Zeroes y[0, n): over the pool's threads where it is large (a prompt's outputs: 22.5 MB for a 7B-shaped gate over
// 512 tokens), where one thread zeroing it would leave the others waiting.
inline void zero_floats(ffi::ThreadPool& pool, float* y, int64_t n) {
  constexpr int64_t kTaskFloats = int64_t{1} << 18;  // 1 MB a task
  if (n <= kTaskFloats) {
    std::memset(y, 0, sizeof(float) * n);
    return;
  }
  parallel_for(pool, (n + kTaskFloats - 1) / kTaskFloats, [=](int64_t task) {
    const int64_t i0 = task * kTaskFloats;
    std::memset(y + i0, 0, sizeof(float) * std::min(kTaskFloats, n - i0));
  });
}

// Whether an index entry of type T is an int32 value.
template <typename T>
inline bool fits_int32(T value) {
  if constexpr (std::is_signed_v<T>) {
    if (value < std::numeric_limits<int32_t>::min()) return false;
  }
  return value <= static_cast<T>(std::numeric_limits<int32_t>::max());
}

// The k entries of a wider index as int32 into s.index; false if one does not fit, as a cast would wrap it into
// [0, rows) and read a row nobody asked for.
template <typename T>
inline bool narrow_index(const void* data, int64_t k, Scratch& s) {
  const T* wide = static_cast<const T*>(data);
  s.index.resize(k);
  bool fits = true;
  for (int64_t i = 0; i < k; ++i) {
    fits &= fits_int32(wide[i]);
    s.index[i] = static_cast<int32_t>(wide[i]);
  }
  return fits;
}

// Checks a gather's index [k] (int32, or int64 / uint32 / uint64 whose entries fit in int32: entries outside
// [0, rows) are padding, but one int32 cannot hold is a caller's error) and points *entries at it as int32.
inline ffi::Error index_entries(const std::string& op, const ffi::AnyBuffer& index, Scratch& s, const int32_t** entries,
                         int64_t* k) {
  if (index.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(op + ": index must be 1-D, got " + dims_string(index.dimensions()));
  }
  *k = index.dimensions()[0];
  if (*k > std::numeric_limits<int32_t>::max()) {  // positions are listed as int32 (valid_positions)
    return ffi::Error::InvalidArgument(op + ": index has " + std::to_string(*k) + " entries, more than int32 holds");
  }
  const void* data = index.untyped_data();
  bool fits = true;
  switch (index.element_type()) {
    case ffi::DataType::S32: *entries = static_cast<const int32_t*>(data); return ffi::Error::Success();
    case ffi::DataType::S64: fits = narrow_index<int64_t>(data, *k, s); break;
    case ffi::DataType::U32: fits = narrow_index<uint32_t>(data, *k, s); break;
    case ffi::DataType::U64: fits = narrow_index<uint64_t>(data, *k, s); break;
    default: return ffi::Error::InvalidArgument(op + ": index must be int32, int64, uint32 or uint64");
  }
  if (!fits) {
    return ffi::Error::InvalidArgument(op + ": an index entry is outside the int32 range (entries outside [0, rows) "
                                       "are padding, but these would wrap)");
  }
  *entries = s.index.data();
  return ffi::Error::Success();
}

// The token args of a masked axpy: h [..., rows], mask of h's shape, y [..., cols]; *m = the tokens.
inline ffi::Error check_masked_axpy(const std::string& op, const ffi::Buffer<ffi::F32>& h,
                             const ffi::Buffer<ffi::PRED>& mask, const ffi::Buffer<ffi::F32>& y, int64_t rows,
                             int64_t cols, int64_t* m) {
  if (!tokens_of(h.dimensions(), rows, m)) {
    return ffi::Error::InvalidArgument(op + ": h must be [..., " + std::to_string(rows) + "], got " +
                                       dims_string(h.dimensions()));
  }
  if (mask.dimensions().size() != h.dimensions().size() || !same_leading_dims(mask.dimensions(), h.dimensions()) ||
      mask.dimensions()[mask.dimensions().size() - 1] != rows) {
    return ffi::Error::InvalidArgument(op + ": mask must have the shape of h " + dims_string(h.dimensions()) +
                                       ", got " + dims_string(mask.dimensions()));
  }
  if (!holds(y.element_count(), *m, cols)) {
    return ffi::Error::InvalidArgument(op + ": output must be [..., " + std::to_string(cols) + "]");
  }
  return ffi::Error::Success();
}

// The token args of a gather axpy: index [k] (index_entries: *entries, *k), h [..., k], y [..., cols]; *m = the
// tokens.
inline ffi::Error check_gather_axpy(const std::string& op, const ffi::Buffer<ffi::F32>& h, const ffi::AnyBuffer& index,
                                    const ffi::Buffer<ffi::F32>& y, int64_t cols, Scratch& s,
                                    const int32_t** entries, int64_t* k, int64_t* m) {
  if (ffi::Error error = index_entries(op, index, s, entries, k); error.failure()) return error;
  if (!tokens_of(h.dimensions(), *k, m)) {
    return ffi::Error::InvalidArgument(op + ": h must be [..., " + std::to_string(*k) + "] (k = len(index)), got " +
                                       dims_string(h.dimensions()));
  }
  if (!holds(y.element_count(), *m, cols)) {
    return ffi::Error::InvalidArgument(op + ": output must be [..., " + std::to_string(cols) + "]");
  }
  return ffi::Error::Success();
}

}  // namespace jaxinfer_cpu
