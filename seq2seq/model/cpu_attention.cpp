// Attention over the flat rows of a batch of sentences, forward and backward (cpu_attention.py says
// why it exists and when it runs).
//
// Sentence b's queries are rows [start, start + length) of q, its keys and values those of its own
// span in k and v; q, k, v, the output and the gradients are (rows, heads x head_dim) matrices whose
// rows may be strided (column blocks of one projection). Each (sentence, head) pair is one task: its
// queries, keys, values, scores and probabilities (a few KB for a sentence of 40 tokens) stay in the
// core's cache through every step of its work, computed in fp32 whatever the dtype it reads and writes
// (bf16 on AMX: its products take bf16 operands on the tiles and sum in fp32; see SEQ2SEQ_TILES).

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
#include <type_traits>
#include <vector>

// AVX-512 with its byte and word instructions (BW) on 256-bit vectors too (VL): transposes are blocks
// of 16 x 16 values moved in registers (transpose_blocks). Every CPU with AMX has them.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SEQ2SEQ_BLOCK_TRANSPOSES 1
#endif

// AMX's tile instructions (Intel Xeon from Sapphire Rapids): a bf16 product of 16 x 32 by 32 x 16 in one
// instruction. Where the kernels are built for them, bf16 attention computes its six products on them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(SEQ2SEQ_BLOCK_TRANSPOSES)
#include <sys/syscall.h>
#include <unistd.h>
#define SEQ2SEQ_TILES 1
#endif

// Its loops run over a head's columns or a sentence's keys, a few vectors each: on AVX-512 they keep
// 256-bit vectors, which measured faster here than the 512 the other kernels ask for (cpu_kernels.py);
// the setting ends with this file, which is compiled with the others in one unit.
#pragma GCC push_options
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
// cols a multiple of kLanes (the buffers pad their columns). A causal product's row 0 is the task's
// query first_row (a block of a long sentence's queries starts past 0).
void product(int64_t rows, int64_t cols, int64_t depth, Strided a, const float* b, int64_t ldb, float* c,
             int64_t ldc, Causal causal = Causal::kAll, int64_t first_row = 0) {
  for (int64_t i = 0; i < rows; i += kBlockRows) {
    const int64_t count = std::min(kBlockRows, rows - i), reach = first_row + i + count;
    int64_t block_cols = cols, block_depth = depth, first = 0;
    if (causal == Causal::kColumnsToRow) block_cols = std::min(cols, round_up(reach));
    if (causal == Causal::kDepthToRow) block_depth = std::min(depth, reach);
    if (causal == Causal::kDepthFromRow) first = std::min(depth, first_row + i);
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

// A task reads a head's columns of each of its rows, a cache line or two a row, each a row's stride
// from the last: no pattern the hardware's prefetchers foresee, and each read waited for its lines.
// The reads ask for the lines kRowsAhead rows ahead of the one they read, and before a task computes,
// it asks for the next task's (for_each_task): each alone left part of the wait (benchmark_attention).
constexpr int64_t kRowsAhead = 8;

// The lines of row[0, width), into the first-level cache (locality 3) or the second (2).
template <int Locality = 3, typename T>
inline void prefetch_row(const T* row, int64_t width) {
  const char* first = reinterpret_cast<const char*>(row);
  const char* last = reinterpret_cast<const char*>(row + width) - 1;
  for (const char* line = first; line < last; line += 64) __builtin_prefetch(line, 0, Locality);
  __builtin_prefetch(last, 0, Locality);
}

// rows x width of `source` (row stride `stride`) into `out` (row stride out_stride) as floats; out's
// padding columns are left as they were.
template <typename T>
void read_rows(const T* source, int64_t stride, int64_t rows, int64_t width, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < std::min(rows, kRowsAhead); ++r) prefetch_row(source + r * stride, width);
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kRowsAhead < rows) prefetch_row(source + (r + kRowsAhead) * stride, width);
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) out[r * out_stride + d] = load(source[r * stride + d]);
  }
}

#if defined(SEQ2SEQ_BLOCK_TRANSPOSES)
constexpr int64_t kBlock = 16;  // 32-bit values in a 512-bit register

