// Kunlun's compiled decode path: a whole decode step of the Llama-family decoder in C++, so
// that no Python runs per layer. Built per CPU by kunlun/engine/native/__init__.py (-O3
// -march=native) and loaded with torch.ops.load_library; registers the class
// torch.classes.kunlun.Decoder (the layers' tensors, then step() and logits()).
//
// Matrix products: int4 weights run int4_matmul below (also torch.ops.kunlun.int4_matmul,
// which the eager path runs too) where the measurement on the CPU chose it, else torch's
// int4pack kernel with the eager path's casts (kunlun/engine/models/quant_linear.py). Int8 rows run int8_rows below, also
// registered as torch.ops.kunlun.int8_matmul for the LM head: the arithmetic of torch's
// int8pack kernel (activations and result rounded to bf16, scales after, in float32),
// streaming the weights about 1.7x as fast on an Intel core at one token; past the token
// count measured on the CPU (kunlun/engine/native: on a Zen 5 core torch's kernel, bf16 pairs
// through vdpbf16ps, ran 16 tokens 1.6x as fast), torch's kernel itself. Floating weights run float_matmul (also
// torch.ops.kunlun.float_matmul for the LM head): bf16 weights through AMX tiles where the
// CPU has them (up to 48 tokens), else for a few tokens an own kernel of float32 sums per
// row (bf16 pairs by vdpbf16ps where the CPU has it), past those at::linear; 1.3-1.7x
// at::linear on the demo's shapes. The own kernels hand rows out to torch's threads in chunks
// taken in turn (dynamic_for). RMSNorm, rotary, the paged attention of one new token (a task
// per sequence and KV head, so grouped query heads read the cache once; the softmax's
// exponentials 16 at a time, within 1 ulp of expf: exp16) and SiLU-and-multiply are loops
// here, in float32, that differ from the eager ones only in the order of their sums and in
// those exponentials' last bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KUNLUN_AMX 1
#endif

