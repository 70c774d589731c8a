// Attention over the flat rows of a batch of sentences, forward and backward (cpu_attention.py says
// why it exists and when it runs).
//
// Sentence b's queries are rows [start, start + length) of q, its keys and values those of its own
// span in k and v; q, k, v, the output and the gradients are (rows, heads x head_dim) matrices whose
// rows may be strided (column blocks of one projection). Each (sentence, head) pair is one task: its
// queries, keys, values, scores and probabilities (a few KB for a sentence of 40 tokens) stay in the
// core's cache through every step of its work, computed in fp32 whatever the dtype it reads and writes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

// Its loops run over a head's columns or a sentence's keys, a few vectors each: on AVX-512 they keep
// 256-bit vectors, which measured faster here than the 512 the other kernels ask for (cpu_kernels.py).
#if defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=256")
#endif

namespace {

using namespace seq2seq_cpu;

// A vector of floats as wide as the machine's registers (the compiler maps it onto them: 16 floats
// with AVX-512, 8 with AVX2, 4 otherwise); aligned(4): loads and stores at any float's address.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline int64_t round_up(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A matrix of floats read one element at a time: A[i, k] at data[i * row + k * col], so that a
// transposed matrix is the same data with its strides swapped (no copy).
struct Strided {
  const float* data;
  int64_t row, col;
  float operator()(int64_t i, int64_t k) const { return data[i * row + k * col]; }
  Strided from_row(int64_t i) const { return {data + i * row, row, col}; }
  Strided from_column(int64_t k) const { return {data + k * col, row, col}; }
  Strided transposed() const { return {data, col, row}; }
};

// C[i, j0:j0 + V * kLanes] = sum over k of A[i, k] B[k, j0:...] for R rows i from row 0: R x V vectors of
// sums held in registers while B's rows stream past. fp-contract=fast here alone: each product and sum
// becomes one fused multiply-add (the other kernels keep PyTorch's separate roundings).
template <int R, int V>
__attribute__((optimize("fp-contract=fast"))) inline void block_product(int64_t depth, Strided a, const float* b,
                                                                       int64_t ldb, float* c, int64_t ldc) {
  Vec sums[R][V] = {};
  for (int64_t k = 0; k < depth; ++k) {
    Vec columns[V];
    for (int v = 0; v < V; ++v) columns[v] = *reinterpret_cast<const Vec*>(b + k * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float scalar = a(r, k);
      for (int v = 0; v < V; ++v) sums[r][v] += scalar * columns[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) *reinterpret_cast<Vec*>(c + r * ldc + v * kLanes) = sums[r][v];
}

// The register block: kBlockRows rows x kBlockVectors vectors of sums, 24 of AVX-512's 32 vector
// registers or 12 of AVX2's 16, which leaves room for B's vectors and A's broadcasts; narrower
// blocks take the columns left over.
#if defined(__AVX512F__)
constexpr int64_t kBlockRows = 6;
constexpr int kBlockVectors = 4;
#else
constexpr int64_t kBlockRows = 6;
constexpr int kBlockVectors = 2;
#endif

template <int R>
void row_block(int64_t cols, int64_t depth, Strided a, const float* b, int64_t ldb, float* c, int64_t ldc) {
  int64_t j = 0;
  for (; j + kBlockVectors * kLanes <= cols; j += kBlockVectors * kLanes)
    block_product<R, kBlockVectors>(depth, a, b + j, ldb, c + j, ldc);
  if constexpr (kBlockVectors > 2) {
    for (; j + 2 * kLanes <= cols; j += 2 * kLanes) block_product<R, 2>(depth, a, b + j, ldb, c + j, ldc);
  }
  for (; j < cols; j += kLanes) block_product<R, 1>(depth, a, b + j, ldb, c + j, ldc);
}

// The last rows % kBlockRows rows of a product, R of them or fewer.
template <int R>
void last_rows(int64_t rows, int64_t cols, int64_t depth, Strided a, const float* b, int64_t ldb, float* c,
               int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) row_block<R>(cols, depth, a, b, ldb, c, ldc);
    else last_rows<R - 1>(rows, cols, depth, a, b, ldb, c, ldc);
  }
}

// What a causal task's product may leave out, row block by row block, where the terms it skips are
// the zeros (or masked scores) above the diagonal: nothing (kAll); the columns past the block's last
// row (kColumnsToRow: scores, whose masked ones softmax never reads); the depth past it (kDepthToRow:
// rows of probabilities, zero past the diagonal); the depth before its first row (kDepthFromRow:
// their transposes). Skipping leading or trailing zero terms leaves every sum's bits as they were.
enum class Causal { kAll, kColumnsToRow, kDepthToRow, kDepthFromRow };

// C (rows x cols) = A (rows x depth) B (depth x cols); B and C row-major with row strides ldb, ldc, and
// cols a multiple of kLanes (the buffers pad their columns).
void product(int64_t rows, int64_t cols, int64_t depth, Strided a, const float* b, int64_t ldb, float* c,
             int64_t ldc, Causal causal = Causal::kAll) {
  for (int64_t i = 0; i < rows; i += kBlockRows) {
    const int64_t count = std::min(kBlockRows, rows - i), reach = i + count;
    int64_t block_cols = cols, block_depth = depth, first = 0;
    if (causal == Causal::kColumnsToRow) block_cols = std::min(cols, round_up(reach));
    if (causal == Causal::kDepthToRow) block_depth = std::min(depth, reach);
    if (causal == Causal::kDepthFromRow) first = std::min(depth, i);
    const Strided block_a = a.from_row(i).from_column(first);
    if (count == kBlockRows)
      row_block<kBlockRows>(block_cols, block_depth - first, block_a, b + first * ldb, ldb, c + i * ldc, ldc);
    else
      last_rows<kBlockRows - 1>(count, block_cols, block_depth - first, block_a, b + first * ldb, ldb, c + i * ldc,
                                ldc);
  }
}

// A row-major matrix with row stride `stride`.
Strided rows_of(const float* data, int64_t stride) { return {data, stride, 1}; }

// rows x width of `source` (row stride `stride`) into `out` (row stride out_stride) as floats; out's
// padding columns are left as they were.
template <typename T>
void read_rows(const T* source, int64_t stride, int64_t rows, int64_t width, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) out[r * out_stride + d] = load(source[r * stride + d]);
}

