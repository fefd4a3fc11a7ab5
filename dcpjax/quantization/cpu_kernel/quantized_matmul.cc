// y [M, N] float32 = x [M, K] float32 @ dequantize(values, scale, offset), without a float copy of the weight.
//
// Why a compiled kernel: XLA:CPU does not fuse a convert into a dot operand, so a held int8 / fp8
// weight would be written out in float32 at every use (4x its bytes, written then read). Here each
// weight byte is read once per call, converted in registers, and multiplied into float32 accumulators.
//
// The weight, in one of two layouts (`transposed` = 0 / 1):
//   KN: values [K, N] (a Linear as dcpjax holds it, [in, out]); scale / offset [K / gk, N / gn]
//   NK: values [N, K] (a tied embedding table [vocab, hidden]);  scale / offset [N / gn, K / gk]
// values int8 (GGUF codes) or float8_e4m3fn; scale and offset float16 or float32; offset only with
// `has_offset` (else the scale buffer is passed twice and ignored). Per block of gk elements along K:
//   y[m, n] += s * sum_k x[m, k] v[k, n]  (+ o * sum_k x[m, k])
// which is x @ (v * s + o) up to float32 rounding (the sum over a block is taken before the scale).
//
// Paths (KN): up to 3 rows of x stream the weight front to back, four rows of codes per pass (kn_stream);
// 8 rows or more convert each block of codes once into an L1 buffer and run float products from it
// (kn_strip_buffered); 4-7 rows keep register tiles (kn_tile). NK: each table row converted into 4 rows of x at a
// time (nk_row); from 8 rows of x, table rows dequantized into a buffer, 3 at a time dotted with every row
// (nk_rows_buffered).
//
// Threads: the output columns (KN) or rows (NK) are cut into chunks that the calling thread and
// tasks on XLA's intra-op pool take from one atomic counter; the caller waits only for chunks
// already taken, so the call finishes even if no pool task ever starts.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;  // floats per vector (AVX2's 256 bits; GCC's vector extension elsewhere)
constexpr int64_t kStreamRows = 3;  // up to this many rows of x, KN streams the weight (kn_stream)
typedef float f32v __attribute__((vector_size(kLanes * sizeof(float))));
typedef int8_t i8v __attribute__((vector_size(kLanes)));
typedef int32_t i32v __attribute__((vector_size(kLanes * sizeof(int32_t))));

