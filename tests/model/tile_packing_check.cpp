// The AMX tile path's packing and the block transposes of cpu_attention.cpp, against their definitions
// written as plain loops, on random shapes and values (NaNs, infinities, denormals and rounding ties
// among them). Built by test_cpu_attention.py with AMX's flags on any CPU with AVX-512 BW and VL: it
// runs the packing, never a tile instruction. Prints the cases that differ, then "checked N".

#include "cpu_attention.cpp"

#include <cstdio>
#include <random>

namespace {

using BF16 = c10::BFloat16;

uint16_t rounded_bits(float value) {
  BF16 out;
  store(&out, value);
  return out.x;
}

// A[r][c] = bf16(src[c][r]), zero elsewhere in rows_pad x cols_pad.
std::vector<uint16_t> defined_a_transposed(const float* src, int64_t stride, int64_t rows, int64_t cols,
                                           int64_t rows_pad, int64_t cols_pad) {
  std::vector<uint16_t> out(rows_pad * cols_pad, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols_pad + c] = rounded_bits(src[c * stride + r]);
  return out;
}

// Pairs (B[2i][n], B[2i + 1][n]) of B[d][n] = src[n][d], zero past depth and cols.
std::vector<uint16_t> defined_b_transposed(const BF16* src, int64_t stride, int64_t depth, int64_t cols,
                                           int64_t depth_pad, int64_t cols_pad) {
  std::vector<uint16_t> out(depth_pad * cols_pad, 0);
  for (int64_t d = 0; d < depth; ++d)
    for (int64_t n = 0; n < cols; ++n) out[(d / 2 * cols_pad + n) * 2 + d % 2] = src[n * stride + d].x;
  return out;
}

// out[d][r] = source[r][d] as floats; the rest of out as it was.
template <typename T>
std::vector<float> defined_transposed(const T* source, int64_t stride, int64_t rows, int64_t width,
                                      int64_t out_stride, float fill) {
  std::vector<float> out(width * out_stride, fill);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < width; ++d) out[d * out_stride + r] = load(source[r * stride + d]);
  return out;
}

}  // namespace

int main() {
  std::mt19937 random(7);
  const uint32_t specials[] = {0x7FC00001u, 0x7F800000u, 0xFF800000u, 0x00000001u, 0x807FFFFFu,
                               0x3F808000u, 0x3F818000u, 0x7FFFFFFFu};  // NaNs, infinities, denormals, ties
  auto any_float = [&] {
    const uint32_t bits = random() % 4 ? random() : specials[random() % 8];
    return from_bits(bits);
  };
  auto size = [&](int64_t most) { return 1 + static_cast<int64_t>(random() % most); };
  int64_t checked = 0, differ = 0;
  auto report = [&](bool same, const char* what, int64_t a, int64_t b) {
    ++checked;
    if (!same && ++differ <= 5) std::printf("%s differs at %ld x %ld\n", what, static_cast<long>(a), static_cast<long>(b));
  };
  for (int trial = 0; trial < 2000; ++trial) {
    {  // the transposed probabilities (keys x queries of fp32 scores, padded)
      const int64_t rows = size(70), cols = size(70), stride = rows + random() % 20;
      const int64_t rows_pad = round_to(rows, 16), cols_pad = round_to(cols, 32);
      std::vector<float> src(cols * stride);
      for (float& value : src) value = any_float();
      std::vector<uint16_t> packed(rows_pad * cols_pad, 0xAAAA);
      pack_a_transposed(src.data(), stride, rows, cols, rows_pad, cols_pad, packed.data());
      report(packed == defined_a_transposed(src.data(), stride, rows, cols, rows_pad, cols_pad), "pack_a_transposed",
             rows, cols);
    }
    {  // k^T or v^T from a projection's strided rows, from any element (odd addresses too)
      const int64_t depth = size(70), cols = size(70), stride = depth + random() % 300, first = random() % 3;
      const int64_t depth_pad = round_to(depth, 32), cols_pad = round_to(cols, 16);
      std::vector<BF16> src(cols * stride + first);
      for (BF16& value : src) value.x = static_cast<uint16_t>(random());
      std::vector<uint16_t> packed(depth_pad * cols_pad, 0xAAAA);
      pack_b_transposed(src.data() + first, stride, depth, cols, depth_pad, cols_pad, packed.data());
      report(packed == defined_b_transposed(src.data() + first, stride, depth, cols, depth_pad, cols_pad),
             "pack_b_transposed", depth, cols);
    }
    {  // the fp32 path's reads, from bf16 and fp32 rows; the padding columns keep what they held
      const int64_t rows = size(70), width = size(70), stride = width + random() % 9;
      const int64_t out_stride = round_to(rows, 16) + 16 * (random() % 2);
      std::vector<BF16> halves(rows * stride);
      for (BF16& value : halves) value.x = static_cast<uint16_t>(random());
      std::vector<float> floats(rows * stride);
      for (float& value : floats) value = any_float();
      std::vector<float> out(width * out_stride, -7.0f);
      read_transposed(halves.data(), stride, rows, width, out.data(), out_stride);
      const auto expected = defined_transposed(halves.data(), stride, rows, width, out_stride, -7.0f);
      report(std::memcmp(out.data(), expected.data(), out.size() * sizeof(float)) == 0, "read_transposed (bf16)",
             rows, width);
      std::fill(out.begin(), out.end(), -7.0f);
      read_transposed(floats.data(), stride, rows, width, out.data(), out_stride);
      const auto expected_floats = defined_transposed(floats.data(), stride, rows, width, out_stride, -7.0f);
      report(std::memcmp(out.data(), expected_floats.data(), out.size() * sizeof(float)) == 0,
             "read_transposed (fp32)", rows, width);
    }
  }
  std::printf("checked %ld\n", static_cast<long>(checked));
  return differ == 0 ? 0 : 1;
}
