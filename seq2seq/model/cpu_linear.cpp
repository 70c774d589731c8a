// A linear layer's bias gradient, the column sums of its output's gradient, in one pass over it, and
// with a ReLU after the layer, that ReLU's gradient in the same pass (cpu_linear.py says why).

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

template <typename T>
void sum_rows(const T* grad, float* sums, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = grad + r * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) sums[c] += load(g[c]);
  }
}

template <typename T>
void relu_rows(const T* grad, const T* out, T* grad_in, float* sums, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = grad + r * width;
    const T* o = out + r * width;
    T* masked = grad_in + r * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float incoming = load(g[c]);  // read either way: a read under a condition stays scalar
      const float value = load(o[c]) <= 0.0f ? 0.0f : incoming;  // as threshold_backward: a NaN passes
      store(masked + c, value);
      sums[c] += value;
    }
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), name, ": a contiguous CPU matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": fp32 or bf16");
}

// The column sums of the (rows, width) `rows` in fp32: work(task, first row, end row, its sums) fills
// each task's sums, which then add up in task order.
template <typename Work>
at::Tensor column_sums(const at::Tensor& rows, Work work) {
  const int64_t count = rows.size(0), width = rows.size(1), tasks = (count + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> partial(static_cast<size_t>(tasks * width), 0.0f);
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t begin = task * kRowsPerTask, end = std::min(count, begin + kRowsPerTask);
      work(begin, end, partial.data() + task * width);
    }
  });
  at::Tensor totals = at::zeros({width}, rows.options().dtype(at::kFloat));
  float* total = totals.data_ptr<float>();
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t c = 0; c < width; ++c) total[c] += partial[task * width + c];
  return totals;
}

// The bias's gradient: the column sums of the output's gradient `grad`, in its dtype (fp32 or bf16).
at::Tensor bias_backward(const at::Tensor& grad) {
  check_rows(grad, "grad");
  const int64_t width = grad.size(1);
  at::Tensor sums = column_sums(grad, [&](int64_t begin, int64_t end, float* into) {
    if (grad.scalar_type() == at::kBFloat16) sum_rows(grad.data_ptr<c10::BFloat16>(), into, begin, end, width);
    else sum_rows(grad.data_ptr<float>(), into, begin, end, width);
  });
  return sums.to(grad.scalar_type());
}

// (the gradient of the ReLU's input, the bias's gradient) from the gradient of the ReLU's output
// `grad` and that output `out`, both contiguous (rows, width) of one dtype, fp32 or bf16.
std::tuple<at::Tensor, at::Tensor> relu_bias_backward(const at::Tensor& grad, const at::Tensor& out) {
  check_rows(out, "out");
  TORCH_CHECK(grad.sizes() == out.sizes() && grad.scalar_type() == out.scalar_type(), "grad: out's shape and dtype");
  check_rows(grad, "grad");
  const int64_t width = out.size(1);
  at::Tensor grad_in = at::empty_like(grad);
  at::Tensor sums = column_sums(out, [&](int64_t begin, int64_t end, float* into) {
    if (out.scalar_type() == at::kBFloat16) {
      using T = c10::BFloat16;
      relu_rows(grad.data_ptr<T>(), out.data_ptr<T>(), grad_in.data_ptr<T>(), into, begin, end, width);
    } else {
      relu_rows(grad.data_ptr<float>(), out.data_ptr<float>(), grad_in.data_ptr<float>(), into, begin, end, width);
    }
  });
  return {grad_in, sums.to(out.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("bias_backward(Tensor grad) -> Tensor");
  m.def("relu_bias_backward(Tensor grad, Tensor out) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("bias_backward", &bias_backward);
  m.impl("relu_bias_backward", &relu_bias_backward);
}
