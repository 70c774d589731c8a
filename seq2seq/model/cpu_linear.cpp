// The backward pass of a linear layer's ReLU and bias in one pass (cpu_linear.py says why): the
// gradient masked where the ReLU's output is not positive, and its column sums, the bias's gradient.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using namespace seq2seq_cpu;

// Rows per task: each task sums its rows' gradients per column, and the tasks' sums add up in order,
// so that any thread count gives the same bits.
constexpr int64_t kRowsPerTask = 32;

template <typename T>
void relu_rows(const T* grad, const T* out, T* grad_in, float* sums, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = grad + r * width;
    const T* o = out + r * width;
    T* masked = grad_in + r * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float value = load(o[c]) <= 0.0f ? 0.0f : load(g[c]);  // as threshold_backward: a NaN passes
      store(masked + c, value);
      sums[c] += value;
    }
  }
}

// (the gradient of the ReLU's input, the bias's gradient) from the gradient of the ReLU's output
// `grad` and that output `out`, both contiguous (rows, width) of one dtype, fp32 or bf16.
std::tuple<at::Tensor, at::Tensor> relu_bias_backward(const at::Tensor& grad, const at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(), "out: a contiguous CPU matrix");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.sizes() == out.sizes() &&
                  grad.scalar_type() == out.scalar_type(),
              "grad: a contiguous CPU matrix of out's shape and dtype");
  const int64_t rows = out.size(0), width = out.size(1), tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  at::Tensor grad_in = at::empty_like(grad);
  std::vector<float> partial(static_cast<size_t>(tasks * width), 0.0f);
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t begin = task * kRowsPerTask, end = std::min(rows, begin + kRowsPerTask);
      float* sums = partial.data() + task * width;
      if (out.scalar_type() == at::kBFloat16) {
        using T = c10::BFloat16;
        relu_rows(grad.data_ptr<T>(), out.data_ptr<T>(), grad_in.data_ptr<T>(), sums, begin, end, width);
      } else {
        relu_rows(grad.data_ptr<float>(), out.data_ptr<float>(), grad_in.data_ptr<float>(), sums, begin, end, width);
      }
    }
  });
  at::Tensor totals = at::zeros({width}, out.options().dtype(at::kFloat));
  float* total = totals.data_ptr<float>();
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t c = 0; c < width; ++c) total[c] += partial[task * width + c];
  return {grad_in, totals.to(out.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("relu_bias_backward(Tensor grad, Tensor out) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) { m.impl("relu_bias_backward", &relu_bias_backward); }