// out[d][r] = rows[r][d] for the rows x width floats of `rows` (row stride rows_stride), in cache.
void transpose(const float* rows, int64_t rows_stride, int64_t count, int64_t width, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t d = 0; d < width; ++d) out[d * out_stride + r] = rows[r * rows_stride + d];
}

template <typename T>
void write_rows(const float* values, int64_t values_stride, int64_t rows, int64_t width, T* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) store(out + r * stride + d, values[r * values_stride + d]);
}

// One sentence and head: its shapes and where its rows lie.
struct Task {
  int64_t queries, keys, head_dim, padded_dim, padded_keys;
  int64_t query_row, key_row, column;
  int64_t kept_at;  // where its (queries, padded_keys) probabilities lie in the forward pass's kept ones
  bool causal;
  float scale;
  // Keys that query i sees: all of them, or (causal) those at or before it.
  int64_t visible(int64_t i) const { return causal ? std::min(i + 1, keys) : keys; }
};

// Scratch floats of one thread, grown to the largest task it meets. A task asks for all it needs
// first (start), then takes it in pieces. It reads no float that it did not write: padding columns
// (of head_dim, of keys) are computed from whatever they hold and never read back.
class Scratch {
 public:
  void start(int64_t total) {
    if (total > static_cast<int64_t>(floats_.size())) floats_.resize(total);
    used_ = 0;
  }
  float* take(int64_t count) {
    float* out = floats_.data() + used_;
    used_ += count;
    TORCH_INTERNAL_ASSERT(used_ <= static_cast<int64_t>(floats_.size()));
    return out;
  }

 private:
  std::vector<float> floats_;
  int64_t used_ = 0;
};