float fp8_e4m3fn_to_float(uint8_t bits) {
  const int sign = bits >> 7, exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m / 8 * 2^-6
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return sign ? -magnitude : magnitude;
}

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_e4m3fn_to_float(static_cast<uint8_t>(b));
  }
};
const Fp8Table kFp8;

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      float f = std::ldexp(static_cast<float>(mantissa), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Eight weights as floats.
inline f32v load8(const int8_t* p) {
#ifdef __AVX2__
  return (f32v)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  i8v v;
  std::memcpy(&v, p, kLanes);
  return __builtin_convertvector(__builtin_convertvector(v, i32v), f32v);  // two steps vectorise better
#endif
}
inline f32v load8(const uint8_t* p) {  // float8_e4m3fn, through the table
  f32v out;
  for (int i = 0; i < kLanes; ++i) out[i] = kFp8.value[p[i]];
  return out;
}
inline f32v loadf(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storef(float* p, f32v v) { std::memcpy(p, &v, sizeof(v)); }

// Scales and offsets are read where they are used, float32 or float16 (uint16_t here), never copied.
inline float scalar_at(const float* p) { return *p; }
inline float scalar_at(const uint16_t* p) {
#ifdef __F16C__
  return _cvtsh_ss(*p);
#else
  return half_to_float(*p);
#endif
}
inline f32v load8(const float* p) { return loadf(p); }
inline f32v load8(const uint16_t* p) {
#ifdef __F16C__
  return (f32v)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  f32v out;
  for (int i = 0; i < kLanes; ++i) out[i] = half_to_float(p[i]);
  return out;
#endif
}

struct Problem {
  const float* x;
  const void* values;
  const void* scale;
  const void* offset;  // nullptr: none
  const float* x_block_sums;  // [M, K / gk] (with an offset)
  float* y;
  int64_t m, k, n, gk, gn;
};
inline float weight_at(const int8_t* p) { return static_cast<float>(*p); }
inline float weight_at(const uint8_t* p) { return kFp8.value[*p]; }

// KN: rows [m0, m0 + MB) x columns [n0, n0 + CV * kLanes) of y, the accumulators in registers
// (MB * CV vectors of sums per block, and as many of scaled totals: 6 + 6 for one row, 24 for four,
// which spill past AVX2's 16 registers: measured, 4 x 2 was no faster).
template <typename V, typename S, int MB, int CV>
void kn_tile(const Problem& p, int64_t m0, int64_t n0) {
  constexpr int cols = CV * kLanes;
  const V* values = static_cast<const V*>(p.values);
  const int64_t blocks = p.k / p.gk, scale_cols = p.n / p.gn;
  alignas(32) float spread[2][cols];  // a block's scales / offsets per column when gn > 1 (fp8's 128)
  f32v out[MB][CV] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    f32v acc[MB][CV] = {};
    const V* row = values + b * p.gk * p.n + n0;
    for (int64_t kk = 0; kk < p.gk; ++kk, row += p.n) {
      float xv[MB];
      for (int r = 0; r < MB; ++r) xv[r] = p.x[(m0 + r) * p.k + b * p.gk + kk];
      for (int c = 0; c < CV; ++c) {
        const f32v w = load8(row + c * kLanes);
        for (int r = 0; r < MB; ++r) acc[r][c] += xv[r] * w;
      }
    }
    const S* scales = static_cast<const S*>(p.scale) + b * scale_cols;
    const S* offsets = p.offset ? static_cast<const S*>(p.offset) + b * scale_cols : nullptr;
    if (p.gn > 1) {
      for (int j = 0; j < cols; ++j) spread[0][j] = scalar_at(scales + (n0 + j) / p.gn);
      if (offsets) for (int j = 0; j < cols; ++j) spread[1][j] = scalar_at(offsets + (n0 + j) / p.gn);
    }
    // column n0 + c * kLanes's scales: read in place where every column has its own (GGUF)
    auto part = [&](const S* table, int which, int c) {
      return p.gn == 1 ? load8(table + n0 + c * kLanes) : loadf(spread[which] + c * kLanes);
    };
    for (int c = 0; c < CV; ++c) {
      const f32v s = part(scales, 0, c);
      for (int r = 0; r < MB; ++r) out[r][c] += s * acc[r][c];
      if (offsets) {
        const f32v o = part(offsets, 1, c);
        for (int r = 0; r < MB; ++r) out[r][c] += o * p.x_block_sums[(m0 + r) * blocks + b];
      }
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < CV; ++c) storef(p.y + (m0 + r) * p.n + n0 + c * kLanes, out[r][c]);
}

// KN rows in blocks of 4 (then 1) for columns [n0, n0 + CV * kLanes).
template <typename V, typename S, int CV4, int CV1>
void kn_strip(const Problem& p, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= p.m; m += 4) kn_tile<V, S, 4, CV4>(p, m, n0);
  for (; m < p.m; ++m) kn_tile<V, S, 1, CV1>(p, m, n0);
}

// One column of y, scalar (the last columns when N is not a multiple of kLanes).
template <typename V, typename S>
void kn_column(const Problem& p, int64_t n) {
  const V* values = static_cast<const V*>(p.values);
  const int64_t blocks = p.k / p.gk;
  for (int64_t m = 0; m < p.m; ++m) {
    float out = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      float acc = 0;
      for (int64_t kk = b * p.gk; kk < (b + 1) * p.gk; ++kk) acc += p.x[m * p.k + kk] * weight_at(values + kk * p.n + n);
      const int64_t at = b * (p.n / p.gn) + n / p.gn;
      out += scalar_at(static_cast<const S*>(p.scale) + at) * acc;
      if (p.offset) out += scalar_at(static_cast<const S*>(p.offset) + at) * p.x_block_sums[m * blocks + b];
    }
    p.y[m * p.n + n] = out;
  }
}

