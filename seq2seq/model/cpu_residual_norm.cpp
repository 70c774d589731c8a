// A residual connection and a LayerNorm of its sum, x + dropout(y) and LayerNorm(x + dropout(y)), in
// one pass over its rows forward and one backward (dropout.py says when it runs): post-norm's residual
// connection, whose output is the LayerNorm, and a pre-norm block's, whose output is the sum and whose
// next sublayer reads the LayerNorm of it.
//
// PyTorch runs it as dropout_add (one pass), LayerNorm (one more), and backward LayerNorm's (reading
// the gradient and the sum, writing the sum's gradient, and its weight's sums), pre-norm's addition
// of the sum's own gradient (one more), then dropout's (one more pass over the sum's gradient). Here a
// row's sum, statistics and gradient stay in the core's cache. The dropout mask is dropout_add's: the
// same key gives the same mask, forward and backward.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace seq2seq_cpu;

template <typename T>
void forward_rows(const T* x, const T* y, const T* weight, const T* bias, T* sum, T* out, float* stats,
                  int64_t begin, int64_t end, int64_t width, uint64_t seed, uint32_t dropped_below, float scale,
                  float eps) {
  RowBits draws;
  std::vector<float> values(width);
  float* v = values.data();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t at = r * width;
    const uint16_t* bits = draws.draw(seed, at, width);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < width; ++c) {
      const float scaled = load(y[at + c]) * scale;  // read either way: a read under a condition stays scalar
      const float kept = bits[c] >= dropped_below ? scaled : 0.0f;
      v[c] = rounded<T>(load(x[at + c]) + kept);  // the sum as stored, which the backward pass reads
      total += v[c];
    }
    const float mean = total / static_cast<float>(width);
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < width; ++c) squares += (v[c] - mean) * (v[c] - mean);
    const float inverse_std = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      store(sum + at + c, v[c]);
      store(out + at + c, (v[c] - mean) * inverse_std * load(weight[c]) + load(bias[c]));
    }
    stats[2 * r] = mean;
    stats[2 * r + 1] = inverse_std;
  }
}

// grad_x = the sum's gradient, rstd (g w - mean(g w) - xhat mean(g w xhat)) + the sum's own gradient
// (`direct`, null: none); grad_y = grad_x dropped and scaled by the forward pass's mask; the weight's and
// bias's gradients added into partial sums. g is grad, plus more (null: none) where the normalised
// output's two uses sent a gradient each.
template <typename T>
void backward_rows(const T* grad, const T* more, const T* direct, const T* sum, const float* stats, const T* weight,
                   T* grad_x, T* grad_y, float* weight_sums, float* bias_sums, int64_t begin, int64_t end,
                   int64_t width, uint64_t seed, uint32_t dropped_below, float scale) {
  RowBits draws;
  std::vector<float> normed(width), scaled(width);
  float* xhat = normed.data();
  float* gw = scaled.data();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t at = r * width;
    const float mean = stats[2 * r], inverse_std = stats[2 * r + 1];
    float mean_gw = 0.0f, mean_gw_xhat = 0.0f;
#pragma omp simd reduction(+ : mean_gw, mean_gw_xhat)
    for (int64_t c = 0; c < width; ++c) {
      const float g = more ? load(grad[at + c]) + load(more[at + c]) : load(grad[at + c]);
      xhat[c] = (load(sum[at + c]) - mean) * inverse_std;
      gw[c] = g * load(weight[c]);
      mean_gw += gw[c];
      mean_gw_xhat += gw[c] * xhat[c];
      weight_sums[c] += g * xhat[c];
      bias_sums[c] += g;
    }
    mean_gw /= static_cast<float>(width);
    mean_gw_xhat /= static_cast<float>(width);
    const uint16_t* bits = draws.draw(seed, at, width);
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float through_norm = inverse_std * (gw[c] - mean_gw - xhat[c] * mean_gw_xhat);
      const float g_sum = rounded<T>(direct ? through_norm + load(direct[at + c]) : through_norm);
      store(grad_x + at + c, g_sum);
      store(grad_y + at + c, bits[c] >= dropped_below ? g_sum * scale : 0.0f);
    }
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == like.scalar_type() &&
                  t.sizes() == like.sizes(),
              name, ": a contiguous CPU tensor of x's dtype and shape");
}

void check_vector(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == like.scalar_type() && t.dim() == 1 &&
                  t.size(0) == like.size(-1),
              name, ": a contiguous vector of x's dtype and width");
}