// probabilities = softmax(scale * q k^T) over the visible keys, zero elsewhere, from scores q k^T in
// place; each row's log of its sum of exponentials (in scaled units, after the max) into lse. Each
// loop runs over the whole padded row, whole vectors, and masks the columns past the visible keys
// (whatever they hold, even a NaN, is selected away): no scalar tail of exponentials.
void softmax_rows(const Task& t, float* scores, float* lse) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < t.queries; ++i) {
    float* row = scores + i * t.padded_keys;
    const int64_t visible = t.visible(i);
    float largest = kNone;
#pragma omp simd reduction(max : largest)
    for (int64_t j = 0; j < t.padded_keys; ++j) largest = std::max(largest, j < visible ? row[j] * t.scale : kNone);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < t.padded_keys; ++j) {
      row[j] = j < visible ? exp_nonpositive(row[j] * t.scale - largest) : 0.0f;
      sum += row[j];
    }
    const float inverse = visible ? 1.0f / sum : 0.0f;
#pragma omp simd
    for (int64_t j = 0; j < t.padded_keys; ++j) row[j] *= inverse;
    lse[i] = visible ? largest + std::log(sum) : std::numeric_limits<float>::infinity();
  }
}

// The probabilities again, from the scores q k^T in place and the forward pass's lse (masked as above).
void probabilities_from_lse(const Task& t, float* scores, const float* lse) {
  for (int64_t i = 0; i < t.queries; ++i) {
    float* row = scores + i * t.padded_keys;
    const int64_t visible = t.visible(i);
#pragma omp simd
    for (int64_t j = 0; j < t.padded_keys; ++j) row[j] = j < visible ? exp_nonpositive(row[j] * t.scale - lse[i]) : 0.0f;
  }
}

// kept: where this task's probabilities are kept for the backward pass (the scores are computed there
// and turned into them in place), or null: in the thread's scratch, and dropped.
template <typename T>
void forward_task(const Task& t, const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v,
                  int64_t v_stride, T* out, int64_t out_stride, float* lse, float* kept, Scratch& scratch) {
  const int64_t dim = t.padded_dim, keys = t.padded_keys, queries = t.queries;
  scratch.start(2 * queries * dim + 3 * dim * keys + (kept ? 0 : queries * keys));
  float* query = scratch.take(queries * dim);
  float* key = scratch.take(keys * dim);
  float* keys_t = scratch.take(dim * keys);  // (head_dim, keys): scores = query keys_t
  float* value = scratch.take(keys * dim);
  float* scores = kept ? kept : scratch.take(queries * keys);
  float* output = scratch.take(queries * dim);
  read_rows(q + t.query_row * q_stride + t.column, q_stride, queries, t.head_dim, query, dim);
  read_rows(k + t.key_row * k_stride + t.column, k_stride, t.keys, t.head_dim, key, dim);
  transpose(key, dim, t.keys, t.head_dim, keys_t, keys);
  read_rows(v + t.key_row * v_stride + t.column, v_stride, t.keys, t.head_dim, value, dim);
  const Causal columns = t.causal ? Causal::kColumnsToRow : Causal::kAll;
  product(queries, keys, t.head_dim, rows_of(query, dim), keys_t, keys, scores, keys, columns);
  softmax_rows(t, scores, lse);
  product(queries, dim, t.keys, rows_of(scores, keys), value, dim, output, dim,
          t.causal ? Causal::kDepthToRow : Causal::kAll);
  write_rows(output, dim, queries, t.head_dim, out + t.query_row * out_stride + t.column, out_stride);
}