// KN for many rows (a batch): 24 columns [n0, n0 + 24) of y, one K block at a time. The block's codes
// are converted once into an L1 buffer of floats, then every row's products are taken from it (4 rows x
// 3 vectors of sums in registers, y itself holding the scaled totals): each code converted once per
// call, not once per 4 rows, and no totals spilled from registers.
constexpr int64_t kBufferedMaxGroup = 256;  // K groups up to this long take the buffered strip
constexpr int64_t kBufferedMinRows = 8;

template <typename V, typename S>
void kn_strip_buffered(const Problem& p, int64_t n0) {
  constexpr int CV = 3, cols = CV * kLanes;
  const V* values = static_cast<const V*>(p.values);
  const int64_t blocks = p.k / p.gk, scale_cols = p.n / p.gn;
  alignas(32) float buffer[kBufferedMaxGroup][cols];
  alignas(32) float spread[2][cols];
  for (int64_t m = 0; m < p.m; ++m) std::fill(p.y + m * p.n + n0, p.y + m * p.n + n0 + cols, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const V* row = values + b * p.gk * p.n + n0;
    for (int64_t kk = 0; kk < p.gk; ++kk, row += p.n)
      for (int c = 0; c < CV; ++c) storef(buffer[kk] + c * kLanes, load8(row + c * kLanes));
    const S* scales = static_cast<const S*>(p.scale) + b * scale_cols;
    const S* offsets = p.offset ? static_cast<const S*>(p.offset) + b * scale_cols : nullptr;
    for (int j = 0; j < cols; ++j) {
      spread[0][j] = scalar_at(scales + (n0 + j) / p.gn);
      spread[1][j] = offsets ? scalar_at(offsets + (n0 + j) / p.gn) : 0.0f;
    }
    const float* xb = p.x + b * p.gk;
    int64_t m = 0;
    auto rows = [&](auto count) {
      constexpr int MB = decltype(count)::value;
      f32v acc[MB][CV] = {};
      for (int64_t kk = 0; kk < p.gk; ++kk) {
        for (int c = 0; c < CV; ++c) {
          const f32v w = loadf(buffer[kk] + c * kLanes);
          for (int r = 0; r < MB; ++r) acc[r][c] += xb[(m + r) * p.k + kk] * w;
        }
      }
      for (int r = 0; r < MB; ++r) {
        float* y = p.y + (m + r) * p.n + n0;
        const float xs = offsets ? p.x_block_sums[(m + r) * blocks + b] : 0.0f;
        for (int c = 0; c < CV; ++c)
          storef(y + c * kLanes, loadf(y + c * kLanes) + loadf(spread[0] + c * kLanes) * acc[r][c] +
                                     loadf(spread[1] + c * kLanes) * xs);
      }
    };
    for (; m + 4 <= p.m; m += 4) rows(std::integral_constant<int, 4>());
    for (; m < p.m; ++m) rows(std::integral_constant<int, 1>());
  }
}

// KN columns [n0, n1): strips of 24 columns (4 rows x 3 vectors, or 1 row x 3), then of 8, then scalar.
template <typename V, typename S>
void kn_columns(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.m >= kBufferedMinRows && p.gk <= kBufferedMaxGroup)
    for (; n + 3 * kLanes <= n1; n += 3 * kLanes) kn_strip_buffered<V, S>(p, n);
  for (; n + 3 * kLanes <= n1; n += 3 * kLanes) kn_strip<V, S, 3, 3>(p, n);
  for (; n + kLanes <= n1; n += kLanes) kn_strip<V, S, 1, 1>(p, n);
  for (; n < n1; ++n) kn_column<V, S>(p, n);
}