// The first `count` of a block's 16 lanes.
inline __mmask16 lanes(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// rows[i] lane j -> rows[j] lane i, for 16 registers of 16 32-bit values (floats or any 32 bits):
// interleaved in pairs, then quads, then 128-bit quarters, then halves.
inline void transpose16(__m512 rows[kBlock]) {
  __m512 t[kBlock];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    rows[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    rows[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    rows[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(rows[i], rows[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(rows[i], rows[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(rows[i + 8], rows[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(rows[i + 8], rows[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    rows[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    rows[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The transpose of a rows x cols matrix of 32-bit values, 16 x 16 at a time in registers:
// load(i, j, mask) gives row i's values from column j (16 lanes, those past `mask` zero) and
// store(j, i, mask, vector) writes the transpose's row j from its column i: a few dozen shuffles
// for 256 values, where a scalar loop took each value alone through memory (benchmark_attention).
template <typename Load, typename Store>
inline void transpose_blocks(int64_t rows, int64_t cols, Load load, Store store) {
  for (int64_t i = 0; i < rows; i += kBlock) {
    const int64_t block_rows = std::min(kBlock, rows - i);
    for (int64_t j = 0; j < cols; j += kBlock) {
      const int64_t block_cols = std::min(kBlock, cols - j);
      __m512 block[kBlock];
      for (int64_t r = 0; r < kBlock; ++r)
        block[r] = r < block_rows ? load(i + r, j, lanes(block_cols)) : _mm512_setzero_ps();
      transpose16(block);
      for (int64_t c = 0; c < block_cols; ++c) store(j + c, i, lanes(block_rows), block[c]);
    }
  }
}

inline __m512 load_floats(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_floats(const c10::BFloat16* p, __mmask16 mask) {  // widened exactly: bf16 bits, then zeros
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
#endif

// out[d][r] = source[r][d] as floats, for the rows x width of `source` (row stride `stride`): the keys'
// or values' transpose read straight from their rows; out's padding columns are left as they were.
// With AVX-512 a block of 16 rows at a time, asking for the next block's lines as it reads each row.
template <typename T>
void read_transposed(const T* source, int64_t stride, int64_t rows, int64_t width, float* out, int64_t out_stride) {
#if defined(SEQ2SEQ_BLOCK_TRANSPOSES)
  transpose_blocks(
      rows, width,
      [&](int64_t r, int64_t d, __mmask16 mask) {
        if (d == 0 && r + kBlock < rows) prefetch_row(source + (r + kBlock) * stride, width);  // the next block's row
        return load_floats(source + r * stride + d, mask);
      },
      [&](int64_t d, int64_t r, __mmask16 mask, __m512 values) {
        _mm512_mask_storeu_ps(out + d * out_stride + r, mask, values);
      });
#else
  for (int64_t r = 0; r < std::min(rows, kRowsAhead); ++r) prefetch_row(source + r * stride, width);
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kRowsAhead < rows) prefetch_row(source + (r + kRowsAhead) * stride, width);
    for (int64_t d = 0; d < width; ++d) out[d * out_stride + r] = load(source[r * stride + d]);
  }
#endif
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
  int64_t first_query = 0;  // the sentence's query that is this task's query 0 (queries_from)
  // Keys that query i sees: all of them, or (causal) those at or before it.
  int64_t visible(int64_t i) const { return causal ? std::min(first_query + i + 1, keys) : keys; }
  // The task of `count` of its queries from its query `first`, with the same keys.
  Task queries_from(int64_t first, int64_t count) const {
    Task part = *this;
    part.queries = count;
    part.query_row += first;
    part.first_query += first;
    return part;
  }
};

// The most scores a forward task holds at once where it keeps none (4 MB): a long sentence's queries
// take turns in blocks of rows, so that its scratch grows with its length, not with its square (a
// line of 100,000 pieces asked for 40 GB a head). A block holds a whole number of the products'
// register blocks of kBlockRows rows, so that each query's row is computed by the same register
// block, over the same depth, as in the whole task, and the blocks give the same bits as the whole
// (blocks of 949 rows put row 948 in a register block of its own, whose sums, on an AVX2 build,
// differed in the last bit from those of the 6-row block that holds it in the whole task).
constexpr int64_t kScoreFloats = int64_t{1} << 20;

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
  // count bf16 values (their bits), in the floats of count / 2 rounded up.
  uint16_t* take_bf16(int64_t count) { return reinterpret_cast<uint16_t*>(take(halves(count))); }
  static int64_t halves(int64_t count) { return (count + 1) / 2; }

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

// dS = scale P (dP - D) in place of dP (grad_scores), D_i = sum_j P_ij dP_ij; zero past the visible keys.
void gradients_of_scores(const Task& t, const float* probs, float* grad_scores) {
  for (int64_t i = 0; i < t.queries; ++i) {
    const float* p = probs + i * t.padded_keys;
    float* g = grad_scores + i * t.padded_keys;
    const int64_t visible = t.visible(i);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < visible; ++j) total += p[j] * g[j];
#pragma omp simd
    for (int64_t j = 0; j < visible; ++j) g[j] = t.scale * p[j] * (g[j] - total);
    for (int64_t j = visible; j < t.keys; ++j) g[j] = 0.0f;
  }
}

#if defined(SEQ2SEQ_TILES)
// Tile products: bf16 operands in, fp32 sums out, for a task whose inputs are bf16 already (fp32 ones
// keep the fp32 products above, which round nothing). q, k, v and the output gradient enter the tiles
// as they are; the probabilities and their gradients are rounded to bf16 on the way in, as a bf16
// flash attention rounds them. AVX-512 comes with AMX, so the padded rows and columns are 16 floats.
static_assert(kLanes == 16, "a tile row holds 16 floats");
constexpr int64_t kTileRows = 16, kTileDepth = 32;  // C tiles 16 x 16 fp32, A tiles 16 x 32 bf16

inline int64_t round_to(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Linux lends a process AMX's tile registers only once it asks (the state is large to save on a switch).
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// A task of fewer than 16 queries or keys fills a tile's 16 rows and 32-deep sums mostly with zeros:
// the fp32 products, on blocks of 6 rows, were faster for it (sentences of 8 tokens) or as fast (12).
bool tiles_worth_it(const Task& t) { return t.queries >= kTileRows && t.keys >= kTileRows && tiles_permitted(); }

// Tiles 0 and 1: sums (16 rows x 16 floats); 2: A's rows (16 x 32 bf16); 3 and 4: B's pairs of rows
// (16 x 16 pairs). A task loads the configuration when it starts (a product of PyTorch's on the same
// thread may have loaded its own) and releases the tiles when it ends.
class TileSession {
 public:
  TileSession() {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    for (int tile = 0; tile < 5; ++tile) {
      config[16 + 2 * tile] = 64;  // bytes per row
      config[48 + tile] = kTileRows;
    }
    _tile_loadconfig(config);
  }
  ~TileSession() { _tile_release(); }
};

inline uint16_t bf16_bits(c10::BFloat16 value) { return value.x; }
inline uint16_t bf16_bits(float value) {
  c10::BFloat16 rounded;
  store(&rounded, value);
  return rounded.x;
}

// A (rows_pad x cols_pad bf16, row-major) from rows x cols of src (row stride `stride`), zero elsewhere:
// padding multiplies as zero.
template <typename T>
void pack_a(const T* src, int64_t stride, int64_t rows, int64_t cols, int64_t rows_pad, int64_t cols_pad,
            uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = out + r * cols_pad;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) row[c] = bf16_bits(src[r * stride + c]);
    std::fill(row + cols, row + cols_pad, uint16_t{0});
  }
  std::fill(out + rows * cols_pad, out + rows_pad * cols_pad, uint16_t{0});
}

// 16 floats rounded to bf16 as store() rounds each (to the nearest, ties to even), as 16 bf16 bits.
inline __m256i bf16_bits(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounding = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16));
}

// A as pack_a makes it, from the transpose of src: A[r][c] = src[c * stride + r].
void pack_a_transposed(const float* src, int64_t stride, int64_t rows, int64_t cols, int64_t rows_pad,
                       int64_t cols_pad, uint16_t* out) {
  std::fill(out, out + rows_pad * cols_pad, uint16_t{0});
  transpose_blocks(
      cols, rows, [&](int64_t c, int64_t r, __mmask16 mask) { return load_floats(src + c * stride + r, mask); },
      [&](int64_t r, int64_t c, __mmask16 mask, __m512 values) {
        _mm256_mask_storeu_epi16(out + r * cols_pad + c, mask, bf16_bits(values));
      });
}

// B (depth x cols) in the tiles' layout: depth_pad / 2 rows of cols_pad pairs (B[2i][n], B[2i + 1][n]),
// each pair one 32-bit word, B's rows those of src (row stride `stride`), zero past depth and cols.
void pack_b(const c10::BFloat16* src, int64_t stride, int64_t depth, int64_t cols, int64_t depth_pad, int64_t cols_pad,
            uint16_t* out) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(out);
  for (int64_t i = 0; i < depth_pad / 2; ++i) {
    uint32_t* row = pairs + i * cols_pad;
    const c10::BFloat16* even = src + 2 * i * stride;
    const c10::BFloat16* odd = even + stride;
    if (2 * i + 1 < depth) {
#pragma omp simd
      for (int64_t n = 0; n < cols; ++n) row[n] = even[n].x | static_cast<uint32_t>(odd[n].x) << 16;
    } else if (2 * i < depth) {
#pragma omp simd
      for (int64_t n = 0; n < cols; ++n) row[n] = even[n].x;
    } else {
      std::fill(row, row + cols, 0u);
    }
    std::fill(row + cols, row + cols_pad, 0u);
  }
}

// B as pack_b makes it, from the transpose of src: B[d][n] = src[n * stride + d] (each of src's rows
// gives B a column, its pairs of elements read as they lie).
void pack_b_transposed(const c10::BFloat16* src, int64_t stride, int64_t depth, int64_t cols, int64_t depth_pad,
                       int64_t cols_pad, uint16_t* out) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(out);
  std::fill(pairs, pairs + depth_pad / 2 * cols_pad, 0u);
  // src's row n read as 32-bit words, each a pair (element 2i in its low half), is B's column n of pairs
  transpose_blocks(
      cols, depth / 2,
      [&](int64_t n, int64_t i, __mmask16 mask) {
        if (i == 0 && n + kBlock < cols) prefetch_row(src + (n + kBlock) * stride, depth);  // the next block's row
        return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, src + n * stride + 2 * i));
      },
      [&](int64_t i, int64_t n, __mmask16 mask, __m512 words) {
        _mm512_mask_storeu_epi32(pairs + i * cols_pad + n, mask, _mm512_castps_si512(words));
      });
  if (depth % 2)
    for (int64_t n = 0; n < cols; ++n) pairs[depth / 2 * cols_pad + n] = src[n * stride + depth - 1].x;
}

template <int Tile>
void store_tile(float* base, int64_t ldc) {
  static_assert(Tile == 0 || Tile == 1);  // the intrinsic names its tile by a literal
  if constexpr (Tile == 0) _tile_stored(0, base, ldc * sizeof(float));
  else _tile_stored(1, base, ldc * sizeof(float));
}

// The 16 x 16 sums of tile `Tile` into rows [0, rows) of c (rows < 16: through a buffer, so that
// nothing past them is written: c may be the kept probabilities, whose next rows are another task's).
template <int Tile>
void store_sums(float* c, int64_t ldc, int64_t rows) {
  if (rows >= kTileRows) {
    store_tile<Tile>(c, ldc);
    return;
  }
  alignas(64) float block[kTileRows * kTileRows];
  store_tile<Tile>(block, kTileRows);
  for (int64_t r = 0; r < rows; ++r) std::copy(block + r * kTileRows, block + (r + 1) * kTileRows, c + r * ldc);
}

// C (rows x cols fp32, row stride ldc) = A B: A packed by pack_a (round_to(rows, 16) x depth, depth a
// multiple of 32), B by pack_b (depth x cols, cols a multiple of 16). Two 16-column blocks at a time,
// A's tile loaded once for both. `causal` leaves out what product() does, by whole tiles.
void tile_product(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, const uint16_t* b, float* c,
                  int64_t ldc, Causal causal = Causal::kAll) {
  const int64_t a_bytes = depth * 2, b_bytes = cols * 4;  // row strides
  for (int64_t i = 0; i < rows; i += kTileRows) {
    const int64_t reach = i + kTileRows;
    int64_t last_col = cols, first = 0, last = depth;
    if (causal == Causal::kColumnsToRow) last_col = std::min(cols, reach);
    if (causal == Causal::kDepthToRow) last = std::min(depth, round_to(reach, kTileDepth));
    if (causal == Causal::kDepthFromRow) first = std::min(depth, i / kTileDepth * kTileDepth);
    const uint16_t* a_rows = a + i * depth;
    int64_t j = 0;
    for (; j + 2 * kLanes <= last_col; j += 2 * kLanes) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = first; k < last; k += kTileDepth) {
        _tile_loadd(2, a_rows + k, a_bytes);
        _tile_loadd(3, b + k * cols + 2 * j, b_bytes);
        _tile_loadd(4, b + k * cols + 2 * (j + kLanes), b_bytes);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      store_sums<0>(c + i * ldc + j, ldc, rows - i);
      store_sums<1>(c + i * ldc + j + kLanes, ldc, rows - i);
    }
    if (j < last_col) {
      _tile_zero(0);
      for (int64_t k = first; k < last; k += kTileDepth) {
        _tile_loadd(2, a_rows + k, a_bytes);
        _tile_loadd(3, b + k * cols + 2 * j, b_bytes);
        _tile_dpbf16ps(0, 2, 3);
      }
      store_sums<0>(c + i * ldc + j, ldc, rows - i);
    }
  }
}

// forward_task on tiles: scores = q k^T, probabilities in place, output = P v.
void forward_task_tiles(const Task& t, const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k,
                        int64_t k_stride, const c10::BFloat16* v, int64_t v_stride, c10::BFloat16* out,
                        int64_t out_stride, float* lse, float* kept, Scratch& scratch) {
  const int64_t dim = t.padded_dim, keys = t.padded_keys, queries = t.queries;
  const int64_t rows = round_to(queries, kTileRows), dim_depth = round_to(t.head_dim, kTileDepth);
  const int64_t key_depth = round_to(t.keys, kTileDepth);
  const int64_t bf16s = rows * dim_depth + dim_depth * keys + rows * key_depth + key_depth * dim;
  scratch.start(Scratch::halves(bf16s) + (kept ? 0 : queries * keys) + queries * dim);
  uint16_t* query = scratch.take_bf16(rows * dim_depth);
  uint16_t* keys_t = scratch.take_bf16(dim_depth * keys);
  uint16_t* probs = scratch.take_bf16(rows * key_depth);
  uint16_t* value = scratch.take_bf16(key_depth * dim);
  float* scores = kept ? kept : scratch.take(queries * keys);
  float* output = scratch.take(queries * dim);
  pack_a(q + t.query_row * q_stride + t.column, q_stride, queries, t.head_dim, rows, dim_depth, query);
  pack_b_transposed(k + t.key_row * k_stride + t.column, k_stride, t.head_dim, t.keys, dim_depth, keys, keys_t);
  pack_b(v + t.key_row * v_stride + t.column, v_stride, t.keys, t.head_dim, key_depth, dim, value);
  TileSession tiles;
  tile_product(queries, keys, dim_depth, query, keys_t, scores, keys, t.causal ? Causal::kColumnsToRow : Causal::kAll);
  softmax_rows(t, scores, lse);
  pack_a(scores, keys, queries, t.keys, rows, key_depth, probs);
  tile_product(queries, dim, key_depth, probs, value, output, dim, t.causal ? Causal::kDepthToRow : Causal::kAll);
  write_rows(output, dim, queries, t.head_dim, out + t.query_row * out_stride + t.column, out_stride);
}

// backward_task on tiles: dP = dO v^T, dv = P^T dO, dk = dS^T q, dq = dS k (and P = softmax(q k^T)
// again where it was not kept).
void backward_task_tiles(const Task& t, const c10::BFloat16* grad_out, int64_t g_stride, const c10::BFloat16* q,
                         int64_t q_stride, const c10::BFloat16* k, int64_t k_stride, const c10::BFloat16* v,
                         int64_t v_stride, const float* lse, const float* kept, c10::BFloat16* grad_q,
                         int64_t gq_stride, c10::BFloat16* grad_k, int64_t gk_stride, c10::BFloat16* grad_v,
                         int64_t gv_stride, Scratch& scratch) {
  const int64_t dim = t.padded_dim, keys = t.padded_keys, queries = t.queries;
  const int64_t rows = round_to(queries, kTileRows), dim_depth = round_to(t.head_dim, kTileDepth);
  const int64_t key_depth = round_to(t.keys, kTileDepth), query_depth = round_to(queries, kTileDepth);
  const int64_t a_size = std::max({rows * dim_depth, keys * query_depth, rows * key_depth});
  const int64_t bf16s = a_size + dim_depth * keys + 3 * std::max(query_depth, key_depth) * dim;
  scratch.start(Scratch::halves(bf16s) + (kept ? 1 : 2) * queries * keys + std::max(keys, queries) * dim);
  uint16_t* a = scratch.take_bf16(a_size);  // each product's A in turn
  uint16_t* transposed = scratch.take_bf16(dim_depth * keys);  // v^T, or k^T to recompute P
  uint16_t* grad_output = scratch.take_bf16(query_depth * dim);
  uint16_t* query = scratch.take_bf16(query_depth * dim);
  uint16_t* key = scratch.take_bf16(key_depth * dim);
  float* recomputed = kept ? nullptr : scratch.take(queries * keys);
  const float* probs = kept ? kept : recomputed;
  float* grad_scores = scratch.take(queries * keys);
  float* result = scratch.take(std::max(keys, queries) * dim);
  const c10::BFloat16* q_rows = q + t.query_row * q_stride + t.column;
  const c10::BFloat16* k_rows = k + t.key_row * k_stride + t.column;
  const c10::BFloat16* g_rows = grad_out + t.query_row * g_stride + t.column;
  pack_b(g_rows, g_stride, queries, t.head_dim, query_depth, dim, grad_output);
  pack_b(q_rows, q_stride, queries, t.head_dim, query_depth, dim, query);
  pack_b(k_rows, k_stride, t.keys, t.head_dim, key_depth, dim, key);
  const Causal columns = t.causal ? Causal::kColumnsToRow : Causal::kAll;
  const Causal from_row = t.causal ? Causal::kDepthFromRow : Causal::kAll;
  TileSession tiles;
  if (!kept) {
    pack_a(q_rows, q_stride, queries, t.head_dim, rows, dim_depth, a);
    pack_b_transposed(k_rows, k_stride, t.head_dim, t.keys, dim_depth, keys, transposed);
    tile_product(queries, keys, dim_depth, a, transposed, recomputed, keys, columns);
    probabilities_from_lse(t, recomputed, lse);
  }
  pack_a(g_rows, g_stride, queries, t.head_dim, rows, dim_depth, a);
  pack_b_transposed(v + t.key_row * v_stride + t.column, v_stride, t.head_dim, t.keys, dim_depth, keys, transposed);
  tile_product(queries, keys, dim_depth, a, transposed, grad_scores, keys, columns);
  gradients_of_scores(t, probs, grad_scores);
  pack_a_transposed(probs, keys, t.keys, queries, keys, query_depth, a);
  tile_product(t.keys, dim, query_depth, a, grad_output, result, dim, from_row);
  write_rows(result, dim, t.keys, t.head_dim, grad_v + t.key_row * gv_stride + t.column, gv_stride);
  pack_a_transposed(grad_scores, keys, t.keys, queries, keys, query_depth, a);
  tile_product(t.keys, dim, query_depth, a, query, result, dim, from_row);
  write_rows(result, dim, t.keys, t.head_dim, grad_k + t.key_row * gk_stride + t.column, gk_stride);
  pack_a(grad_scores, keys, queries, t.keys, rows, key_depth, a);
  tile_product(queries, dim, key_depth, a, key, result, dim, t.causal ? Causal::kDepthToRow : Causal::kAll);
  write_rows(result, dim, queries, t.head_dim, grad_q + t.query_row * gq_stride + t.column, gq_stride);
}
#endif

// Whether bf16 attention takes the tile products on this machine.
bool attention_tiles() {
#if defined(SEQ2SEQ_TILES)
  return tiles_permitted();
#else
  return false;
#endif
}

// kept: where this task's probabilities are kept for the backward pass (the scores are computed there
// and turned into them in place), or null: in the thread's scratch, and dropped.
template <typename T>
void forward_task(const Task& t, const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v,
                  int64_t v_stride, T* out, int64_t out_stride, float* lse, float* kept, Scratch& scratch) {
#if defined(SEQ2SEQ_TILES)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (tiles_worth_it(t))
      return forward_task_tiles(t, q, q_stride, k, k_stride, v, v_stride, out, out_stride, lse, kept, scratch);
  }
#endif
  const int64_t dim = t.padded_dim, keys = t.padded_keys;
  const int64_t block =
      kept ? t.queries : std::min(t.queries, std::max<int64_t>(1, kScoreFloats / keys / kBlockRows) * kBlockRows);
  scratch.start(2 * block * dim + 2 * dim * keys + (kept ? 0 : block * keys));
  float* query = scratch.take(block * dim);
  float* keys_t = scratch.take(dim * keys);  // (head_dim, keys): scores = query keys_t
  float* value = scratch.take(keys * dim);
  float* scores = kept ? kept : scratch.take(block * keys);
  float* output = scratch.take(block * dim);
  read_transposed(k + t.key_row * k_stride + t.column, k_stride, t.keys, t.head_dim, keys_t, keys);
  read_rows(v + t.key_row * v_stride + t.column, v_stride, t.keys, t.head_dim, value, dim);
  const Causal columns = t.causal ? Causal::kColumnsToRow : Causal::kAll;
  const Causal depth = t.causal ? Causal::kDepthToRow : Causal::kAll;
  for (int64_t first = 0; first < t.queries; first += block) {
    const Task part = t.queries_from(first, std::min(block, t.queries - first));
    float* part_scores = kept ? kept + first * keys : scores;
    read_rows(q + part.query_row * q_stride + t.column, q_stride, part.queries, t.head_dim, query, dim);
    product(part.queries, keys, t.head_dim, rows_of(query, dim), keys_t, keys, part_scores, keys, columns, first);
    softmax_rows(part, part_scores, lse + first);
    product(part.queries, dim, t.keys, rows_of(part_scores, keys), value, dim, output, dim, depth, first);
    write_rows(output, dim, part.queries, t.head_dim, out + part.query_row * out_stride + t.column, out_stride);
  }
}

// The gradients of one task, with D_i = sum_j P_ij dP_ij (= dO_i . O_i, without keeping O):
// dP = dO v^T, dS = P (dP - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dO. P is the forward
// pass's where it kept them (kept), else recomputed from the scores and lse.
template <typename T>
void backward_task(const Task& t, const T* grad_out, int64_t g_stride, const T* q, int64_t q_stride, const T* k,
                   int64_t k_stride, const T* v, int64_t v_stride, const float* lse, const float* kept, T* grad_q,
                   int64_t gq_stride, T* grad_k, int64_t gk_stride, T* grad_v, int64_t gv_stride, Scratch& scratch) {
#if defined(SEQ2SEQ_TILES)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (tiles_worth_it(t))
      return backward_task_tiles(t, grad_out, g_stride, q, q_stride, k, k_stride, v, v_stride, lse, kept, grad_q,
                                 gq_stride, grad_k, gk_stride, grad_v, gv_stride, scratch);
  }
#endif
  const int64_t dim = t.padded_dim, keys = t.padded_keys, queries = t.queries;
  scratch.start(3 * queries * dim + (kept ? 3 : 4) * dim * keys + (kept ? 1 : 2) * queries * keys);
  float* query = scratch.take(queries * dim);
  float* grad_output = scratch.take(queries * dim);
  float* values_t = scratch.take(dim * keys);
  float* key = scratch.take(keys * dim);
  float* recomputed = kept ? nullptr : scratch.take(queries * keys);
  const float* probs = kept ? kept : recomputed;
  float* grad_scores = scratch.take(queries * keys);
  float* result = scratch.take(keys * dim);           // dv, then dk
  float* result_q = scratch.take(queries * dim);
  const T* k_rows = k + t.key_row * k_stride + t.column;
  read_rows(q + t.query_row * q_stride + t.column, q_stride, queries, t.head_dim, query, dim);
  read_rows(grad_out + t.query_row * g_stride + t.column, g_stride, queries, t.head_dim, grad_output, dim);
  read_rows(k_rows, k_stride, t.keys, t.head_dim, key, dim);
  read_transposed(v + t.key_row * v_stride + t.column, v_stride, t.keys, t.head_dim, values_t, keys);

  const Causal columns = t.causal ? Causal::kColumnsToRow : Causal::kAll;
  if (!kept) {  // the keys' transpose is wanted only to compute the scores again
    float* keys_t = scratch.take(dim * keys);
    read_transposed(k_rows, k_stride, t.keys, t.head_dim, keys_t, keys);
    product(queries, keys, t.head_dim, rows_of(query, dim), keys_t, keys, recomputed, keys, columns);
    probabilities_from_lse(t, recomputed, lse);
  }
  product(queries, keys, t.head_dim, rows_of(grad_output, dim), values_t, keys, grad_scores, keys, columns);
  gradients_of_scores(t, probs, grad_scores);
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

// work(task, head, scratch) for every task, spread over the threads; each thread calls ahead(task)
// with its next task before it works on the one at hand.
template <typename Work, typename Ahead>
void for_each_task(const Layout& layout, Work work, Ahead ahead) {
  const int64_t* qs = layout.query_spans.data_ptr<int64_t>();
  const int64_t* ks = layout.key_spans.data_ptr<int64_t>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
  auto task_at = [&](int64_t task) {
    const int64_t b = task / layout.heads, h = task % layout.heads;
    const int64_t keys = ks[2 * b + 1];
    const int64_t queries = qs[2 * b + 1], padded_keys = round_up(keys);
    return Task{queries, keys, layout.head_dim, round_up(layout.head_dim), padded_keys,
                qs[2 * b], ks[2 * b], h * layout.head_dim, layout.kept_starts[b] + h * queries * padded_keys,
                layout.causal, scale};
  };
  // Each task writes only its own rows and columns, from its own inputs: any thread count gives
  // the same result.
  at::parallel_for(0, layout.sentences * layout.heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      if (task + 1 < end) ahead(task_at(task + 1));
      work(task_at(task), task % layout.heads, scratch);
    }
  });
}

// Asks for the lines of a task's head columns of `rows` rows from `first` (row stride `stride`) while the
// task before it computes (kRowsAhead's comment): into the second-level cache, since asked into the
// first they pushed out the lines that task was working on, and both tasks ran slower.
template <typename T>
void prefetch_rows(const T* data, int64_t stride, int64_t first, int64_t rows, int64_t column, int64_t width) {
  for (int64_t r = first; r < first + rows; ++r) prefetch_row<2>(data + r * stride + column, width);
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
    const scalar_t *qd = q.data_ptr<scalar_t>(), *kd = k.data_ptr<scalar_t>(), *vd = v.data_ptr<scalar_t>();
    for_each_task(
        layout,
        [&](const Task& t, int64_t h, Scratch& scratch) {
          forward_task(t, qd, q.stride(0), kd, k.stride(0), vd, v.stride(0), out.data_ptr<scalar_t>(), out.stride(0),
                       lse_data + h * q.size(0) + t.query_row, keeps ? kept_data + t.kept_at : nullptr, scratch);
        },
        [&](const Task& t) {
          prefetch_rows(qd, q.stride(0), t.query_row, t.queries, t.column, t.head_dim);
          prefetch_rows(kd, k.stride(0), t.key_row, t.keys, t.column, t.head_dim);
          prefetch_rows(vd, v.stride(0), t.key_row, t.keys, t.column, t.head_dim);
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
    const scalar_t *gd = grad_out.data_ptr<scalar_t>(), *qd = q.data_ptr<scalar_t>();
    const scalar_t *kd = k.data_ptr<scalar_t>(), *vd = v.data_ptr<scalar_t>();
    for_each_task(
        layout,
        [&](const Task& t, int64_t h, Scratch& scratch) {
          backward_task(t, gd, grad_out.stride(0), qd, q.stride(0), kd, k.stride(0), vd, v.stride(0),
                        lse_data + h * q.size(0) + t.query_row, keeps ? kept_data + t.kept_at : nullptr,
                        grad_q.data_ptr<scalar_t>(), grad_q.stride(0), grad_k.data_ptr<scalar_t>(), grad_k.stride(0),
                        grad_v.data_ptr<scalar_t>(), grad_v.stride(0), scratch);
        },
        [&](const Task& t) {
          prefetch_rows(gd, grad_out.stride(0), t.query_row, t.queries, t.column, t.head_dim);
          prefetch_rows(qd, q.stride(0), t.query_row, t.queries, t.column, t.head_dim);
          prefetch_rows(kd, k.stride(0), t.key_row, t.keys, t.column, t.head_dim);
          prefetch_rows(vd, v.stride(0), t.key_row, t.keys, t.column, t.head_dim);
        });
  });
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(seq2seq_cpu, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor query_spans, Tensor key_spans, int heads, bool causal,"
        " int max_kept_bytes) -> (Tensor, Tensor, Tensor)");
  m.def("attention_tiles() -> bool", &attention_tiles);
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor kept,"
        " Tensor query_spans, Tensor key_spans, int heads, bool causal, Tensor(a!) grad_q, Tensor(b!) grad_k,"
        " Tensor(c!) grad_v) -> ()");
}

TORCH_LIBRARY_IMPL(seq2seq_cpu, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
}