// The gradients of one task, with D_i = sum_j P_ij dP_ij (= dO_i . O_i, without keeping O):
// dP = dO v^T, dS = P (dP - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dO. P is the forward
// pass's where it kept them (kept), else recomputed from the scores and lse.
template <typename T>
void backward_task(const Task& t, const T* grad_out, int64_t g_stride, const T* q, int64_t q_stride, const T* k,
                   int64_t k_stride, const T* v, int64_t v_stride, const float* lse, const float* kept, T* grad_q,
                   int64_t gq_stride, T* grad_k, int64_t gk_stride, T* grad_v, int64_t gv_stride, Scratch& scratch) {
  const int64_t dim = t.padded_dim, keys = t.padded_keys, queries = t.queries;
  scratch.start(3 * queries * dim + 4 * dim * keys + (kept ? 1 : 2) * queries * keys);
  float* query = scratch.take(queries * dim);
  float* grad_output = scratch.take(queries * dim);
  float* keys_t = scratch.take(dim * keys);
  float* values_t = scratch.take(dim * keys);
  float* key = scratch.take(keys * dim);
  float* recomputed = kept ? nullptr : scratch.take(queries * keys);
  const float* probs = kept ? kept : recomputed;
  float* grad_scores = scratch.take(queries * keys);
  float* result = scratch.take(keys * dim);           // dv, then dk
  float* result_q = scratch.take(queries * dim);
  read_rows(q + t.query_row * q_stride + t.column, q_stride, queries, t.head_dim, query, dim);
  read_rows(grad_out + t.query_row * g_stride + t.column, g_stride, queries, t.head_dim, grad_output, dim);
  read_rows(k + t.key_row * k_stride + t.column, k_stride, t.keys, t.head_dim, key, dim);
  transpose(key, dim, t.keys, t.head_dim, keys_t, keys);
  read_rows(v + t.key_row * v_stride + t.column, v_stride, t.keys, t.head_dim, result, dim);  // result: V here
  transpose(result, dim, t.keys, t.head_dim, values_t, keys);

  const Causal columns = t.causal ? Causal::kColumnsToRow : Causal::kAll;
  if (!kept) {
    product(queries, keys, t.head_dim, rows_of(query, dim), keys_t, keys, recomputed, keys, columns);
    probabilities_from_lse(t, recomputed, lse);
  }
  product(queries, keys, t.head_dim, rows_of(grad_output, dim), values_t, keys, grad_scores, keys, columns);
  for (int64_t i = 0; i < queries; ++i) {
    const float* p = probs + i * keys;
    float* g = grad_scores + i * keys;
    const int64_t visible = t.visible(i);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < visible; ++j) total += p[j] * g[j];
#pragma omp simd
    for (int64_t j = 0; j < visible; ++j) g[j] = t.scale * p[j] * (g[j] - total);
    for (int64_t j = visible; j < t.keys; ++j) g[j] = 0.0f;
  }
  const Causal from_row = t.causal ? Causal::kDepthFromRow : Causal::kAll;
  product(t.keys, dim, queries, rows_of(probs, keys).transposed(), grad_output, dim, result, dim, from_row);
  write_rows(result, dim, t.keys, t.head_dim, grad_v + t.key_row * gv_stride + t.column, gv_stride);
  product(t.keys, dim, queries, rows_of(grad_scores, keys).transposed(), query, dim, result, dim, from_row);
  write_rows(result, dim, t.keys, t.head_dim, grad_k + t.key_row * gk_stride + t.column, gk_stride);
  product(queries, dim, t.keys, rows_of(grad_scores, keys), key, dim, result_q, dim,
          t.causal ? Causal::kDepthToRow : Causal::kAll);
  write_rows(result_q, dim, queries, t.head_dim, grad_q + t.query_row * gq_stride + t.column, gq_stride);
}

// spans (sentences, 2): [first row, rows] of each sentence, in order and without gaps from row 0.
int64_t check_spans(const at::Tensor& spans, const char* name) {
  TORCH_CHECK(spans.device().is_cpu() && spans.dim() == 2 && spans.size(1) == 2 &&
                  spans.scalar_type() == at::kLong && spans.is_contiguous(),
              name, ": a contiguous (sentences, 2) int64 CPU tensor");
  const int64_t* s = spans.data_ptr<int64_t>();
  int64_t next = 0;
  for (int64_t b = 0; b < spans.size(0); ++b) {
    TORCH_CHECK(s[2 * b] == next && s[2 * b + 1] >= 0, name, ": sentences must follow each other from row 0");
    next += s[2 * b + 1];
  }
  return next;
}