// KN for a few rows of x (decode): K blocks [b0, b1) into partial [M, N], reading the weight rows
// front to back (the stream a memory prefetcher serves best). Per block, the products go to `acc`
// [M, N] (in L1 / L2) and then, scaled, to `partial`.
template <typename V, typename S>
void kn_stream(const Problem& p, int64_t b0, int64_t b1, float* partial, float* acc) {
  const V* values = static_cast<const V*>(p.values);
  const int64_t blocks = p.k / p.gk, scale_cols = p.n / p.gn, vec_n = p.n / kLanes * kLanes;
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(acc, acc + p.m * p.n, 0.0f);
    const int64_t k_end = (b + 1) * p.gk;
    int64_t kk = b * p.gk;
    // four rows of codes per pass over the accumulators: a quarter of the L1 loads and stores, which
    // otherwise bound this loop (measured: 1.7-2x on SmolLM2's weights at batch 1, cache-resident)
    for (; kk + 4 <= k_end; kk += 4) {
      const V* r0 = values + kk * p.n;
      const V *r1 = r0 + p.n, *r2 = r1 + p.n, *r3 = r2 + p.n;
      for (int64_t m = 0; m < p.m; ++m) {
        const float* xm = p.x + m * p.k + kk;
        const float x0 = xm[0], x1 = xm[1], x2 = xm[2], x3 = xm[3];
        float* a = acc + m * p.n;
        for (int64_t n = 0; n < vec_n; n += kLanes) {
          const f32v low = x0 * load8(r0 + n) + x1 * load8(r1 + n);
          const f32v high = x2 * load8(r2 + n) + x3 * load8(r3 + n);
          storef(a + n, loadf(a + n) + (low + high));
        }
        for (int64_t n = vec_n; n < p.n; ++n)
          a[n] += x0 * weight_at(r0 + n) + x1 * weight_at(r1 + n) + x2 * weight_at(r2 + n) + x3 * weight_at(r3 + n);
      }
    }
    for (; kk < k_end; ++kk) {
      const V* row = values + kk * p.n;
      for (int64_t m = 0; m < p.m; ++m) {
        const float xv = p.x[m * p.k + kk];
        float* a = acc + m * p.n;
        for (int64_t n = 0; n < vec_n; n += kLanes) storef(a + n, loadf(a + n) + xv * load8(row + n));
        for (int64_t n = vec_n; n < p.n; ++n) a[n] += xv * weight_at(row + n);
      }
    }
    const S* scales = static_cast<const S*>(p.scale) + b * scale_cols;
    const S* offsets = p.offset ? static_cast<const S*>(p.offset) + b * scale_cols : nullptr;
    for (int64_t m = 0; m < p.m; ++m) {
      float* out = partial + m * p.n;
      const float* a = acc + m * p.n;
      const float xs = offsets ? p.x_block_sums[m * blocks + b] : 0.0f;
      int64_t n = 0;
      if (p.gn == 1) {
        for (; n < vec_n; n += kLanes) {
          f32v o = loadf(out + n) + load8(scales + n) * loadf(a + n);
          if (offsets) o += load8(offsets + n) * xs;
          storef(out + n, o);
        }
      }
      for (; n < p.n; ++n) {
        out[n] += scalar_at(scales + n / p.gn) * a[n];
        if (offsets) out[n] += scalar_at(offsets + n / p.gn) * xs;
      }
    }
  }
}

