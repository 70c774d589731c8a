// A stack's input rows from its tokens, forward and backward, in one pass each way (embedding.py says
// when it runs). The tokens are a (batch, length) block read flat; row r is that of flat position
// p = where[r] (p = r without `where`): dropout(weight[tokens[p]] x scale, zero where its word is
// dropped, + the sinusoid of position p % length + start); then zero rows up to `padded`.
//
// PyTorch runs it as the embedding's gather, the scaling, the word mask, the positions' addition,
// dropout and the gather into the stack's flat rows, each a pass over the rows; backward, dropout's,
// the scaling's, the flat rows' scatter back into (batch, length) and the embedding's own scatter
// into a zeroed weight-shaped gradient. Here a row is read once and written once each way. The
// dropout mask is the PyTorch path's, whose dropout ran over the (batch, length) block: element j of
// flat position p draws the bits of element p x width + j, from the same key forward and backward.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace {

using namespace seq2seq_cpu;

// Which token and position each row reads.
struct Positions {
  const int64_t* tokens;  // the (batch, length) block, flat
  const int64_t* where;   // each row's flat position; null: row r is position r
  int64_t length, start;
  int64_t of(int64_t r) const { return where == nullptr ? r : where[r]; }
};

// The rounding of the PyTorch path is kept: the scaled embedding, its sum with the position's sinusoid
// and the dropped-out result are each stored in T there.
template <typename T>
void forward_rows(const T* weight, const Positions& source, const bool* words_kept, const T* table, T* out,
                  int64_t begin, int64_t end, int64_t used, int64_t width, float scale, const Draw& draw) {
  RowBits draws;
  const uint32_t dropped_below = draw.dropped_below;  // locals: the stores below could alias draw's fields
  const float kept_scale = draw.scale;
  for (int64_t r = begin; r < end; ++r) {
    T* row = out + r * width;
    if (r >= used) {
      for (int64_t c = 0; c < width; ++c) store(row + c, 0.0f);
      continue;
    }
    const int64_t position = source.of(r);
    const T* embedding = weight + source.tokens[position] * width;
    const T* sinusoid = table + (position % source.length + source.start) * width;
    const float word = words_kept == nullptr || words_kept[position] ? 1.0f : 0.0f;
    const uint16_t* bits = draws.draw(draw.seed, position * width, width);
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float x = rounded<T>(rounded<T>(load(embedding[c]) * scale) * word + load(sinusoid[c]));
      store(row + c, bits[c] >= dropped_below ? x * kept_scale : 0.0f);
    }
  }
}

// The weight's gradient for the tokens [first, last): each token's rows, found through `order` (rows
// by token, in row order), summed in fp32 in row order and stored once; zero for a token no row reads
// and for `padding_idx` (nn.Embedding's). Summing a token's rows in one thread, in row order, gives
// the same bits for any thread count.
template <typename T>
void backward_tokens(const T* grad, const Positions& source, const bool* words_kept, const int64_t* starts,
                     const int64_t* order, T* out, int64_t first, int64_t last, int64_t width, float scale,
                     int64_t padding_idx, const Draw& draw) {
  RowBits draws;
  const uint32_t dropped_below = draw.dropped_below;  // locals: the stores below could alias draw's fields
  const float kept_scale = draw.scale;
  std::vector<float> sums(width);
  float* sum = sums.data();
  for (int64_t token = first; token < last; ++token) {
    for (int64_t c = 0; c < width; ++c) sum[c] = 0.0f;
    if (token != padding_idx) {
      for (int64_t i = starts[token]; i < starts[token + 1]; ++i) {
        const int64_t r = order[i], position = source.of(r);
        if (words_kept != nullptr && !words_kept[position]) continue;
        const T* g = grad + r * width;
        const uint16_t* bits = draws.draw(draw.seed, position * width, width);
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float kept = load(g[c]) * kept_scale;  // read either way: a read under a condition stays scalar
          sum[c] += (bits[c] >= dropped_below ? kept : 0.0f) * scale;
        }
      }
    }
    T* row = out + token * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) store(row + c, sum[c]);
  }
}

void check_in_range(const at::Tensor& values, const char* name, int64_t bound) {
  TORCH_CHECK(values.device().is_cpu() && values.dim() == 1 && values.scalar_type() == at::kLong &&
                  values.is_contiguous(),
              name, ": a contiguous 1-d int64 CPU tensor");
  const int64_t* data = values.data_ptr<int64_t>();
  for (int64_t i = 0; i < values.numel(); ++i)
    TORCH_CHECK(data[i] >= 0 && data[i] < bound, name, ": ", data[i], " out of range [0, ", bound, ")");
}

// The rows' tokens and positions, checked: the flat block `tokens` (ids below vocab) of rows `length`
// long, and `where`, the flat positions of the rows (none: every position, in order).
Positions check_positions(const at::Tensor& tokens, const std::optional<at::Tensor>& where, int64_t length,
                          int64_t start, int64_t vocab) {
  check_in_range(tokens, "tokens", vocab);
  TORCH_CHECK(length >= 1 && tokens.numel() % length == 0 && start >= 0,
              "length: a positive divisor of the tokens' count; start: not negative");
  if (where.has_value()) check_in_range(*where, "where", tokens.numel());
  return {tokens.data_ptr<int64_t>(), where.has_value() ? where->data_ptr<int64_t>() : nullptr, length, start};
}