namespace {

// exp16(x): e^x of 16 floats x <= 0 (attention's scores less their largest), within 1 ulp of
// glibc's expf over [-87, 0] (every 64th float, and every one within 1e-3 of 0, checked on the
// AVX-512 and AVX2 code when written), 0 below kExpFloor (where expf is 1e-38 or less) and NaN
// for NaN (a model whose scores went NaN gives NaN, as the reference path does): x = n ln 2 + r, |r| <= ln 2 / 2 (ln 2 in two parts, so n ln 2 is
// exact), e^r by a polynomial of degree 7 (1 + r + r^2 p(r), Cephes' coefficients for p),
// times 2^n.
constexpr float kExpFloor = -87.f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// 16 floats at a time: AVX-512, AVX2, or GCC vector extensions elsewhere (NEON, ...)
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 splat16(float f) { return {_mm512_set1_ps(f)}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 from_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
inline V16 exp16(V16 x) {  // exp_poly below, scaled by 2^n with vscalefps
  const __m512 v = _mm512_max_ps(x.v, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __mmask16 low = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  return {_mm512_mask_mov_ps(_mm512_maskz_mov_ps(~low, _mm512_scalef_ps(y, n)), nan, x.v)};
}
inline V16 from_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
#elif defined(__AVX2__)
struct V16 {
  __m256 a, b;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 splat16(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline void store16(float* p, V16 x) { _mm256_storeu_ps(p, x.a), _mm256_storeu_ps(p + 8, x.b); }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 fma16(V16 x, V16 y, V16 z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
inline V16 add16(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline float hsum(V16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline V16 from_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline __m256 exp8(__m256 x) {  // exp_poly below, scaled by 2^n through the exponent bits
  const __m256 floor = _mm256_set1_ps(kExpFloor);
  const __m256 v = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ), _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
  return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
inline V16 exp16(V16 x) { return {exp8(x.a), exp8(x.b)}; }
inline V16 from_bf16(const uint16_t* p) {
  const __m128i lo = _mm_loadu_si128((const __m128i*)p), hi = _mm_loadu_si128((const __m128i*)(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
}
#else
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
struct V16 {
  v16f v;
};
inline V16 zero16() { return {v16f{}}; }
inline V16 splat16(float f) { return {v16f{} + f}; }
inline void store16(float* p, V16 a) { std::memcpy(p, &a.v, sizeof a.v); }
inline V16 load16(const float* p) {
  V16 r;
  std::memcpy(&r.v, p, sizeof r.v);
  return r;
}
inline V16 fma16(V16 a, V16 b, V16 c) { return {a.v * b.v + c.v}; }
inline V16 add16(V16 a, V16 b) { return {a.v + b.v}; }
inline float hsum(V16 a) {
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += a.v[j];
  return s;
}
inline V16 from_i8(const int8_t* p) {
  v16i8 b;
  std::memcpy(&b, p, 16);
  return {__builtin_convertvector(__builtin_convertvector(b, v16i), v16f)};
}
inline V16 from_bf16(const uint16_t* p) {
  V16 r;
  for (int j = 0; j < 16; ++j) {
    const uint32_t u = uint32_t(p[j]) << 16;
    std::memcpy(&r.v[j], &u, 4);
  }
  return r;
}
inline V16 exp16(V16 x) {
  for (int j = 0; j < 16; ++j) x.v[j] = std::exp(x.v[j]);
  return x;
}
#endif

constexpr int64_t kTile = 4;         // tokens sharing one pass over a weight row
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the row being read
// tokens up to which float_matmul runs each_row: measured on the demo's shapes against
// at::linear (docs/benchmarks.md), bf16 up to 1.6x as fast at one token and even at eight,
// float32 1.05-1.6x up to sixteen; past those the blocked kernels win
constexpr int64_t kBf16RowsUpTo = 8, kFloatRowsUpTo = 16;

inline float round_bf16(float f) {  // round to nearest even, as a cast to bf16 does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf, nan
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// f(first, last) over [0, n) in chunks that torch's threads take in turn. A thread the OS
// preempts (another process wanting its core: the gateway, a client) holds up only the chunk
// it is in while the others take the rest, where a static split would keep every thread
// waiting for its share: on a machine whose every core runs the step, that turns each
// millisecond another process takes into a millisecond of the step instead of a fraction.
template <typename F>
void dynamic_for(int64_t n, int64_t min_chunk, const F& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max(min_chunk, n / (threads * 16));
  if (threads <= 1 || n <= chunk || at::in_parallel_region()) return f(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t first; (first = next.fetch_add(chunk, std::memory_order_relaxed)) < n;)
      f(first, std::min(n, first + chunk));
  });
}

// Dot products of one weight row with N <= Dot::kTokens token rows: sums[t] = sum_k row[k] *
// x[t * in + k], float32 sums, prefetching the row ahead. W is the weight's element type
// (int8, bf16 as uint16_t, float), X the activations' as the kernel reads them. Each token's
// sum runs in A chains over k taken in turn, so that at least kDotChains products are in
// flight: one chain waits out each FMA's latency (a single token's w8a16 decode ran 2-3 %
// faster with eight chains on a Zen 5 core; docs/benchmarks.md). One row at a time: four
// rows side by side ran it 5 % slower there (four streams from memory instead of one).
template <typename W>
inline V16 widen(const W* p);
template <>
inline V16 widen(const int8_t* p) { return from_i8(p); }
template <>
inline V16 widen(const uint16_t* p) { return from_bf16(p); }
template <>
inline V16 widen(const float* p) { return load16(p); }

// products in flight: eight of AVX-512's 32 vector registers; four V16 on AVX2 (two of its
// 16 registers each)
#if defined(__AVX512F__)
constexpr int kDotChains = 8;
#else
constexpr int kDotChains = 4;
#endif

struct FmaDot {  // the weights widened to float32, multiplied and added 16 lanes at a time
  static constexpr int kTokens = kTile, kStep = 16;
  using Sum = V16;
  static Sum zero() { return zero16(); }
  template <typename W>
  static V16 weights(const W* p) { return widen(p); }
  static V16 tokens(const float* p) { return load16(p); }
  static Sum mac(Sum acc, V16 w, V16 x) { return fma16(w, x, acc); }
  static Sum add(Sum a, Sum b) { return add16(a, b); }
  static float total(Sum a) { return hsum(a); }
};

#if defined(__AVX512BF16__)
struct Bf16Dot {  // bf16 pairs multiplied and summed into float32 lanes (vdpbf16ps)
  static constexpr int kTokens = 8, kStep = 32;
  using Sum = __m512;
  static Sum zero() { return _mm512_setzero_ps(); }
  static __m512bh weights(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh tokens(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Sum mac(Sum acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
  static Sum add(Sum a, Sum b) { return _mm512_add_ps(a, b); }
  static float total(Sum a) { return _mm512_reduce_add_ps(a); }
};
#endif

template <typename Dot, int N, typename W, typename X>
inline void dot_block(const W* row, const X* x, int64_t in, float* sums) {
  constexpr int A = N >= kDotChains ? 1 : kDotChains / N;  // chains per token
  typename Dot::Sum acc[A][N];
  for (int a = 0; a < A; ++a)
    for (int t = 0; t < N; ++t) acc[a][t] = Dot::zero();
  const auto step = [&](int a, int64_t k) {
    __builtin_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetch, 0, 3);
    const auto w = Dot::weights(row + k);
    for (int t = 0; t < N; ++t) acc[a][t] = Dot::mac(acc[a][t], w, Dot::tokens(x + t * in + k));
  };
  int64_t k = 0;
  for (; k + A * Dot::kStep <= in; k += A * Dot::kStep)
    for (int a = 0; a < A; ++a) step(a, k + a * Dot::kStep);
  for (; k < in; k += Dot::kStep) step(0, k);
  for (int t = 0; t < N; ++t) {
    typename Dot::Sum s = acc[0][t];
    for (int a = 1; a < A; ++a) s = Dot::add(s, acc[a][t]);
    sums[t] = Dot::total(s);
  }
}

#if defined(KUNLUN_AMX)
// Whether this process may use AMX tiles: Linux hands out their state on request, once.
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kAmxTokens = 48;  // three tiles of 16 tokens

// store(t, o, sum) for bf16 weights w [out, in] (out a multiple of 16, in of 32) and up to
// kAmxTokens tokens x, B = ceil(tokens / 16): per block of 16 weight rows, tile 0 holds 16
// rows by 32 bf16 of the weights as they lie in memory, tiles 1..B the same 32 columns of
// 16 tokens each in pairs (packed below), tiles 4..3+B their 16 x 16 float32 sums.
template <int B, typename Store>
void amx_blocks(const uint16_t* packed, int64_t tokens, const uint16_t* w, int64_t in,
                int64_t out_features, const Store& store) {
  dynamic_for(out_features / 16, 1, [&](int64_t first, int64_t last) {
    TileConfig config;
    for (int t = 0; t < 1 + B; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    for (int t = 4; t < 4 + B; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
    alignas(64) float sums[16][16];
    const int64_t stride = in * 2, block_stride = in * 16;  // packed elements per 16 tokens
    for (int64_t rows = first; rows < last; ++rows) {
      const uint16_t* a = w + rows * 16 * in;
      _tile_zero(4);
      if constexpr (B > 1) _tile_zero(5);
      if constexpr (B > 2) _tile_zero(6);
      for (int64_t k = 0; k < in; k += 32) {  // (software prefetching measured slower)
        _tile_loadd(0, a + k, stride);
        _tile_loadd(1, packed + k * 16, 64);
        _tile_dpbf16ps(4, 0, 1);
        if constexpr (B > 1) {
          _tile_loadd(2, packed + block_stride + k * 16, 64);
          _tile_dpbf16ps(5, 0, 2);
        }
        if constexpr (B > 2) {
          _tile_loadd(3, packed + 2 * block_stride + k * 16, 64);
          _tile_dpbf16ps(6, 0, 3);
        }
      }
      for (int b = 0; b < B; ++b) {
        if (b == 0) _tile_stored(4, sums, 64);
        if constexpr (B > 1) if (b == 1) _tile_stored(5, sums, 64);
        if constexpr (B > 2) if (b == 2) _tile_stored(6, sums, 64);
        for (int64_t t = b * 16; t < std::min<int64_t>(tokens, b * 16 + 16); ++t)
          for (int64_t i = 0; i < 16; ++i) store(t, rows * 16 + i, sums[i][t - b * 16]);
      }
    }
    _tile_release();
  });
}

// whether amx_rows takes this product (else each_row or at::linear)
bool amx_takes(int64_t tokens, int64_t in, int64_t out_features) {
  return tokens <= kAmxTokens && in % 32 == 0 && out_features % 16 == 0 && amx_usable();
}

// amx_blocks for bf16 tokens x [tokens, in]: x packed as the tiles read it, 16 tokens per
// block, each column pair of a token together ([block][in / 2][16][2]), zeros past the last
template <typename Store>
void amx_rows(const uint16_t* x, int64_t tokens, const uint16_t* w, int64_t in,
              int64_t out_features, const Store& store) {
  const int64_t blocks = (tokens + 15) / 16;
  std::vector<uint16_t> packed(blocks * in * 16, 0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < in; ++k)
      packed[(t / 16) * in * 16 + (k / 2) * 32 + (t % 16) * 2 + k % 2] = x[t * in + k];
  if (blocks == 1) return amx_blocks<1>(packed.data(), tokens, w, in, out_features, store);
  if (blocks == 2) return amx_blocks<2>(packed.data(), tokens, w, in, out_features, store);
  amx_blocks<3>(packed.data(), tokens, w, in, out_features, store);
}
#endif

// dot_block<N> for the n (1 <= n <= N) token rows of a tile
template <typename Dot, int N, typename W, typename X>
inline void dot_tile(int64_t n, const W* row, const X* x, int64_t in, float* sums) {
  if constexpr (N > 1) {
    if (n < N) return dot_tile<Dot, N - 1>(n, row, x, in, sums);
  }
  dot_block<Dot, N>(row, x, in, sums);
}

// store(t, o, sum) for every token t < tokens and weight row o of w [out, in], the rows
// taken by torch's threads in turn (dynamic_for), each row read once per Dot::kTokens tokens
template <typename Dot, typename W, typename X, typename Store>
void each_row(const X* x, int64_t tokens, const W* w, int64_t in, int64_t out_features,
              const Store& store) {
  constexpr int kTokens = Dot::kTokens;
  dynamic_for(out_features, 16, [&](int64_t first, int64_t last) {
    float sums[kTokens];
    for (int64_t o = first; o < last; ++o) {
      const W* row = w + o * in;
      for (int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
        const int64_t n = std::min<int64_t>(kTokens, tokens - t0);
        dot_tile<Dot, kTokens>(n, row, x + t0 * in, in, sums);
        for (int64_t t = 0; t < n; ++t) store(t0 + t, o, sums[t]);
      }
    }
  });
}

// out [tokens, out] = round_bf16(round_bf16(x) . w[o]) * scale[o] for int8 rows w [out, in]
// (in a multiple of 16), in parallel over contiguous runs of rows
void int8_rows(const float* x, int64_t tokens, const int8_t* w, const float* scale, int64_t in,
               int64_t out_features, float* out) {
  std::vector<float> xs(x, x + tokens * in);
  for (auto& v : xs) v = round_bf16(v);
  each_row<FmaDot>(xs.data(), tokens, w, in, out_features, [&](int64_t t, int64_t o, float sum) {
    out[t * out_features + o] = round_bf16(sum) * scale[o];
  });
}

// Which kernel float_matmul runs for x [T, in] by weight [out, in]
enum class FloatKernel { kLinear, kRows, kAmx };

FloatKernel float_kernel(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  const bool own = x.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() &&
                   x.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                   weight.size(1) % 32 == 0 && x.size(1) == weight.size(1);
  if (!own) return FloatKernel::kLinear;
#if defined(KUNLUN_AMX)
  if (dtype == at::kBFloat16 && amx_takes(x.size(0), weight.size(1), weight.size(0)))
    return FloatKernel::kAmx;
#endif
  const int64_t up_to = dtype == at::kBFloat16 ? kBf16RowsUpTo : kFloatRowsUpTo;
  return x.size(0) <= up_to ? FloatKernel::kRows : FloatKernel::kLinear;
}

// y [T, out] = x . weight^T (+ bias) in x's dtype, float32 sums, for floating weights
// [out, in]: a few tokens through each_row, more through at::linear; bf16 up to kAmxTokens
// through AMX tiles where the CPU has them (float_kernel)
at::Tensor float_matmul(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  const FloatKernel kernel = float_kernel(x, weight);
  if (kernel == FloatKernel::kLinear) return at::linear(x, weight, bias);
  const at::Tensor xc = x.contiguous();
  const int64_t tokens = xc.size(0), in = xc.size(1), out_features = weight.size(0);
  at::Tensor out = at::empty({tokens, out_features}, xc.options());
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (xc.scalar_type() == at::kFloat) {
    float* y = out.data_ptr<float>();
    each_row<FmaDot>(xc.data_ptr<float>(), tokens, weight.data_ptr<float>(), in, out_features,
                     [&](int64_t t, int64_t o, float sum) {
                       y[t * out_features + o] = bp ? sum + bp[o] : sum;
                     });
    return out;
  }
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const auto store = [&](int64_t t, int64_t o, float sum) {
    y[t * out_features + o] = at::BFloat16(bp ? sum + bp[o] : sum);
  };
  [[maybe_unused]] const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
#if defined(KUNLUN_AMX)
  if (kernel == FloatKernel::kAmx) {
    amx_rows(xs, tokens, w, in, out_features, store);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  each_row<Bf16Dot>(xs, tokens, w, in, out_features, store);
#else
  const at::Tensor xf = xc.to(at::kFloat);
  each_row<FmaDot>(xf.data_ptr<float>(), tokens, w, in, out_features, store);
#endif
  return out;
}

constexpr int64_t kDequantizeFrom = 48;  // quant_linear.DEQUANTIZE_FROM_TOKENS

// float32 [tokens, out] for x [tokens, in] (any floating dtype) and int8 rows [out, in]:
// int8_rows up to rows_up_to tokens, past them torch's int8pack kernel, whose arithmetic is
// the same (which is faster at how many tokens is measured per CPU: kunlun/engine/native)
// unit: bf16 ones [out], the scale torch's kernel is given (the float32 scale follows it);
// undefined: made here (a Decoder's linear keeps its own, made once)
at::Tensor int8_matmul_with(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                            int64_t rows_up_to, const at::Tensor& unit) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kChar &&
                  weight.is_contiguous() && x.size(1) == weight.size(1) &&
                  weight.size(1) % 16 == 0 && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scale.numel() == weight.size(0),
              "int8_matmul: expected x [T, in], int8 weight [out, in] (in a multiple of 16) "
              "and float32 scale [out]");
  if (x.size(0) > rows_up_to) {
    const at::Tensor ones =
        unit.defined() ? unit : at::ones({weight.size(0)}, x.options().dtype(at::kBFloat16));
    return at::_weight_int8pack_mm(x.to(at::kBFloat16), weight, ones).to(at::kFloat) * scale;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({xf.size(0), weight.size(0)}, xf.options());
  int8_rows(xf.data_ptr<float>(), xf.size(0), weight.data_ptr<int8_t>(),
            scale.data_ptr<float>(), xf.size(1), weight.size(0), out.data_ptr<float>());
  return out;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       int64_t rows_up_to) {
  return int8_matmul_with(x, weight, scale, rows_up_to, at::Tensor());
}

// Int4 weights in tiles of 32 output rows (packed once at load by
// kunlun/engine/models/quant_linear.py from the checkpoint's nibbles): per tile and input
// column k, 16 bytes whose low nibbles are rows 0-15 of the tile at k and whose high nibbles
// are rows 16-31; per tile and group of `group` inputs, the 32 rows' float16 scales, then
// their minimums (w = q * scale + min). The 32 rows lie across the vector lanes, so a
// group's sums of q * x need no scale until the group ends: per column, the 32 nibbles
// become floats by table lookup (AVX-512) or conversion, and each token's x at k is
// broadcast to them. The tile (9 KB for 576 inputs) stays in cache while up to 16 tokens
// pass over it four at a time.
constexpr int64_t kInt4Rows = 32;      // output rows per tile
// tokens int4_tile takes; more dequantize tiles for at::mm, whose fixed cost is about that
// of 48 tokens of tiles on AVX-512 (its table lookup widens the nibbles) and of 16 on AVX2
// (benchmarks/int4_kernel.py, docs/benchmarks.md)
#if defined(__AVX512F__)
constexpr int64_t kInt4RowsUpTo = 48;
#else
constexpr int64_t kInt4RowsUpTo = 16;
#endif

// the 32 weights of one column of a tile, as floats 0..15: rows 0-15 and rows 16-31
inline void int4_column(const uint8_t* p, V16& low, V16& high) {
#if defined(__AVX512F__)
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  low.v = _mm512_permutexvar_ps(bytes, table);  // the lookup reads the index's low 4 bits
  high.v = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m256i first = _mm256_cvtepu8_epi32(b), second = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i mask = _mm256_set1_epi32(15);
  low = {_mm256_cvtepi32_ps(_mm256_and_si256(first, mask)),
         _mm256_cvtepi32_ps(_mm256_and_si256(second, mask))};
  high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)),
          _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4))};
#else
  for (int j = 0; j < 16; ++j) low.v[j] = float(p[j] & 15), high.v[j] = float(p[j] >> 4);
#endif
}

inline V16 load_half16(const uint16_t* p) {
#if defined(__AVX512F__)
  return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))};
#elif defined(__AVX2__) && defined(__F16C__)
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
          _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
#else
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(c10::Half(p[j], c10::Half::from_bits()));
  return r;
#endif
}

// out[t * stride + r] = sum_k w[r, k] x[t, k] for the 32 rows r of one tile and N tokens;
// xsum[t * groups + g] is the sum of token t's x over group g (the minimums' part)
template <int N>
inline void int4_tile(const uint8_t* tile, const uint16_t* scale_min, const float* x,
                      const float* xsum, int64_t in, int64_t group, float* out, int64_t stride) {
  V16 acc[N][2];
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = zero16();
  for (int64_t g0 = 0, g = 0; g0 < in; g0 += group, ++g) {
    V16 sums[N][4];  // rows 0-15 and 16-31, even and odd columns apart (four FMA chains)
    for (int t = 0; t < N; ++t) sums[t][0] = sums[t][1] = sums[t][2] = sums[t][3] = zero16();
    for (int64_t k = g0; k < g0 + group; k += 2) {
      __builtin_prefetch(tile + k * 16 + 2048, 0, 3);
      V16 low0, high0, low1, high1;
      int4_column(tile + k * 16, low0, high0);
      int4_column(tile + k * 16 + 16, low1, high1);
      for (int t = 0; t < N; ++t) {
        const V16 x0 = splat16(x[t * in + k]), x1 = splat16(x[t * in + k + 1]);
        sums[t][0] = fma16(low0, x0, sums[t][0]);
        sums[t][1] = fma16(high0, x0, sums[t][1]);
        sums[t][2] = fma16(low1, x1, sums[t][2]);
        sums[t][3] = fma16(high1, x1, sums[t][3]);
      }
    }
    const uint16_t* sm = scale_min + g * 2 * kInt4Rows;
    const V16 scale0 = load_half16(sm), scale1 = load_half16(sm + 16);
    const V16 min0 = load_half16(sm + 32), min1 = load_half16(sm + 48);
    for (int t = 0; t < N; ++t) {
      const V16 xs = splat16(xsum[t * (in / group) + g]);
      acc[t][0] = fma16(add16(sums[t][0], sums[t][2]), scale0, fma16(min0, xs, acc[t][0]));
      acc[t][1] = fma16(add16(sums[t][1], sums[t][3]), scale1, fma16(min1, xs, acc[t][1]));
    }
  }
  for (int t = 0; t < N; ++t) store16(out + t * stride, acc[t][0]), store16(out + t * stride + 16, acc[t][1]);
}

// the transposed float weights [in, 32 * count] of `count` tiles from tile `first`, in
// `dtype` (each column of a tile is 32 contiguous floats there)
at::Tensor dequantize_int4(const at::Tensor& tiles, const at::Tensor& scale_min, int64_t group,
                           int64_t first, int64_t count, at::ScalarType dtype) {
  const int64_t in = tiles.size(1), groups = in / group, width = count * kInt4Rows;
  at::Tensor out = at::empty({in, width}, at::kFloat);
  const uint8_t* p = tiles.data_ptr<uint8_t>() + first * in * 16;
  const auto* sm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>()) + first * groups * 64;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* s = sm + (t * groups + g) * 64;
        const V16 scale0 = load_half16(s), scale1 = load_half16(s + 16);
        const V16 min0 = load_half16(s + 32), min1 = load_half16(s + 48);
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          V16 low, high;
          int4_column(p + (t * in + k) * 16, low, high);
          store16(o + k * width + t * kInt4Rows, fma16(low, scale0, min0));
          store16(o + k * width + t * kInt4Rows + 16, fma16(high, scale1, min1));
        }
      }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// y [T, out] = x . w^T in x's dtype (float32 sums) for int4 tiles [out / 32, in, 16] and
// their float16 scales and minimums [out / 32, in / group, 2, 32]: up to kInt4RowsUpTo tokens
// through int4_tile, more (a prefill chunk) through at::mm on tiles dequantized 32 at a time
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale_min,
                       int64_t group) {
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.scalar_type() == at::kByte &&
                  tiles.is_contiguous() && tiles.size(2) == 16 && x.size(1) == tiles.size(1) &&
                  group > 0 && group % 2 == 0 && x.size(1) % group == 0 &&
                  scale_min.scalar_type() == at::kHalf && scale_min.is_contiguous() &&
                  scale_min.sizes() == at::IntArrayRef({tiles.size(0), x.size(1) / group, 2, kInt4Rows}),
              "int4_matmul: expected x [T, in], uint8 tiles [out / 32, in, 16], float16 scales "
              "and minimums [out / 32, in / group, 2, 32] and an even group size dividing in");
  const int64_t tokens = x.size(0), in = x.size(1), count = tiles.size(0);
  const int64_t out_features = count * kInt4Rows, groups = in / group;
  if (tokens > kInt4RowsUpTo) {
    // bf16 products where the CPU multiplies bf16 natively; float32 elsewhere (an AVX2 CPU
    // runs bf16 matrix products through slow emulation: measured 37x slower than float32)
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
    const at::ScalarType dtype = x.scalar_type();
#else
    const at::ScalarType dtype = at::kFloat;
#endif
    const at::Tensor xd = x.to(dtype);
    at::Tensor out = at::empty({tokens, out_features}, x.options());
    for (int64_t first = 0; first < count; first += 32) {
      const int64_t n = std::min<int64_t>(32, count - first);
      out.narrow(1, first * kInt4Rows, n * kInt4Rows)
          .copy_(at::mm(xd, dequantize_int4(tiles, scale_min, group, first, n, dtype)));
    }
    return out;
  }
  // bf16 activations are widened and the sums rounded back here, not by two more torch
  // operators (their fixed cost was 5 % of a one-token product of the demo's shapes)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::Tensor xf;
  std::unique_ptr<float[]> widened, sums;  // left uninitialized: every element is written
  const float* xp;
  if (bf16) {
    const at::Tensor xc = x.contiguous();
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    widened.reset(new float[tokens * in]);
    int64_t i = 0;
    for (; i + 16 <= tokens * in; i += 16) store16(widened.get() + i, from_bf16(xb + i));
    for (; i < tokens * in; ++i) widened[i] = static_cast<float>(c10::BFloat16(xb[i], c10::BFloat16::from_bits()));
    xp = widened.get();
  } else {
    xf = x.to(at::kFloat).contiguous();
    xp = xf.data_ptr<float>();
  }
  std::vector<float> xsum(tokens * groups, 0.f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < in; ++k) xsum[t * groups + k / group] += xp[t * in + k];
  at::Tensor out = at::empty({tokens, out_features}, bf16 ? at::kBFloat16 : at::kFloat);
  if (bf16) sums.reset(new float[tokens * out_features]);
  float* y = bf16 ? sums.get() : out.data_ptr<float>();
  at::BFloat16* yb = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  const uint8_t* pt = tiles.data_ptr<uint8_t>();
  const auto* psm = reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>());
  dynamic_for(count, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
        const int64_t n = std::min<int64_t>(kTile, tokens - t0);
        const uint8_t* tile = pt + i * in * 16;
        const uint16_t* sm = psm + i * groups * 2 * kInt4Rows;
        const float *xt = xp + t0 * in, *xs = xsum.data() + t0 * groups;
        float* o = y + t0 * out_features + i * kInt4Rows;
        if (n == 4) int4_tile<4>(tile, sm, xt, xs, in, group, o, out_features);
        else if (n == 3) int4_tile<3>(tile, sm, xt, xs, in, group, o, out_features);
        else if (n == 2) int4_tile<2>(tile, sm, xt, xs, in, group, o, out_features);
        else int4_tile<1>(tile, sm, xt, xs, in, group, o, out_features);
        if (yb)  // rounded to nearest even, as a torch cast rounds
          for (int64_t t = t0; t < t0 + n; ++t) {
            const int64_t row = t * out_features + i * kInt4Rows;
#if defined(__AVX512BF16__)
            for (int64_t r = 0; r < kInt4Rows; r += 16)
              _mm256_storeu_si256((__m256i*)(yb + row + r), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(y + row + r)));
#else
            for (int64_t r = 0; r < kInt4Rows; ++r) yb[row + r] = at::BFloat16(y[row + r]);
#endif
          }
      }
  });
  return bf16 || x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

