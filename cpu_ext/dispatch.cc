// Run-time choice of kernels: the library is built without -march flags, the SIMD kernels carry their own target
// attributes, and the CPU is asked once which of them it can run. The C entry points let Python report the choice
// and let tests force each implementation on one machine.
#include <atomic>
#include <cstring>
#include <initializer_list>

#include "qmatmul.h"
#include "ternary.h"

namespace jaxinfer_cpu {

#if !JAXINFER_CPU_X86  // kernels_avx2.cc and kernels_avx512.cc are only built for x86-64
const Kernels& avx2_kernels() { return scalar_kernels(); }
const Kernels& avx512_kernels() { return scalar_kernels(); }
#endif

namespace {

Kernels complete(Kernels k) {
  const Kernels& s = scalar_kernels();
  for (auto field : {&Kernels::q8_0, &Kernels::q4_0, &Kernels::q4_1, &Kernels::q5_0, &Kernels::q5_1,
                     &Kernels::iq4_nl}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  for (auto field : {&Kernels::q2_k, &Kernels::q3_k, &Kernels::q4_k, &Kernels::q5_k, &Kernels::q6_k,
                     &Kernels::iq4_xs}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  for (auto field : {&Kernels::axpy_q8_0, &Kernels::axpy_q4_0, &Kernels::axpy_q4_1, &Kernels::axpy_q5_0,
                     &Kernels::axpy_q5_1, &Kernels::axpy_q2_k, &Kernels::axpy_q3_k, &Kernels::axpy_q4_k,
                     &Kernels::axpy_q5_k, &Kernels::axpy_q6_k, &Kernels::axpy_iq4_nl, &Kernels::axpy_iq4_xs,
                     &Kernels::axpy_f16, &Kernels::axpy_f32}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  if (k.f16 == nullptr) k.f16 = s.f16;
  if (k.f32 == nullptr) k.f32 = s.f32;
  if (k.quantize_row == nullptr) k.quantize_row = s.quantize_row;
  if (k.quantize_row_k == nullptr) k.quantize_row_k = s.quantize_row_k;
  for (auto field : {&Kernels::neuron_block_q4_0, &Kernels::neuron_block_q4_1, &Kernels::neuron_block_q8_0}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  for (auto field : {&Kernels::x8_q8_0, &Kernels::x8_q4_0, &Kernels::x8_q4_1, &Kernels::x8_iq4_nl,
                     &Kernels::x8_q8_0_x4, &Kernels::x8_q4_0_x4, &Kernels::x8_q4_1_x4, &Kernels::x8_iq4_nl_x4}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  for (auto field : {&Kernels::x8_q4_k, &Kernels::x8_q5_k, &Kernels::x8_q6_k, &Kernels::x8_iq4_xs,
                     &Kernels::x8_q4_k_x4, &Kernels::x8_q5_k_x4, &Kernels::x8_q6_k_x4, &Kernels::x8_iq4_xs_x4}) {
    if (k.*field == nullptr) k.*field = s.*field;
  }
  return k;
}

#if JAXINFER_CPU_X86
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// The neuron-major kernels of the AVX-512 set: VBMI's byte permutes where the CPU has them, else AVX2's unpacks.
Kernels with_neuron_major_kernels(Kernels k) {
  const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  const Kernels& avx2 = avx2_kernels();
  k.neuron_block_q4_0 = vbmi ? neuron_block_q4_0_vbmi : avx2.neuron_block_q4_0;
  k.neuron_block_q4_1 = vbmi ? neuron_block_q4_1_vbmi : avx2.neuron_block_q4_1;
  k.neuron_block_q8_0 = vbmi ? neuron_block_q8_0_vbmi : avx2.neuron_block_q8_0;
  return k;
}
#else  // other architectures run the portable kernels
bool cpu_has_avx512() { return false; }
Kernels with_neuron_major_kernels(Kernels k) { return k; }
bool cpu_has_avx2() { return false; }
#endif

const Kernels* by_name(const char* isa) {
  static const Kernels scalar = with_ternary_kernels(scalar_kernels(), "scalar");
  static const Kernels avx2 = with_ternary_kernels(complete(avx2_kernels()), "avx2");
  static const Kernels avx512 = with_ternary_kernels(
      complete(cpu_has_avx512() ? with_neuron_major_kernels(avx512_kernels()) : avx512_kernels()), "avx512");
  if (std::strcmp(isa, "avx512") == 0) return cpu_has_avx512() ? &avx512 : nullptr;
  if (std::strcmp(isa, "avx2") == 0) return cpu_has_avx2() ? &avx2 : nullptr;
  if (std::strcmp(isa, "scalar") == 0) return &scalar;
  return nullptr;
}

const Kernels* detect() {
  for (const char* isa : {"avx512", "avx2"}) {
    if (const Kernels* k = by_name(isa)) return k;
  }
  return by_name("scalar");
}

std::atomic<const Kernels*> selected{nullptr};

}  // namespace

const Kernels& best_kernels() {
  const Kernels* k = selected.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = detect();
    selected.store(k, std::memory_order_release);
  }
  return *k;
}

}  // namespace jaxinfer_cpu

extern "C" {

// Name of the kernels in use: "avx512" (AVX-512 + VNNI), "avx2" or "scalar".
const char* jaxinfer_cpu_isa() { return jaxinfer_cpu::best_kernels().isa; }

// Whether the neuron-major sparse down projection runs a SIMD kernel (AVX-512 VBMI or AVX2) rather than the portable
// one, which is correct but several times slower than the dense kernel: 1, else 0.
int jaxinfer_cpu_fast_neuron_major() {
  const jaxinfer_cpu::Kernels& k = jaxinfer_cpu::best_kernels();
  return k.neuron_block_q4_1 != jaxinfer_cpu::scalar_kernels().neuron_block_q4_1;
}

// Use the named kernels from now on ("best" re-detects); returns 0 if this CPU cannot run them.
int jaxinfer_cpu_select_isa(const char* isa) {
  const jaxinfer_cpu::Kernels* k =
      std::strcmp(isa, "best") == 0 ? jaxinfer_cpu::detect() : jaxinfer_cpu::by_name(isa);
  if (k == nullptr) return 0;
  jaxinfer_cpu::selected.store(k, std::memory_order_release);
  return 1;
}

}