const bool* words_kept_of(const std::optional<at::Tensor>& words_kept, const at::Tensor& tokens) {
  if (!words_kept.has_value()) return nullptr;
  TORCH_CHECK(words_kept->scalar_type() == at::kBool && words_kept->is_contiguous() &&
                  words_kept->numel() == tokens.numel(),
              "words_kept: a contiguous bool tensor, one per token");
  return words_kept->data_ptr<bool>();
}

// (padded, width) rows: for each flat position p that `where` lists, dropout(weight[tokens[p]] x scale
// (0 where words_kept[p] is false) + table[p % length + start]), then zero rows.
at::Tensor embed_rows(const at::Tensor& weight, const at::Tensor& tokens, const std::optional<at::Tensor>& where,
                      int64_t length, int64_t start, const std::optional<at::Tensor>& words_kept,
                      const at::Tensor& table, double scale, int64_t padded, const at::Tensor& seed,
                      int64_t dropped_below, double dropout_scale) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight: a contiguous 2-d CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16, "weight: fp32 or bf16");
  TORCH_CHECK(table.scalar_type() == weight.scalar_type() && table.is_contiguous() && table.dim() == 2 &&
                  table.size(1) == weight.size(1) && table.size(0) >= length + start,
              "table: contiguous rows of the weight's dtype and width, one per position");
  const Positions source = check_positions(tokens, where, length, start, weight.size(0));
  const int64_t used = where.has_value() ? where->numel() : tokens.numel();
  TORCH_CHECK(padded >= used, "padded: at least a row per position");
  const bool* kept = words_kept_of(words_kept, tokens);
  const Draw draw = check_draw(seed, dropped_below, dropout_scale);
  const int64_t width = weight.size(1);
  const auto factor = static_cast<float>(scale);
  at::Tensor out = at::empty({padded, width}, weight.options());
  at::parallel_for(0, padded, 16, [&](int64_t begin, int64_t end) {
    if (weight.scalar_type() == at::kBFloat16) {
      using T = c10::BFloat16;
      forward_rows(weight.data_ptr<T>(), source, kept, table.data_ptr<T>(), out.data_ptr<T>(), begin, end, used, width,
                   factor, draw);
    } else {
      forward_rows(weight.data_ptr<float>(), source, kept, table.data_ptr<float>(), out.data_ptr<float>(), begin, end,
                   used, width, factor, draw);
    }
  });
  return out;
}

// The gradient of embed_rows's weight, (vocab, width), from the gradient of its rows.
at::Tensor embed_rows_backward(const at::Tensor& grad, const at::Tensor& tokens,
                               const std::optional<at::Tensor>& where, int64_t length,
                               const std::optional<at::Tensor>& words_kept, int64_t vocab, int64_t padding_idx,
                               double scale, const at::Tensor& seed, int64_t dropped_below, double dropout_scale) {
  TORCH_CHECK(grad.device().is_cpu() && grad.dim() == 2 && grad.is_contiguous(), "grad: contiguous 2-d CPU rows");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, "grad: fp32 or bf16");
  const Positions source = check_positions(tokens, where, length, 0, vocab);
  const int64_t used = where.has_value() ? where->numel() : tokens.numel(), width = grad.size(1);
  TORCH_CHECK(grad.size(0) >= used, "grad: a row per position");
  const bool* kept = words_kept_of(words_kept, tokens);
  const Draw draw = check_draw(seed, dropped_below, dropout_scale);
  // the rows of each token in row order (a counting sort): token t's are order[starts[t], starts[t + 1])
  std::vector<int64_t> starts(static_cast<size_t>(vocab + 1), 0), order(static_cast<size_t>(used));
  for (int64_t r = 0; r < used; ++r) ++starts[source.tokens[source.of(r)] + 1];
  for (int64_t t = 0; t < vocab; ++t) starts[t + 1] += starts[t];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t r = 0; r < used; ++r) order[next[source.tokens[source.of(r)]]++] = r;
  const auto factor = static_cast<float>(scale);
  at::Tensor out = at::empty({vocab, width}, grad.options());
  at::parallel_for(0, vocab, 64, [&](int64_t first, int64_t last) {
    if (grad.scalar_type() == at::kBFloat16) {
      using T = c10::BFloat16;
      backward_tokens(grad.data_ptr<T>(), source, kept, starts.data(), order.data(), out.data_ptr<T>(), first, last,
                      width, factor, padding_idx, draw);
    } else {
      backward_tokens(grad.data_ptr<float>(), source, kept, starts.data(), order.data(), out.data_ptr<float>(), first,
                      last, width, factor, padding_idx, draw);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("embed_rows(Tensor weight, Tensor tokens, Tensor? where, int length, int start, Tensor? words_kept,"
        " Tensor table, float scale, int padded, Tensor seed, int dropped_below, float dropout_scale) -> Tensor");
  m.def("embed_rows_backward(Tensor grad, Tensor tokens, Tensor? where, int length, Tensor? words_kept, int vocab,"
        " int padding_idx, float scale, Tensor seed, int dropped_below, float dropout_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("embed_rows", &embed_rows);
  m.impl("embed_rows_backward", &embed_rows_backward);
}