enum Kind : int64_t { kFloat = 0, kInt8 = 1, kInt4 = 2, kInt8Act = 3, kInt4Tiles = 4 };

struct Linear {
  int64_t kind = kFloat;
  int64_t group = 0;
  int64_t int8_rows_up_to = kDequantizeFrom - 1;  // tokens int8_rows takes (int8_matmul)
  // kFloat: weight [out, in]; kInt8, kInt8Act: weight int8 [out, in], scale float32 [out],
  // ones float32 [out], unit bf16 ones [out] (int8_matmul_with); kInt4: weight the int4pack
  // layout, scale the bf16 (scale, zero) pairs, group the group size; kInt4Tiles: weight and
  // scale int4_matmul's tiles and float16 scales and minimums, group the group size
  at::Tensor weight, scale, ones, unit, bias;

  // y [tokens, out] for x [tokens, in], in x's dtype
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (kind == kFloat) return float_matmul(x, weight, bias.defined() ? std::optional(bias) : std::nullopt);
    if (kind == kInt4Tiles) {
      y = int4_matmul(x, weight, scale, group);
      return bias.defined() ? y + bias : y;
    }
    if (kind == kInt4) {
      y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), weight, group, scale);
    } else if (kind == kInt8) {  // float32 rows from kDequantizeFrom tokens, as eager
      y = x.size(0) >= kDequantizeFrom ? at::linear(x.to(at::kFloat), weight.to(at::kFloat)) * scale
                                       : int8_matmul_with(x, weight, scale, int8_rows_up_to, unit);
    } else {  // w8a8: activations quantized per token, symmetric
      const at::Tensor xf = x.to(at::kFloat);
      const at::Tensor xs = xf.abs().amax(-1, true).clamp_min_(1e-12) / 127.0;
      const at::Tensor q = at::round(xf / xs).clamp_(-127, 127);
      y = x.size(0) >= kDequantizeFrom ? at::linear(q, weight.to(at::kFloat))
                                       : int8_matmul_with(q, weight, ones, int8_rows_up_to, unit);
      y = y * xs * scale;
    }
    y = y.to(x.scalar_type());
    return bias.defined() ? y + bias : y;
  }
};

