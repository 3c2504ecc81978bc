// The repacked kernels of a weight type (qmatmul.h, groups of eight rows), as the dense products (ffi_handlers.cc)
// and the row-sparse products of many tokens (union_rows.cc) call them.
#pragma once

#include <cstdint>

#include "ffi_common.h"

namespace jaxinfer_cpu {

// The repacked kernels of a type (qmatmul.h) in this kernel set, over activation blocks XBlock: BlockQ8 for the
// 32-value block types, BlockQ8K for the K-quants and IQ4_XS. `one` null where the type has none.
template <typename XBlock>
struct X8Kernels {
  void (*one)(const uint8_t* group, const XBlock* x, int64_t x_stride, int n, float* out) = nullptr;
  void (*four)(const uint8_t* group, const XBlock* x, int64_t x_stride, int n, float* out) = nullptr;
  using TwoGroups = void (*)(const uint8_t* group, int64_t group_bytes, const XBlock* x, int64_t x_stride, int n,
                             float* out);
  TwoGroups two_groups = nullptr;        // four tokens; null where the set has none
  TwoGroups two_groups_eight = nullptr;  // eight tokens; null where the set has none
};

inline X8Kernels<BlockQ8> x8_kernels(const Kernels& k, int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {k.x8_q4_0, k.x8_q4_0_x4, k.x16_q4_0_x4};
    case kQ4_1: return {k.x8_q4_1, k.x8_q4_1_x4, k.x16_q4_1_x4};
    case kQ8_0: return {k.x8_q8_0, k.x8_q8_0_x4, k.x16_q8_0_x4};
    case kIQ4_NL: return {k.x8_iq4_nl, k.x8_iq4_nl_x4, k.x16_iq4_nl_x4};
    default: return {};
  }
}

inline X8Kernels<BlockQ8K> x8k_kernels(const Kernels& k, int64_t qtype) {
  switch (qtype) {
    case kQ4_K: return {k.x8_q4_k, k.x8_q4_k_x4, k.x16_q4_k_x4, k.x16_q4_k_x8};
    case kQ5_K: return {k.x8_q5_k, k.x8_q5_k_x4, k.x16_q5_k_x4, k.x16_q5_k_x8};
    case kQ6_K: return {k.x8_q6_k, k.x8_q6_k_x4, k.x16_q6_k_x4, k.x16_q6_k_x8};
    case kIQ4_XS: return {k.x8_iq4_xs, k.x8_iq4_xs_x4, k.x16_iq4_xs_x4, k.x16_iq4_xs_x8};
    default: return {};
  }
}

// Bytes of a repacked group per block of the type's size (32 or 256 values), 0 for a type that is not repacked.
inline int64_t x8_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kIQ4_NL: return 144;
    case kQ4_1: return 160;
    case kQ8_0: return 272;
    case kQ4_K: return kQ4KGroupBytes;
    case kQ5_K: return kQ5KGroupBytes;
    case kQ6_K: return kQ6KGroupBytes;
    case kIQ4_XS: return kIQ4XSGroupBytes;
    default: return 0;
  }
}

// Activation bytes of the tokens a task dots with each group before moving on: they stay in L2 (1 MiB a core on
// Zen 4, the weights' groups beside them) while the task's groups stream past, instead of every token's blocks
// coming from L3 once per group.
constexpr int64_t kTokenChunkBytes = 384 * 1024;

}  // namespace jaxinfer_cpu
