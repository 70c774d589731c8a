// The end of a bf16 update on a CPU in two passes over the weights (training/optimizer.py says why):
// the norm of the working copy's gradients where autograd left them, then one pass that clips each
// gradient, applies Adam or AdamW to the fp32 master weights and their moments, and writes the bf16
// working copy of each weight it moved. The path before took five: the gradients gathered into one
// buffer, their norm, their widening to fp32 and clipping into another, PyTorch's fused Adam reading
// those, and the master weights cast back into the working copy.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace seq2seq_cpu;

// Blocks of this many elements of one tensor are each summed in fp32 (in kSquareLanes sums side by
// side, which vectorise); the blocks' sums are added in order in fp64, so any thread count gives the
// same bits and millions of squares keep fp32's precision.
constexpr int64_t kSquareBlock = 1 << 12, kSquareLanes = 64;

float block_square_sum(const c10::BFloat16* data, int64_t begin, int64_t end) {
  float lanes[kSquareLanes] = {};
  int64_t i = begin;
  for (; i + kSquareLanes <= end; i += kSquareLanes)
    for (int64_t lane = 0; lane < kSquareLanes; ++lane) lanes[lane] += load(data[i + lane]) * load(data[i + lane]);
  for (; i < end; ++i) lanes[0] += load(data[i]) * load(data[i]);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}

// The sum of the squares of every element of `values` (bf16 gradients, each where autograd put it), fp64.
at::Tensor square_sum(at::TensorList values) {
  TORCH_CHECK(!values.empty(), "square_sum: no tensors");
  std::vector<int64_t> first_block{0};  // tensor t's blocks are [first_block[t], first_block[t + 1])
  for (const at::Tensor& tensor : values) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous() && tensor.scalar_type() == at::kBFloat16,
                "square_sum: contiguous bf16 CPU tensors");
    first_block.push_back(first_block.back() + (tensor.numel() + kSquareBlock - 1) / kSquareBlock);
  }
  std::vector<double> partial(static_cast<size_t>(first_block.back()), 0.0);
  at::parallel_for(0, first_block.back(), 1, [&](int64_t first, int64_t last) {
    size_t t = std::upper_bound(first_block.begin(), first_block.end(), first) - first_block.begin() - 1;
    for (int64_t block = first; block < last; ++block) {
      while (block >= first_block[t + 1]) ++t;
      const int64_t begin = (block - first_block[t]) * kSquareBlock;
      const int64_t end = std::min(values[t].numel(), begin + kSquareBlock);
      partial[block] = block_square_sum(values[t].data_ptr<c10::BFloat16>(), begin, end);
    }
  });
  double total = 0.0;
  for (double block_sum : partial) total += block_sum;
  return at::scalar_tensor(total, values[0].options().dtype(at::kDouble));
}

// What one step of Adam multiplies and adds, in fp32 as PyTorch's fused CPU Adam computes it: its
// constants from fp64, and where its build fuses a product into the sum that follows (the moments and
// Adam's weight decay), so do we: the moments and weights come out as PyTorch's vector loop computes
// them (its scalar loop for a weight's last few elements rounds a little differently).
struct AdamStep {
  float grad_scale, decay, decayed_weight, beta1_weight, beta2, beta2_weight, bias2_sqrt, eps, step_size;
};

template <bool decoupled>
void adam_elements(const AdamStep& s, float* param, float* exp_avg, float* exp_avg_sq,
                   c10::BFloat16* copy, const c10::BFloat16* grad, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float g = load(grad[i]) * s.grad_scale;
    float p = param[i];
    if constexpr (decoupled) {
      p = p * s.decayed_weight;
    } else {
      g = std::fma(p, s.decay, g);
    }
    const float m = std::fma(s.beta1_weight, g - exp_avg[i], exp_avg[i]);
    const float v = std::fma(s.beta2_weight * g, g, exp_avg_sq[i] * s.beta2);
    p = p + s.step_size * m / (std::sqrt(v) / s.bias2_sqrt + s.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    store(copy + i, p);
  }
}

