// What the fused CPU kernels share (cpu_kernels.cpp, cpu_attention.cpp, cpu_residual_norm.cpp,
// cpu_linear.cpp, cpu_embedding.cpp, cpu_optimizer.cpp): bf16 loads and stores that round as PyTorch's
// casts do, an exp that the compiler vectorises, dropout's random bits, and the rows of a task in a sum
// over rows.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace seq2seq_cpu {

// Rows per task of a sum over rows (a bias's or a LayerNorm weight's gradient): each task sums its rows
// per column and the tasks' sums add up in task order, so that any thread count gives the same bits.
constexpr int64_t kRowsPerTask = 32;

inline float from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float load(float value) { return value; }
inline float load(c10::BFloat16 value) { return from_bits(static_cast<uint32_t>(value.x) << 16); }

inline void store(float* out, float value) { *out = value; }
// Rounds to the nearest bf16, ties to even, as PyTorch's casts do (a NaN stays non-finite).
inline void store(c10::BFloat16* out, float value) {
  const uint32_t bits = to_bits(value);
  out->x = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// value as a T holds it: a PyTorch op's result in T, read back as the next op reads it.
template <typename T>
inline float rounded(float value) {
  T kept;
  store(&kept, value);
  return load(kept);
}

// e^x for x <= 0, written so that it vectorises: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// polynomial of degree 6 (relative error under 2e-7, about fp32's rounding), 2^n put in the exponent
// bits. Below -87 the result is e^-87 (~1.6e-38), which changes no sum of probabilities.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float round_shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds a float to an integer
  const float n = (x * 1.44269504f + round_shift) - round_shift;
  const float r = x - n * 0.693145752f - n * 1.42860677e-06f;  // ln2 in two parts, for exactness
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f + r * 0.00138888892f)))));
  return p * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// Word `index` of the random stream keyed by `seed`: SplitMix64's output for that counter. Dropout
// reads 16 bits an element, element i lane i % 4 of word i / 4.
inline uint64_t random_word(uint64_t seed, int64_t index) {
  uint64_t z = seed + static_cast<uint64_t>(index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Dropout's 16-bit draws for a row's elements [first, first + count) of the flat tensor.
class RowBits {
 public:
  const uint16_t* draw(uint64_t seed, int64_t first, int64_t count) {
    const int64_t first_word = first / 4, words = (first + count - 1) / 4 - first_word + 1;
    if (static_cast<int64_t>(words_.size()) < words) words_.resize(words);
    uint64_t* out = words_.data();
#pragma omp simd
    for (int64_t w = 0; w < words; ++w) out[w] = random_word(seed, first_word + w);
    return reinterpret_cast<const uint16_t*>(words_.data()) + (first - first_word * 4);
  }

 private:
  std::vector<uint64_t> words_;
};

// A dropout's mask and scale as a kernel reads them: an element is kept where its 16 bits are at or
// above dropped_below.
struct Draw {
  uint64_t seed;
  uint32_t dropped_below;
  float scale;
};

inline Draw check_draw(const at::Tensor& seed, int64_t dropped_below, double scale) {
  TORCH_CHECK(dropped_below >= 0 && dropped_below < 65536, "dropped_below: in [0, 65536)");
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1, "seed: one int64");
  return {static_cast<uint64_t>(seed.item<int64_t>()), static_cast<uint32_t>(dropped_below),
          static_cast<float>(scale)};
}

}  // namespace seq2seq_cpu
