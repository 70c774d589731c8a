// Fused CPU kernels (cpu_kernels.py builds and loads them; its docstring says why they exist).
//
// Each kernel does in one pass over memory what PyTorch does in several: the data of one row stays
// in the core's cache between the steps that PyTorch runs over whole tensors, each from DRAM.
// The loops are plain C++ that the compiler vectorises for the machine it builds on (-march=native,
// `omp simd`); at::parallel_for spreads rows over PyTorch's own intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using namespace seq2seq_cpu;

// Rows [begin, end) of one chunk of logits: each row's label-smoothed loss into losses, and its
// gradient (softmax - smoothing / V - (1 - smoothing) at the target) over the logits, in place.
// Rows from `real` on are padding: their gradient is zero. One read of the row from memory into a
// row of floats that stays in cache, three passes over that, one write of the gradient.
template <typename T>
void loss_rows(T* logits, const int64_t* target, double* losses, int64_t begin, int64_t end, int64_t real,
               int64_t vocab, float smoothing) {
  std::vector<float> row(vocab);
  float* values = row.data();
  const float spread = smoothing / static_cast<float>(vocab);
  for (int64_t r = begin; r < end; ++r) {
    T* z = logits + r * vocab;
    if (r >= real) {
      for (int64_t v = 0; v < vocab; ++v) store(z + v, 0.0f);
      continue;
    }
    float largest = -std::numeric_limits<float>::infinity();
    float sum = 0.0f;
#pragma omp simd reduction(max : largest) reduction(+ : sum)
    for (int64_t v = 0; v < vocab; ++v) {
      const float value = load(z[v]);
      values[v] = value;
      largest = value > largest ? value : largest;
      sum += value;
    }
    float exp_sum = 0.0f;
#pragma omp simd reduction(+ : exp_sum)
    for (int64_t v = 0; v < vocab; ++v) {
      const float e = exp_nonpositive(values[v] - largest);
      values[v] = e;
      exp_sum += e;
    }
    const int64_t t = target[r];
    const double log_sum_exp = largest + std::log(static_cast<double>(exp_sum));
    // -(1 - eps) log p(target) - (eps / V) sum of log p over the vocabulary, where log p = z - lse
    losses[r] = log_sum_exp - (1.0 - smoothing) * load(z[t]) - static_cast<double>(spread) * sum;
    const float inverse = 1.0f / exp_sum;
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) store(z + v, values[v] * inverse - spread);
    store(z + t, values[t] * inverse - spread + (smoothing - 1.0f));
  }
}

at::Tensor label_smoothed_loss_(at::Tensor logits, const at::Tensor& target, double smoothing) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous(),
              "logits: a contiguous 2-d CPU tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, "logits: fp32 or bf16");
  TORCH_CHECK(target.dim() == 1 && target.scalar_type() == at::kLong && target.is_contiguous(),
              "target: a contiguous 1-d int64 tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1), real = target.size(0);
  TORCH_CHECK(real <= rows, "more targets than rows of logits");
  const int64_t* ids = target.data_ptr<int64_t>();
  for (int64_t r = 0; r < real; ++r) TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, "target id out of range");
  at::Tensor losses = at::empty({real}, logits.options().dtype(at::kDouble));
  double* out = losses.data_ptr<double>();
  const float eps = static_cast<float>(smoothing);
  // Each row is computed by one thread from its own data alone: the result is the same for any
  // number of threads.
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    if (logits.scalar_type() == at::kBFloat16) {
      loss_rows(logits.data_ptr<c10::BFloat16>(), ids, out, begin, end, real, vocab, eps);
    } else {
      loss_rows(logits.data_ptr<float>(), ids, out, begin, end, real, vocab, eps);
    }
  });
  return losses;
}

// The shared contract of the kernels that write fp32 from bf16 element by element: contiguous CPU
// tensors of one shape, out fp32 and values bf16.
static void check_fp32_from_bf16(const at::Tensor& out, const at::Tensor& values) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && values.scalar_type() == at::kBFloat16, "expected fp32 out, bf16 values");
  TORCH_CHECK(out.device().is_cpu() && values.device().is_cpu() && out.is_contiguous() && values.is_contiguous() &&
                  out.sizes() == values.sizes(),
              "expected contiguous CPU tensors of one shape");
}

// out += addend, fp32 += bf16, without the fp32 copy of the addend that PyTorch's add_ makes first.
void add_bf16_(at::Tensor out, const at::Tensor& addend) {
  check_fp32_from_bf16(out, addend);
  float* sums = out.data_ptr<float>();
  const c10::BFloat16* values = addend.data_ptr<c10::BFloat16>();
  at::parallel_for(0, out.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) sums[i] += load(values[i]);
  });
}