// One Adam (decoupled: AdamW) update of each fp32 weight in `params` from its bf16 gradient times
// `scale` (the clipping), its moments and step count updated as torch.optim.Adam's fused step updates
// them, and its bf16 working copy rewritten. Where `skipped` is set (a non-finite gradient norm),
// nothing changes, as PyTorch's fused Adam leaves all alone on its found_inf flag.
void adam_update_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList steps,
                  at::TensorList copies, at::TensorList grads, const at::Tensor& scale, const at::Tensor& skipped,
                  double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled) {
  const size_t count = params.size();
  TORCH_CHECK(exp_avgs.size() == count && exp_avg_sqs.size() == count && steps.size() == count &&
                  copies.size() == count && grads.size() == count,
              "adam_update_: one moment, step, copy and gradient per weight");
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat && skipped.numel() == 1 &&
                  skipped.scalar_type() == at::kBool,
              "adam_update_: scale one fp32 value, skipped one bool");
  for (size_t t = 0; t < count; ++t) {
    const int64_t n = params[t].numel();
    TORCH_CHECK(params[t].scalar_type() == at::kFloat && exp_avgs[t].scalar_type() == at::kFloat &&
                    exp_avg_sqs[t].scalar_type() == at::kFloat && copies[t].scalar_type() == at::kBFloat16 &&
                    grads[t].scalar_type() == at::kBFloat16 && steps[t].scalar_type() == at::kFloat,
                "adam_update_: fp32 weights, moments and steps, bf16 copies and gradients");
    TORCH_CHECK(params[t].is_contiguous() && exp_avgs[t].is_contiguous() && exp_avg_sqs[t].is_contiguous() &&
                    copies[t].is_contiguous() && grads[t].is_contiguous() && exp_avgs[t].numel() == n &&
                    exp_avg_sqs[t].numel() == n && copies[t].numel() == n && grads[t].numel() == n &&
                    steps[t].numel() == 1,
                "adam_update_: contiguous tensors of one size per weight");
  }
  if (skipped.item<bool>()) return;
  const float grad_scale = scale.item<float>();
  for (size_t t = 0; t < count; ++t) {
    float* step = steps[t].data_ptr<float>();
    *step += 1.0f;
    const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(*step));
    const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(*step));
    const AdamStep s{grad_scale,
                     static_cast<float>(weight_decay),
                     static_cast<float>(1.0 - lr * weight_decay),
                     static_cast<float>(1.0 - beta1),
                     static_cast<float>(beta2),
                     static_cast<float>(1.0 - beta2),
                     static_cast<float>(std::sqrt(bias2)),
                     static_cast<float>(eps),
                     static_cast<float>(-(lr / bias1))};
    float* param = params[t].data_ptr<float>();
    float* exp_avg = exp_avgs[t].data_ptr<float>();
    float* exp_avg_sq = exp_avg_sqs[t].data_ptr<float>();
    c10::BFloat16* copy = copies[t].data_ptr<c10::BFloat16>();
    const c10::BFloat16* grad = grads[t].data_ptr<c10::BFloat16>();
    at::parallel_for(0, params[t].numel(), 1 << 14, [&](int64_t begin, int64_t end) {
      if (decoupled) {
        adam_elements<true>(s, param, exp_avg, exp_avg_sq, copy, grad, begin, end);
      } else {
        adam_elements<false>(s, param, exp_avg, exp_avg_sq, copy, grad, begin, end);
      }
    });
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("square_sum(Tensor[] values) -> Tensor");
  m.def(
      "adam_update_(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] steps, "
      "Tensor(e!)[] copies, Tensor[] grads, Tensor scale, Tensor skipped, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool decoupled) -> ()");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("square_sum", &square_sum);
  m.impl("adam_update_", &adam_update_);
}