// Elementwise arithmetic in float32, each result stored in the model's dtype T (float or
// bf16) where the eager path stores one, so that a bf16 model rounds where it rounds.
template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// x [rows, n] -> T(x * rsqrt(mean(x^2) + eps)) * w (the product stored in T)
template <typename T>
void rms_norm(const T* x, const T* w, int64_t rows, int64_t n, double eps, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* yr = out + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += f32(xr[i]) * f32(xr[i]);
    const float inv = 1.f / std::sqrt(ss / float(n) + float(eps));
    for (int64_t i = 0; i < n; ++i) yr[i] = T(f32(T(f32(xr[i]) * inv)) * f32(w[i]));
  }
}

// the residual step fused with the norm after it: x += delta (stored in T, as the eager
// ``hidden + out``), then out = rms_norm(x) * w, in one pass over each row
template <typename T>
void add_rms_norm(T* x, const at::Tensor& delta, const T* w, int64_t rows, int64_t n,
                  double eps, T* out) {
  const at::Tensor d = delta.contiguous();
  const T* dp = d.data_ptr<T>();
  for (int64_t i = 0; i < rows * n; ++i) x[i] = T(f32(x[i]) + f32(dp[i]));
  rms_norm<T>(x, w, rows, n, eps, out);
}

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
};