void check_matrix(const at::Tensor& x, const at::Tensor& like, int64_t rows, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == like.scalar_type() &&
                  x.size(1) == like.size(1) && x.size(0) >= rows,
              name, ": a CPU matrix with unit column stride, of q's dtype and width, holding every span's rows");
}

struct Layout {
  int64_t sentences, heads, head_dim, used_queries, used_keys;
  at::Tensor query_spans, key_spans;
  bool causal;
  // Where each sentence's probabilities begin among the kept ones (its heads' one after the other),
  // and after the last, how many floats they all take.
  std::vector<int64_t> kept_starts;
};

Layout check_layout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& query_spans,
                    const at::Tensor& key_spans, int64_t heads, bool causal) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q: fp32 or bf16");
  TORCH_CHECK(heads > 0 && q.size(1) % heads == 0, "heads must divide q's width");
  TORCH_CHECK(query_spans.size(0) == key_spans.size(0), "one key span per query span");
  const int64_t used_queries = check_spans(query_spans, "query_spans");
  const int64_t used_keys = check_spans(key_spans, "key_spans");
  check_matrix(q, q, used_queries, "q");
  check_matrix(k, q, used_keys, "k");
  check_matrix(v, q, used_keys, "v");
  if (causal) TORCH_CHECK(query_spans.equal(key_spans), "causal attention: queries and keys of the same rows");
  const int64_t sentences = query_spans.size(0);
  std::vector<int64_t> kept_starts(static_cast<size_t>(sentences + 1), 0);
  const int64_t* qs = query_spans.data_ptr<int64_t>();
  const int64_t* ks = key_spans.data_ptr<int64_t>();
  for (int64_t b = 0; b < sentences; ++b)
    kept_starts[b + 1] = kept_starts[b] + heads * qs[2 * b + 1] * round_up(ks[2 * b + 1]);
  return {sentences, heads, q.size(1) / heads, used_queries, used_keys, query_spans, key_spans, causal, kept_starts};
}

// work(T{}) with T the element type of x: float or c10::BFloat16.
template <typename Work>
void for_each_dtype(const at::Tensor& x, Work work) {
  if (x.scalar_type() == at::kBFloat16) work(c10::BFloat16{});
  else work(0.0f);
}

template <typename Work>
void for_each_task(const Layout& layout, Work work) {
  const int64_t* qs = layout.query_spans.data_ptr<int64_t>();
  const int64_t* ks = layout.key_spans.data_ptr<int64_t>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
  // Each task writes only its own rows and columns, from its own inputs: any thread count gives
  // the same result.
  at::parallel_for(0, layout.sentences * layout.heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / layout.heads, h = task % layout.heads;
      const int64_t keys = ks[2 * b + 1];
      const int64_t queries = qs[2 * b + 1], padded_keys = round_up(keys);
      const Task t{queries, keys, layout.head_dim, round_up(layout.head_dim), padded_keys,
                   qs[2 * b], ks[2 * b], h * layout.head_dim, layout.kept_starts[b] + h * queries * padded_keys,
                   layout.causal, scale};
      work(t, h, scratch);
    }
  });
}