// (out, sum, stats): LayerNorm(x + dropout(y)), the sum that its backward pass reads, and each row's
// mean and 1 / std (rows, 2) in fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dropout_add_norm(const at::Tensor& x, const at::Tensor& y,
                                                                const at::Tensor& seed, int64_t dropped_below,
                                                                double scale, const at::Tensor& weight,
                                                                const at::Tensor& bias, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1, "x: a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: fp32 or bf16");
  check_rows(y, x, "y");
  check_vector(weight, x, "weight");
  check_vector(bias, x, "bias");
  const Draw draw = check_draw(seed, dropped_below, scale);
  const int64_t width = x.size(-1), rows = x.numel() / width;
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  at::Tensor stats = at::empty({rows, 2}, x.options().dtype(at::kFloat));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kBFloat16) {
      using T = c10::BFloat16;
      forward_rows(x.data_ptr<T>(), y.data_ptr<T>(), weight.data_ptr<T>(), bias.data_ptr<T>(), sum.data_ptr<T>(),
                   out.data_ptr<T>(), stats.data_ptr<float>(), begin, end, width, draw.seed, draw.dropped_below,
                   draw.scale, static_cast<float>(eps));
    } else {
      forward_rows(x.data_ptr<float>(), y.data_ptr<float>(), weight.data_ptr<float>(), bias.data_ptr<float>(),
                   sum.data_ptr<float>(), out.data_ptr<float>(), stats.data_ptr<float>(), begin, end, width,
                   draw.seed, draw.dropped_below, draw.scale, static_cast<float>(eps));
    }
  });
  return {out, sum, stats};
}

// (grad_x, grad_y, grad_weight, grad_bias) of dropout_add_norm, from the gradient of its normalised
// output: grad, plus `more` where given (the gradient of that output's second use, post-norm's); and
// from the gradient of the sum itself where given (`direct`, a pre-norm block's output). Each is added
// as it is read, where autograd would first add them in a pass of its own.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dropout_add_norm_backward(
    const at::Tensor& grad, const std::optional<at::Tensor>& more, const std::optional<at::Tensor>& direct,
    const at::Tensor& sum, const at::Tensor& stats, const at::Tensor& weight, const at::Tensor& seed,
    int64_t dropped_below, double scale) {
  TORCH_CHECK(sum.device().is_cpu() && sum.is_contiguous() && sum.dim() >= 1, "sum: a contiguous CPU tensor");
  TORCH_CHECK(sum.scalar_type() == at::kFloat || sum.scalar_type() == at::kBFloat16, "sum: fp32 or bf16");
  check_rows(grad, sum, "grad");
  if (more.has_value()) check_rows(*more, sum, "more");
  if (direct.has_value()) check_rows(*direct, sum, "direct");
  check_vector(weight, sum, "weight");
  const Draw draw = check_draw(seed, dropped_below, scale);
  const int64_t width = sum.size(-1), rows = sum.numel() / width, tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.numel() == 2 * rows,
              "stats: the forward pass's (rows, 2) fp32");
  at::Tensor grad_x = at::empty_like(sum), grad_y = at::empty_like(sum);
  // per task: its rows' sums for the weight, then for the bias
  std::vector<float> partial(static_cast<size_t>(tasks * 2 * width), 0.0f);
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t begin = task * kRowsPerTask, end = std::min(rows, begin + kRowsPerTask);
      float* sums = partial.data() + task * 2 * width;
      if (sum.scalar_type() == at::kBFloat16) {
        using T = c10::BFloat16;
        backward_rows(grad.data_ptr<T>(), more.has_value() ? more->data_ptr<T>() : nullptr,
                      direct.has_value() ? direct->data_ptr<T>() : nullptr, sum.data_ptr<T>(), stats.data_ptr<float>(),
                      weight.data_ptr<T>(), grad_x.data_ptr<T>(), grad_y.data_ptr<T>(), sums, sums + width, begin, end,
                      width, draw.seed, draw.dropped_below, draw.scale);
      } else {
        backward_rows(grad.data_ptr<float>(), more.has_value() ? more->data_ptr<float>() : nullptr,
                      direct.has_value() ? direct->data_ptr<float>() : nullptr, sum.data_ptr<float>(),
                      stats.data_ptr<float>(), weight.data_ptr<float>(),
                      grad_x.data_ptr<float>(), grad_y.data_ptr<float>(), sums, sums + width, begin, end, width,
                      draw.seed, draw.dropped_below, draw.scale);
      }
    }
  });
  std::vector<float> totals(static_cast<size_t>(2 * width), 0.0f);
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t c = 0; c < 2 * width; ++c) totals[c] += partial[task * 2 * width + c];
  // stored in the weight's dtype as they are written: a cast of its own would be one more op a step
  at::Tensor weight_and_bias = at::empty({2, width}, weight.options());
  if (weight.scalar_type() == at::kBFloat16) {
    c10::BFloat16* out = weight_and_bias.data_ptr<c10::BFloat16>();
    for (int64_t c = 0; c < 2 * width; ++c) store(out + c, totals[c]);
  } else {
    std::copy(totals.begin(), totals.end(), weight_and_bias.data_ptr<float>());
  }
  return {grad_x, grad_y, weight_and_bias[0], weight_and_bias[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("dropout_add_norm(Tensor x, Tensor y, Tensor seed, int dropped_below, float scale, Tensor weight,"
        " Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("dropout_add_norm_backward(Tensor grad, Tensor? more, Tensor? direct, Tensor sum, Tensor stats, Tensor weight,"
        " Tensor seed, int dropped_below, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("dropout_add_norm", &dropout_add_norm);
  m.impl("dropout_add_norm_backward", &dropout_add_norm_backward);
}