struct Decoder : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps;
  int64_t int8_rows_up_to;  // tokens from which int8 weights run torch's int8pack kernel, less one
  at::Tensor embed, final_norm, cos, sin;
  std::vector<Linear> pending;
  std::vector<Layer> layers;

  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, at::Tensor embed,
          at::Tensor final_norm, at::Tensor cos, at::Tensor sin, int64_t int8_rows_up_to)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps),
        int8_rows_up_to(int8_rows_up_to), embed(embed), final_norm(final_norm), cos(cos),
        sin(sin) {
    const auto dtype = embed.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
                "Decoder: float32 or bfloat16 models only, not ", dtype);
    for (const auto* t : {&embed, &final_norm, &cos, &sin})
      TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(),
                  "Decoder: the model's tensors must share its dtype and be contiguous");
  }

  void add_linear(int64_t kind, at::Tensor weight, std::optional<at::Tensor> scale,
                  std::optional<at::Tensor> bias, int64_t group) {
    TORCH_CHECK(kind >= kFloat && kind <= kInt4Tiles, "Decoder: unknown linear kind ", kind);
    TORCH_CHECK(kind == kFloat || scale, "Decoder: a quantized linear needs its scales");
    at::Tensor ones, unit;
    if (kind == kInt8 || kind == kInt8Act) {
      ones = at::ones({weight.size(0)}, at::kFloat);
      unit = at::ones({weight.size(0)}, at::kBFloat16);
    }
    pending.push_back(Linear{kind, group, int8_rows_up_to, weight, scale.value_or(at::Tensor()),
                             ones, unit, bias.value_or(at::Tensor())});
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(pending.size() == 4, "Decoder: add_layer after four add_linear calls");
    TORCH_CHECK(k_cache.scalar_type() == embed.scalar_type() && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && k_cache.dim() == 4,
                "Decoder: contiguous [blocks, block_size, kv_heads, head_dim] caches in the "
                "model's dtype");
    layers.push_back(Layer{input_norm, post_norm, q_norm.value_or(at::Tensor()),
                           k_norm.value_or(at::Tensor()), k_cache, v_cache, pending[0],
                           pending[1], pending[2], pending[3]});
    pending.clear();
  }

  // q and k heads of qkv [B, (heads + 2 kv) * d]: optional per-head norm, then rotary
  // (x * cos + rotate_half(x) * sin, each product and the sum stored in T)
  template <typename T>
  void rotate(T* qkv, int64_t batch, const int64_t* positions, const Layer& layer) const {
    const int64_t d = head_dim, half = d / 2, width = (heads + 2 * kv_heads) * d;
    std::vector<T> tmp(d);
    for (int64_t b = 0; b < batch; ++b) {
      const T* c = cos.data_ptr<T>() + positions[b] * d;
      const T* s = sin.data_ptr<T>() + positions[b] * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* x = qkv + b * width + h * d;
        const at::Tensor& norm = h < heads ? layer.q_norm : layer.k_norm;
        if (norm.defined()) rms_norm<T>(x, norm.data_ptr<T>(), 1, d, eps, x);
        for (int64_t i = 0; i < d; ++i) {
          const T a = T(f32(x[i]) * f32(c[i]));
          const T r = T(f32(x[i < half ? i + half : i - half]) * f32(s[i]));
          tmp[i] = T(f32(a) + f32(r));
        }
        std::memcpy(x, tmp.data(), d * sizeof(T));
      }
    }
  }

  // stores k, v at the slots and attends every query head over its sequence's context
  template <typename T>
  void attend(const T* qkv, int64_t batch, const int64_t* slots, const int64_t* tables,
              int64_t table_width, const int64_t* lens, const Layer& layer, T* out) const {
    const int64_t d = head_dim, width = (heads + 2 * kv_heads) * d;
    const int64_t block = layer.k_cache.size(1);
    T* kc = layer.k_cache.data_ptr<T>();
    T* vc = layer.v_cache.data_ptr<T>();
    for (int64_t b = 0; b < batch; ++b) {
      const T* k = qkv + b * width + heads * d;
      std::memcpy(kc + slots[b] * kv_heads * d, k, kv_heads * d * sizeof(T));
      std::memcpy(vc + slots[b] * kv_heads * d, k + kv_heads * d, kv_heads * d * sizeof(T));
    }
    const int64_t per_kv = heads / kv_heads;  // query heads kvh * per_kv ... share KV head kvh
    const float scale = 1.f / std::sqrt(float(d));
    const int64_t longest = *std::max_element(lens, lens + batch);
    // a task per sequence and KV head: its query heads read each key and value once
    dynamic_for(batch * kv_heads, 1, [&](int64_t first, int64_t last) {
      std::vector<float> q(per_kv * d), acc(per_kv * d), weights(per_kv * longest);
      std::vector<float> top(per_kv), total(per_kv);
      std::vector<int64_t> rows(longest);  // each position's key and value, as an offset
      for (int64_t task = first; task < last; ++task) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads, len = lens[b];
        const T* qs = qkv + b * width + kvh * per_kv * d;
        for (int64_t i = 0; i < per_kv * d; ++i) q[i] = f32(qs[i]);
        for (int64_t p = 0; p < len; ++p) {
          const int64_t slot = tables[b * table_width + p / block] * block + p % block;
          rows[p] = (slot * kv_heads + kvh) * d;
        }
        std::fill(top.begin(), top.end(), -INFINITY);
        for (int64_t p = 0; p < len; ++p) {
          const T* key = kc + rows[p];
          for (int64_t j = 0; j < per_kv; ++j) {
            const float s = dot_row(q.data() + j * d, key, d) * scale;
            weights[j * longest + p] = s;
            top[j] = std::max(top[j], s);
          }
        }
        for (int64_t j = 0; j < per_kv; ++j)
          total[j] = softmax_weights<T>(weights.data() + j * longest, len, top[j]);
        weigh_values<T>(vc, rows.data(), len, weights.data(), longest, per_kv, d, acc.data());
        for (int64_t j = 0; j < per_kv; ++j) {
          T* o = out + b * heads * d + (kvh * per_kv + j) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = T(acc[j * d + i] / total[j]);
        }
      }
    });
  }

  // in place: s[p] -> T(e^(s[p] - top)) as float32 (torch's flash kernel multiplies V by
  // T(e)); returns the sum of the e (unrounded)
  template <typename T>
  static float softmax_weights(float* s, int64_t len, float top) {
    const V16 shift = splat16(-top);
    V16 sums = zero16();
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) {
      const V16 e = exp16(add16(load16(s + p), shift));
      sums = add16(sums, e);
      store16(s + p, e);
    }
    float total = hsum(sums);
    for (; p < len; ++p) total += s[p] = std::exp(s[p] - top);
    if constexpr (!std::is_same_v<T, float>)
      for (p = 0; p < len; ++p) s[p] = f32(T(s[p]));
    return total;
  }

  // acc[j * d + i] = sum_p w[j * stride + p] * value_p[i] for the query heads j < heads of one
  // KV head (value_p at vc + rows[p]), the sums in positions' order; heads four at a time, the
  // values K V16 at a time, their sums held in registers across the positions
  template <typename T>
  static void weigh_values(const T* vc, const int64_t* rows, int64_t len, const float* w,
                           int64_t stride, int64_t heads, int64_t d, float* acc) {
    if (d % 16 != 0) {  // an odd head size: one weight at a time
      std::fill(acc, acc + heads * d, 0.f);
      for (int64_t p = 0; p < len; ++p)
        for (int64_t j = 0; j < heads; ++j) add_scaled(acc + j * d, w[j * stride + p], vc + rows[p], d);
      return;
    }
    for (int64_t j = 0; j < heads; j += 4) {
      const int64_t g = std::min<int64_t>(4, heads - j);
      const float* wj = w + j * stride;
      float* aj = acc + j * d;
#if defined(__AVX512F__)
      if (d % 64 == 0) {
        if (g == 4) weigh_group<T, 4, 4>(vc, rows, len, wj, stride, d, aj);
        else if (g == 3) weigh_group<T, 3, 4>(vc, rows, len, wj, stride, d, aj);
        else if (g == 2) weigh_group<T, 2, 4>(vc, rows, len, wj, stride, d, aj);
        else weigh_group<T, 1, 4>(vc, rows, len, wj, stride, d, aj);
        continue;
      }
#endif
      if (g == 4) weigh_group<T, 4, 1>(vc, rows, len, wj, stride, d, aj);
      else if (g == 3) weigh_group<T, 3, 1>(vc, rows, len, wj, stride, d, aj);
      else if (g == 2) weigh_group<T, 2, 1>(vc, rows, len, wj, stride, d, aj);
      else weigh_group<T, 1, 1>(vc, rows, len, wj, stride, d, aj);
    }
  }

  template <typename T, int G, int K>
  static void weigh_group(const T* vc, const int64_t* rows, int64_t len, const float* w,
                          int64_t stride, int64_t d, float* acc) {
    for (int64_t c = 0; c < d; c += 16 * K) {
      V16 sums[G][K];
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < K; ++k) sums[g][k] = zero16();
      for (int64_t p = 0; p < len; ++p) {
        V16 v[K];
        for (int k = 0; k < K; ++k) v[k] = load_t(vc + rows[p] + c + 16 * k);
        for (int g = 0; g < G; ++g) {
          const V16 weight = splat16(w[g * stride + p]);
          for (int k = 0; k < K; ++k) sums[g][k] = fma16(weight, v[k], sums[g][k]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < K; ++k) store16(acc + g * d + c + 16 * k, sums[g][k]);
    }
  }

  // 16 elements of T as float32
  template <typename T>
  static V16 load_t(const T* p) {
    if constexpr (std::is_same_v<T, float>) return load16(p);
    else return from_bf16(reinterpret_cast<const uint16_t*>(p));
  }

  // sum_i q[i] * x[i] for i < n
  template <typename T>
  static float dot_row(const float* q, const T* x, int64_t n) {
    if (n % 16 != 0) {
      float dot = 0.f;
      for (int64_t i = 0; i < n; ++i) dot += q[i] * f32(x[i]);
      return dot;
    }
    V16 acc = zero16();
    for (int64_t i = 0; i < n; i += 16) acc = fma16(load16(q + i), load_t(x + i), acc);
    return hsum(acc);
  }

  // acc[i] += w * x[i] for i < n
  template <typename T>
  static void add_scaled(float* acc, float w, const T* x, int64_t n) {
    if (n % 16 != 0) {
      for (int64_t i = 0; i < n; ++i) acc[i] += w * f32(x[i]);
      return;
    }
    const V16 ws = splat16(w);
    for (int64_t i = 0; i < n; i += 16) store16(acc + i, fma16(ws, load_t(x + i), load16(acc + i)));
  }

  // silu(gate) * up for gate_up [B, 2 * inter] (silu stored in T, then the product)
  template <typename T>
  static void silu_and_mul(const T* gu, int64_t batch, int64_t inter, T* out) {
    dynamic_for(batch * inter, 256, [&](int64_t first, int64_t last) {
      for (int64_t n = first; n < last; ++n) {
        const int64_t b = n / inter, i = n % inter;
        const float g = f32(gu[b * 2 * inter + i]);
        const T silu = T(g / (1.f + std::exp(-g)));
        out[n] = T(f32(silu) * f32(gu[b * 2 * inter + inter + i]));
      }
    });
  }

  template <typename T>
  at::Tensor run(const at::Tensor& ids, const int64_t* pos, const int64_t* slots,
                 const at::Tensor& tables, const int64_t* lens) {
    const int64_t batch = ids.size(0), hidden = embed.size(1), d = head_dim;
    at::Tensor x = embed.index_select(0, ids);  // [B, hidden], the residual stream
    at::Tensor normed = at::empty_like(x);
    at::Tensor attn = at::empty({batch, heads * d}, x.options());
    T* xs = x.data_ptr<T>();
    T* ns = normed.data_ptr<T>();
    if (!layers.empty()) rms_norm<T>(xs, layers[0].input_norm.data_ptr<T>(), batch, hidden, eps, ns);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      at::Tensor qkv = layer.qkv(normed).contiguous();
      rotate<T>(qkv.data_ptr<T>(), batch, pos, layer);
      attend<T>(qkv.data_ptr<T>(), batch, slots, tables.data_ptr<int64_t>(), tables.size(1),
                lens, layer, attn.data_ptr<T>());
      add_rms_norm<T>(xs, layer.o(attn), layer.post_norm.data_ptr<T>(), batch, hidden, eps, ns);
      at::Tensor gate_up = layer.gate_up(normed).contiguous();
      const int64_t inter = gate_up.size(1) / 2;
      at::Tensor act = at::empty({batch, inter}, x.options());
      silu_and_mul<T>(gate_up.data_ptr<T>(), batch, inter, act.data_ptr<T>());
      const at::Tensor& next = i + 1 < layers.size() ? layers[i + 1].input_norm : final_norm;
      add_rms_norm<T>(xs, layer.down(act), next.data_ptr<T>(), batch, hidden, eps, ns);
    }
    if (layers.empty()) rms_norm<T>(xs, final_norm.data_ptr<T>(), batch, hidden, eps, ns);
    return normed;
  }

  // One decode step: every sequence computes one token. Returns the final-norm hidden
  // states [B, hidden] in the model's dtype.
  at::Tensor step(at::Tensor ids, at::Tensor positions, at::Tensor slots, at::Tensor tables,
                  at::Tensor lens) {
    for (const auto* t : {&ids, &positions, &slots, &tables, &lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                  "Decoder.step: contiguous long tensors only");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    if (embed.scalar_type() == at::kBFloat16) return run<at::BFloat16>(ids, pos, slot, tables, len);
    return run<float>(ids, pos, slot, tables, len);
  }
};

}  // namespace

TORCH_LIBRARY(kunlun, m) {
  const std::string int8_schema = "int8_matmul(Tensor x, Tensor weight, Tensor scale, int rows_up_to=" +
                                  std::to_string(kDequantizeFrom - 1) + ") -> Tensor";
  m.def(int8_schema.c_str(), &int8_matmul);
  m.def("float_matmul(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &float_matmul);
  m.def("int4_matmul(Tensor x, Tensor tiles, Tensor scale_min, int group) -> Tensor", &int4_matmul);
  m.class_<Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor,
                       at::Tensor, int64_t>())
      .def("add_linear", &Decoder::add_linear)
      .def("add_layer", &Decoder::add_layer)
      .def("step", &Decoder::step);
}