inline float hsum(f32v v) {
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// NK: weight row n (column n of y) for x rows [m0, m0 + MB); each weight vector is converted once and
// multiplied into MB rows. Needs gk % kLanes == 0.
template <typename V, typename S, int MB>
void nk_row(const Problem& p, int64_t m0, int64_t n) {
  const int64_t blocks = p.k / p.gk;
  const V* row = static_cast<const V*>(p.values) + n * p.k;
  const S* scales = static_cast<const S*>(p.scale) + (n / p.gn) * blocks;
  const S* offsets = p.offset ? static_cast<const S*>(p.offset) + (n / p.gn) * blocks : nullptr;
  f32v total[MB] = {};
  float shift[MB] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    f32v acc[MB] = {};
    for (int64_t kk = b * p.gk; kk < (b + 1) * p.gk; kk += kLanes) {
      const f32v w = load8(row + kk);
      for (int r = 0; r < MB; ++r) acc[r] += loadf(p.x + (m0 + r) * p.k + kk) * w;
    }
    const float scale = scalar_at(scales + b);
    for (int r = 0; r < MB; ++r) total[r] += scale * acc[r];
    if (offsets) {
      const float offset = scalar_at(offsets + b);
      for (int r = 0; r < MB; ++r) shift[r] += offset * p.x_block_sums[(m0 + r) * blocks + b];
    }
  }
  for (int r = 0; r < MB; ++r) p.y[(m0 + r) * p.n + n] = hsum(total[r]) + shift[r];
}

// NK with blocks that are not whole vectors: scalar.
template <typename V, typename S>
void nk_scalar(const Problem& p, int64_t n0, int64_t n1) {
  const V* values = static_cast<const V*>(p.values);
  const int64_t blocks = p.k / p.gk;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.m; ++m) {
      float out = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        float acc = 0;
        for (int64_t kk = b * p.gk; kk < (b + 1) * p.gk; ++kk) acc += p.x[m * p.k + kk] * weight_at(values + n * p.k + kk);
        const int64_t at = (n / p.gn) * blocks + b;
        out += scalar_at(static_cast<const S*>(p.scale) + at) * acc;
        if (p.offset) out += scalar_at(static_cast<const S*>(p.offset) + at) * p.x_block_sums[m * blocks + b];
      }
      p.y[m * p.n + n] = out;
    }
}

// NK for many rows (a batch through a tied LM head, prompt logprobs): table rows are dequantized into a float
// buffer once per call (nk_row converts each code once per 4 rows of x), then dotted with the rows of x.
// Blocked for the caches: a group of table rows (about 128 KiB of floats, L2) against blocks of x's rows
// (about 32 KiB, L1), 4 rows x 3 table rows of sums in registers (7 loads per 12 multiply-adds). Scaled
// before the sum here: x @ (v * s + o), as dequantize computes it.
template <typename V, typename S>
void nk_dequantize_rows(const Problem& p, int64_t n, int64_t count, float* buffer) {
  const int64_t blocks = p.k / p.gk;
  for (int64_t j = 0; j < count; ++j) {
    const V* row = static_cast<const V*>(p.values) + (n + j) * p.k;
    const S* scales = static_cast<const S*>(p.scale) + ((n + j) / p.gn) * blocks;
    const S* offsets = p.offset ? static_cast<const S*>(p.offset) + ((n + j) / p.gn) * blocks : nullptr;
    float* out = buffer + j * p.k;
    for (int64_t b = 0; b < blocks; ++b) {
      const f32v scale = f32v{} + scalar_at(scales + b), offset = f32v{} + (offsets ? scalar_at(offsets + b) : 0.0f);
      for (int64_t kk = b * p.gk; kk < (b + 1) * p.gk; kk += kLanes) storef(out + kk, load8(row + kk) * scale + offset);
    }
  }
}

// y[m0:m1, n:n + NB] from NB dequantized table rows (`rows` [NB, K]).
template <int NB>
void nk_dot_tile(const Problem& p, int64_t m0, int64_t m1, int64_t n, const float* rows) {
  auto dots = [&](int64_t m, auto count) {
    constexpr int MB = decltype(count)::value;
    f32v acc[MB][NB] = {};
    for (int64_t kk = 0; kk < p.k; kk += kLanes) {
      f32v w[NB];
      for (int j = 0; j < NB; ++j) w[j] = loadf(rows + j * p.k + kk);
      for (int r = 0; r < MB; ++r) {
        const f32v xv = loadf(p.x + (m + r) * p.k + kk);
        for (int j = 0; j < NB; ++j) acc[r][j] += xv * w[j];
      }
    }
    for (int r = 0; r < MB; ++r)
      for (int j = 0; j < NB; ++j) p.y[(m + r) * p.n + n + j] = hsum(acc[r][j]);
  };
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) dots(m, std::integral_constant<int, 4>());
  for (; m < m1; ++m) dots(m, std::integral_constant<int, 1>());
}