// out = values * scale, fp32 from bf16 in one pass (a cast and a scaling): the gradients handed to
// fp32 master weights, clipped. scale: a one-element fp32 CPU tensor (no read into Python per step).
void widen_scaled_(at::Tensor out, const at::Tensor& values, const at::Tensor& scale) {
  check_fp32_from_bf16(out, values);
  float* into = out.data_ptr<float>();
  const c10::BFloat16* data = values.data_ptr<c10::BFloat16>();
  TORCH_CHECK(scale.device().is_cpu() && scale.numel() == 1 && scale.scalar_type() == at::kFloat,
              "scale: one fp32 CPU value");
  const float factor = scale.item<float>();
  at::parallel_for(0, out.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) into[i] = load(data[i]) * factor;
  });
}

// Dropout's random bits: element i reads lane i % 4 (16 bits) of word i / 4, and word w is SplitMix64's
// output w of the stream that starts at `seed` (a 64-bit draw from PyTorch's generator per call). A
// word depends on the seed and its index alone, so any thread computes any part of the mask, and the
// backward pass recomputes the mask from the seed instead of keeping it.
constexpr int64_t kWordsPerBlock = 256;

inline void draw_words(uint64_t seed, int64_t first_word, uint64_t* words) {
#pragma omp simd
  for (int64_t w = 0; w < kWordsPerBlock; ++w) words[w] = random_word(seed, first_word + w);
}

// out = addend + x * scale where an element is kept (its 16 bits at or above `dropped_below`), addend
// where it is dropped; without an addend, 0 where dropped. One pass: read x (and the addend), write out.
// x is read whether kept or not: GCC leaves a loop whose reads hang on a condition scalar.
template <typename T>
void masked_scale_block(const T* x, const T* addend, T* out, int64_t begin, int64_t end, uint64_t seed,
                        uint32_t dropped_below, float scale) {
  uint64_t words[kWordsPerBlock];
  const int64_t block = kWordsPerBlock * 4;
  for (int64_t start = begin - begin % block; start < end; start += block) {
    draw_words(seed, start / 4, words);
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(words);
    const int64_t from = start < begin ? begin : start, to = start + block < end ? start + block : end;
    if (addend == nullptr) {
#pragma omp simd
      for (int64_t i = from; i < to; ++i) {
        const float scaled = load(x[i]) * scale;
        store(out + i, bits[i - start] >= dropped_below ? scaled : 0.0f);
      }
    } else {
#pragma omp simd
      for (int64_t i = from; i < to; ++i) {
        const float scaled = load(x[i]) * scale;
        store(out + i, load(addend[i]) + (bits[i - start] >= dropped_below ? scaled : 0.0f));
      }
    }
  }
}

// Dropout of x at the probability `dropped_below` / 65,536, kept elements scaled by `scale`, added to
// `addend` where one is given (a residual connection); the same seed gives the same mask, forward
// and backward.
at::Tensor dropout(const at::Tensor& x, const std::optional<at::Tensor>& addend, const at::Tensor& seed,
                   int64_t dropped_below, double scale) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x: a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: fp32 or bf16");
  TORCH_CHECK(!addend.has_value() || (addend->scalar_type() == x.scalar_type() && addend->is_contiguous() &&
                                      addend->sizes() == x.sizes()),
              "addend: contiguous, of x's dtype and shape");
  const Draw draw = check_draw(seed, dropped_below, scale);
  at::Tensor out = at::empty_like(x);
  // Blocks of 1,024 elements per task at least: a thread's share begins and ends inside blocks, and
  // draws a boundary block's words again (the same words: the result is the same for any thread count).
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kBFloat16) {
      using T = c10::BFloat16;
      masked_scale_block(x.data_ptr<T>(), addend ? addend->data_ptr<T>() : nullptr, out.data_ptr<T>(), begin, end,
                         draw.seed, draw.dropped_below, draw.scale);
    } else {
      masked_scale_block(x.data_ptr<float>(), addend ? addend->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                         begin, end, draw.seed, draw.dropped_below, draw.scale);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(seq2seq_cpu, m) {
  m.def("label_smoothed_loss_(Tensor(a!) logits, Tensor target, float smoothing) -> Tensor");
  m.def("add_bf16_(Tensor(a!) out, Tensor addend) -> ()");
  m.def("widen_scaled_(Tensor(a!) out, Tensor values, Tensor scale) -> ()");
  m.def("dropout(Tensor x, Tensor? addend, Tensor seed, int dropped_below, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("label_smoothed_loss_", &label_smoothed_loss_);
  m.impl("add_bf16_", &add_bf16_);
  m.impl("widen_scaled_", &widen_scaled_);
  m.impl("dropout", &dropout);
}