// (out, lse, kept): out (q's rows, width), attention of each sentence's queries to its keys, zero in
// rows after the last span; lse (heads, q's rows), what the backward pass recomputes the probabilities
// from; kept, the probabilities themselves in fp32 (each task's (queries, padded keys), Layout's
// order) where they take at most max_kept_bytes, so that the backward pass reads them instead of
// computing q k^T and its exponentials again, else empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& query_spans,
                                                         const at::Tensor& key_spans, int64_t heads, bool causal,
                                                         int64_t max_kept_bytes) {
  const Layout layout = check_layout(q, k, v, query_spans, key_spans, heads, causal);
  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  at::Tensor lse = at::empty({heads, q.size(0)}, q.options().dtype(at::kFloat));
  const int64_t kept_floats = layout.kept_starts.back();
  const bool keeps = kept_floats * static_cast<int64_t>(sizeof(float)) <= max_kept_bytes;
  at::Tensor kept = at::empty({keeps ? kept_floats : 0}, q.options().dtype(at::kFloat));
  out.narrow(0, layout.used_queries, q.size(0) - layout.used_queries).zero_();
  float* lse_data = lse.data_ptr<float>();
  float* kept_data = keeps ? kept.data_ptr<float>() : nullptr;
  for_each_dtype(q, [&](auto zero) {
    using scalar_t = decltype(zero);
    for_each_task(layout, [&](const Task& t, int64_t h, Scratch& scratch) {
      forward_task(t, q.data_ptr<scalar_t>(), q.stride(0), k.data_ptr<scalar_t>(), k.stride(0),
                   v.data_ptr<scalar_t>(), v.stride(0), out.data_ptr<scalar_t>(), out.stride(0),
                   lse_data + h * q.size(0) + t.query_row, keeps ? kept_data + t.kept_at : nullptr, scratch);
    });
  });
  return {out, lse, kept};
}

// The gradients of q, k and v written into grad_q, grad_k, grad_v (which may be column blocks of one
// tensor): every span's rows, and zeros in the rows after the last span.
void attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& lse, const at::Tensor& kept, const at::Tensor& query_spans,
                        const at::Tensor& key_spans, int64_t heads, bool causal, at::Tensor grad_q,
                        at::Tensor grad_k, at::Tensor grad_v) {
  const Layout layout = check_layout(q, k, v, query_spans, key_spans, heads, causal);
  const int64_t used_keys = layout.used_keys;
  check_matrix(grad_out, q, layout.used_queries, "grad_out");
  check_matrix(grad_q, q, layout.used_queries, "grad_q");
  check_matrix(grad_k, q, used_keys, "grad_k");
  check_matrix(grad_v, q, used_keys, "grad_v");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.size(0) == heads &&
                  lse.size(1) == q.size(0),
              "lse: the forward pass's (heads, rows) fp32");
  const bool keeps = kept.numel() > 0;
  TORCH_CHECK(kept.scalar_type() == at::kFloat && kept.is_contiguous() &&
                  (!keeps || kept.numel() == layout.kept_starts.back()),
              "kept: the forward pass's kept probabilities, or empty");
  const float* kept_data = keeps ? kept.data_ptr<float>() : nullptr;
  grad_q.narrow(0, layout.used_queries, grad_q.size(0) - layout.used_queries).zero_();
  grad_k.narrow(0, used_keys, grad_k.size(0) - used_keys).zero_();
  grad_v.narrow(0, used_keys, grad_v.size(0) - used_keys).zero_();
  const float* lse_data = lse.data_ptr<float>();
  for_each_dtype(q, [&](auto zero) {
    using scalar_t = decltype(zero);
    for_each_task(layout, [&](const Task& t, int64_t h, Scratch& scratch) {
      backward_task(t, grad_out.data_ptr<scalar_t>(), grad_out.stride(0), q.data_ptr<scalar_t>(), q.stride(0),
                    k.data_ptr<scalar_t>(), k.stride(0), v.data_ptr<scalar_t>(), v.stride(0),
                    lse_data + h * q.size(0) + t.query_row, keeps ? kept_data + t.kept_at : nullptr,
                    grad_q.data_ptr<scalar_t>(), grad_q.stride(0),
                    grad_k.data_ptr<scalar_t>(), grad_k.stride(0), grad_v.data_ptr<scalar_t>(), grad_v.stride(0),
                    scratch);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor query_spans, Tensor key_spans, int heads, bool causal,"
        " int max_kept_bytes) -> (Tensor, Tensor, Tensor)");
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor kept,"
        " Tensor query_spans, Tensor key_spans, int heads, bool causal, Tensor(a!) grad_q, Tensor(b!) grad_k,"
        " Tensor(c!) grad_v) -> ()");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
}