template <typename V, typename S>
void nk_rows_buffered(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.k * static_cast<int64_t>(sizeof(float));
  const int64_t table_rows = std::max<int64_t>(3, (128 << 10) / row_bytes / 3 * 3);
  const int64_t x_rows = std::max<int64_t>(4, (32 << 10) / row_bytes / 4 * 4);
  std::vector<float> buffer(table_rows * p.k);
  for (int64_t n = n0; n < n1; n += table_rows) {
    const int64_t count = std::min(table_rows, n1 - n);
    nk_dequantize_rows<V, S>(p, n, count, buffer.data());
    for (int64_t m = 0; m < p.m; m += x_rows) {
      const int64_t m_end = std::min(p.m, m + x_rows);
      int64_t j = 0;
      for (; j + 3 <= count; j += 3) nk_dot_tile<3>(p, m, m_end, n + j, buffer.data() + j * p.k);
      for (; j < count; ++j) nk_dot_tile<1>(p, m, m_end, n + j, buffer.data() + j * p.k);
    }
  }
}

template <typename V, typename S>
void nk_rows(const Problem& p, int64_t n0, int64_t n1) {
  if (p.gk % kLanes) return nk_scalar<V, S>(p, n0, n1);
  if (p.m >= kBufferedMinRows) return nk_rows_buffered<V, S>(p, n0, n1);
  for (int64_t n = n0; n < n1; ++n) {  // row n stays in L1 while every block of x's rows reads it
    int64_t m = 0;
    for (; m + 4 <= p.m; m += 4) nk_row<V, S, 4>(p, m, n);
    for (; m < p.m; ++m) nk_row<V, S, 1>(p, m, n);
  }
}

struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Runs work(chunk) for chunk in [0, chunks) on the caller and up to `helpers` pool tasks.
template <typename Work>
void run_chunks(ffi::ThreadPool& pool, int64_t chunks, Work work) {
  auto shared = std::make_shared<Shared>();
  auto drain = [shared, chunks, work]() {
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      work(c);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(drain)(drain));  // each task its own copy
  drain();
  while (shared->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                               ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y,
                               int64_t group_k, int64_t group_n, int64_t transposed, int64_t has_offset) {
  const auto xd = x.dimensions();
  const auto vd = values.dimensions();
  if (xd.size() != 2 || vd.size() != 2) return ffi::Error::InvalidArgument("x and values must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = transposed ? vd[0] : vd[1];
  if ((transposed ? vd[1] : vd[0]) != k) return ffi::Error::InvalidArgument("x and values disagree on K");
  if (group_k < 1 || group_n < 1 || k % group_k || n % group_n) {
    return ffi::Error::InvalidArgument("the scale groups must divide K and N");
  }
  const auto vt = values.element_type();
  if (vt != ffi::DataType::S8 && vt != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("values must be int8 or float8_e4m3fn");
  }
  for (const ffi::AnyBuffer* b : {&scale, &offset}) {
    if (b->element_type() != ffi::DataType::F32 && b->element_type() != ffi::DataType::F16) {
      return ffi::Error::InvalidArgument("scale and offset must be float32 or float16");
    }
    if (static_cast<int64_t>(b->element_count()) != (k / group_k) * (n / group_n)) {
      return ffi::Error::InvalidArgument("scale / offset size is not (K / group_k) * (N / group_n)");
    }
  }
  const int64_t blocks = k / group_k;
  std::vector<float> block_sums;
  if (has_offset) {
    block_sums.assign(m * blocks, 0.0f);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t kk = 0; kk < k; ++kk) block_sums[r * blocks + kk / group_k] += x.typed_data()[r * k + kk];
  }
  if (has_offset && offset.element_type() != scale.element_type()) {
    return ffi::Error::InvalidArgument("scale and offset must have one dtype");
  }
  Problem p{x.typed_data(), values.untyped_data(), scale.untyped_data(), has_offset ? offset.untyped_data() : nullptr,
            block_sums.data(), y->typed_data(), m, k, n, group_k, group_n};
  // about 4 chunks per thread, each a whole number of tiles (KN) and at least 16 rows (NK)
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() + 1);
  // the four kernels: values int8 / fp8 x scales float32 / float16
  const int kind = (vt == ffi::DataType::S8 ? 0 : 2) + (scale.element_type() == ffi::DataType::F16 ? 1 : 0);
  auto columns = [kind](const Problem& q, int64_t n0, int64_t n1) {
    switch (kind) {
      case 0: return kn_columns<int8_t, float>(q, n0, n1);
      case 1: return kn_columns<int8_t, uint16_t>(q, n0, n1);
      case 2: return kn_columns<uint8_t, float>(q, n0, n1);
      default: return kn_columns<uint8_t, uint16_t>(q, n0, n1);
    }
  };
  auto rows = [kind](const Problem& q, int64_t n0, int64_t n1) {
    switch (kind) {
      case 0: return nk_rows<int8_t, float>(q, n0, n1);
      case 1: return nk_rows<int8_t, uint16_t>(q, n0, n1);
      case 2: return nk_rows<uint8_t, float>(q, n0, n1);
      default: return nk_rows<uint8_t, uint16_t>(q, n0, n1);
    }
  };
  if (!transposed && m <= kStreamRows) {
    // K cut into one range of blocks per thread, each summed into its own [M, N], then added up
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(blocks, pool.num_threads()));
    const int64_t per = (blocks + chunks - 1) / chunks;
    const int64_t used = (blocks + per - 1) / per;
    std::vector<float> partials(used * m * n, 0.0f), scratch(used * m * n);
    auto stream = [kind](const Problem& q, int64_t b0, int64_t b1, float* partial, float* acc) {
      switch (kind) {
        case 0: return kn_stream<int8_t, float>(q, b0, b1, partial, acc);
        case 1: return kn_stream<int8_t, uint16_t>(q, b0, b1, partial, acc);
        case 2: return kn_stream<uint8_t, float>(q, b0, b1, partial, acc);
        default: return kn_stream<uint8_t, uint16_t>(q, b0, b1, partial, acc);
      }
    };
    run_chunks(pool, used, [&](int64_t c) {
      stream(p, c * per, std::min(blocks, c * per + per), partials.data() + c * m * n, scratch.data() + c * m * n);
    });
    float* out = y->typed_data();
    std::copy(partials.begin(), partials.begin() + m * n, out);
    for (int64_t c = 1; c < used; ++c)
      for (int64_t i = 0; i < m * n; ++i) out[i] += partials[c * m * n + i];
  } else if (!transposed) {
    const int64_t strip = 3 * kLanes;  // kn_columns' widest strip
    const int64_t strips = (n + strip - 1) / strip;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(strips, 4 * threads));
    const int64_t per = (strips + chunks - 1) / chunks * strip;
    run_chunks(pool, (n + per - 1) / per, [&p, per, n, columns](int64_t c) {
      columns(p, c * per, std::min(n, c * per + per));
    });
  } else {
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(n / 16, 4 * threads));
    const int64_t per = (n + chunks - 1) / chunks;
    run_chunks(pool, (n + per - 1) / per, [&p, per, n, rows](int64_t c) {
      rows(p, c * per, std::min(n, c * per + per));
    });
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DcpjaxQuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // values [K, N] or [N, K]
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::AnyBuffer>()         // offset (the scale again when none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<int64_t>("group_k")
                                  .Attr<int64_t>("group_n")
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("has_offset"));
