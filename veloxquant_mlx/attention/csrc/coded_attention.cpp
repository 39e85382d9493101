// Attention of one decode query per row over a KV history held as affine codes: one MLX primitive, CPU.
//
// The pure-MLX reference is veloxquant_mlx.attention.packed_sdpa.attend_one_query; this computes the same
// softmax in one pass over the codes (tests/test_kernel.py checks them against each other). Per (row, KV head)
// g and chunk of coded tokens: rotate the queries into the keys' domain, decode a tile of key codes to float,
// score, update an online softmax (base 2: queries arrive pre-multiplied by scale / ln 2), decode the tile's
// values and accumulate them; the exact tokens (sink, tail) are one more task in the plain domain. Partial
// results merge per g; the coded sum is rotated back and the value mean added once.
//
// Code layouts (MLX's affine format: b-bit fields in a little-endian bit stream of uint32 words, per group
// x = scale * q + bias, for symmetric values x = scale * (q - zero), for codebook codes x = scale * levels[q]):
//   tokens_first: w (G, n, d*b/32), scales/biases (G, n, d/group)       groups along channels, per token
//   tokens_last:  w (G, d, n*b/32), scales/biases (G, d, n/group)       groups along tokens, per channel
// A second stream of codebook codes (tokens first) may follow: for keys one more score term in its own space
// (TurboQuant-Prod's QJL signs: (pk2 q) . signs * residual norm) or levels summed with the first stream's under
// its scales (RVQ); for values levels summed with the first stream's (RVQ). Codes of 1-4 bits are unpacked 8 at a
// time and looked up in registers where AVX2 is available (portable scalar code otherwise).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace vq {

constexpr int TILE = 32;          // tokens decoded at a time; divides every affine group (32, 64, 128)
constexpr int PREFETCH_TILES = 4;  // tiles of transposed key codes fetched ahead
constexpr int MAX_R = 16;         // query heads per KV head handled by one task
constexpr int MAX_D = 256;        // head dim
constexpr float NEG = -3.4028234663852886e+38f;  // masked score: finite, as the reference's

// ------------------------------------------------------------------------------------------------
// small thread pool: the calling thread plus (threads - 1) workers, tasks claimed from a counter
// ------------------------------------------------------------------------------------------------
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return int(workers_.size()) + 1; }

  void run(int ntasks, const std::function<void(int)>& f, bool parallel = true) {
    if (!parallel || workers_.empty() || ntasks <= 1) {
      for (int i = 0; i < ntasks; ++i) f(i);
      return;
    }
    std::unique_lock<std::mutex> call(call_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &f;
      ntasks_ = ntasks;
      next_.store(0);
      busy_ = int(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void drain() {
    for (int i = next_.fetch_add(1); i < ntasks_; i = next_.fetch_add(1)) (*job_)(i);
  }
  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--busy_ == 0) done_cv_.notify_one();
      }
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_, call_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  int ntasks_ = 0, busy_ = 0;
  std::atomic<int> next_{0};
  uint64_t generation_ = 0;
  bool stop_ = false;
};

int default_threads() {
  if (const char* env = std::getenv("VELOXQUANT_KERNEL_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(std::min(hw, 64u)) : 1;
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

// ------------------------------------------------------------------------------------------------
// reading codes
// ------------------------------------------------------------------------------------------------
// 2**t for t <= 0: t = i + f with i = round(t), |f| <= 1/2, 2**f = e**x (x = f ln 2, |x| <= 0.347) by its
// Taylor series to x**6 (relative error ~1e-7), 2**i written into the float's exponent bits.
inline float exp2_nonpositive(float t) {
  t = std::max(t, -126.0f);
  float i = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2**22): 1.5 * 2**23 drops the fraction
  float x = (t - i) * 0.6931471805599453f;
  float p = 1.0f + x * (1.0f + x * (0.5f + x * (0.16666667f + x * (0.041666668f + x * (0.008333334f +
            x * 0.0013888889f)))));
  int32_t bits = (int32_t(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp2_nonpositive on 8 lanes (the same steps; the polynomial by fused multiply-adds). max_ps returns its second
// operand when either is NaN: t goes second, so a NaN score stays NaN (as std::max keeps it) and is never hidden.
inline __m256 exp2_nonpositive8(__m256 t) {
  t = _mm256_max_ps(_mm256_set1_ps(-126.0f), t);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 i = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
  const __m256 x = _mm256_mul_ps(_mm256_sub_ps(t, i), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.0013888889f), x, _mm256_set1_ps(0.008333334f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(0.041666668f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(0.16666667f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

enum class ScaleType { f16, bf16, f32, u8log };

// One-byte log-grid scales (kblock_vsym8, codecs/affine_sym_log.py; Python checks these constants at load):
// code 0 -> 0, code 255 -> NaN (a group that held inf or NaN), else 2^((code - LOG_SCALE_OFFSET) / LOG_SCALE_STEPS).
constexpr int LOG_SCALE_OFFSET = 142, LOG_SCALE_STEPS = 8;
const std::array<float, 256> kLogScale = [] {
  std::array<float, 256> t{};
  for (int c = 1; c < 255; ++c) t[c] = std::exp2(float(c - LOG_SCALE_OFFSET) / LOG_SCALE_STEPS);
  t[255] = std::numeric_limits<float>::quiet_NaN();
  return t;
}();

// Scales and biases are read per channel per block and per token: conversions in one or two instructions.
inline float load_scale(const void* p, ScaleType dt, int64_t i) {
  if (dt == ScaleType::u8log) return kLogScale[static_cast<const uint8_t*>(p)[i]];
  if (dt == ScaleType::f16) {
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
    return float(static_cast<const float16_t*>(p)[i]);
#endif
  }
  if (dt == ScaleType::bf16) {
    uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return static_cast<const float*>(p)[i];
}

// Field i of a little-endian stream of b-bit fields starting at byte pointer p.
inline uint32_t field(const uint8_t* p, int64_t i, int bits) {
  int64_t bit = i * bits;
  const uint8_t* q = p + (bit >> 3);
  int sh = int(bit & 7);
  uint32_t v = uint32_t(q[0]) >> sh;
  if (sh + bits > 8) v |= uint32_t(q[1]) << (8 - sh);
  return v & ((1u << bits) - 1u);
}

// `units` units of BITS bytes, 8 codes each (3- and 5-bit codes), as integers.
template <int BITS>
inline void unpack_units(const uint8_t* q, int units, uint8_t* out) {
  for (int j = 0; j < units; ++j, q += BITS) {
    uint64_t u = 0;  // composed in a register (a partial memcpy into it stalled on store forwarding)
    for (int b = 0; b < BITS; ++b) u |= uint64_t(q[b]) << (8 * b);
    for (int i = 0; i < 8; ++i) out[8 * j + i] = uint8_t((u >> (i * BITS)) & ((1u << BITS) - 1u));
  }
}

// n consecutive fields from field `first` as integers. Fast paths read whole units (a unit of b bytes holds 8
// codes of b bits, or 4 of 6 bits) when `first` and n are whole units.
inline void unpack(const uint8_t* p, int64_t first, int n, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, p + first, size_t(n));
  } else if (bits == 4 && (first & 1) == 0 && (n & 1) == 0) {
    const uint8_t* q = p + first / 2;
    for (int j = 0; j < n / 2; ++j) {
      out[2 * j] = q[j] & 15u;
      out[2 * j + 1] = q[j] >> 4;
    }
  } else if (bits == 2 && (first & 3) == 0 && (n & 3) == 0) {
    const uint8_t* q = p + first / 4;
    for (int j = 0; j < n / 4; ++j) {
      uint32_t b = q[j];
      out[4 * j] = b & 3u;
      out[4 * j + 1] = (b >> 2) & 3u;
      out[4 * j + 2] = (b >> 4) & 3u;
      out[4 * j + 3] = uint8_t(b >> 6);
    }
  } else if ((bits == 3 || bits == 5) && (first & 7) == 0 && (n & 7) == 0) {
    if (bits == 3) unpack_units<3>(p + (first / 8) * 3, n / 8, out);
    else unpack_units<5>(p + (first / 8) * 5, n / 8, out);
  } else if (bits == 6 && (first & 3) == 0 && (n & 3) == 0) {
    const uint8_t* q = p + (first / 4) * 3;
    for (int j = 0; j < n / 4; ++j, q += 3) {
      uint32_t u = uint32_t(q[0]) | (uint32_t(q[1]) << 8) | (uint32_t(q[2]) << 16);
      for (int i = 0; i < 4; ++i) out[4 * j + i] = uint8_t((u >> (6 * i)) & 63u);
    }
  } else {
    for (int j = 0; j < n; ++j) out[j] = uint8_t(field(p, first + j, bits));
  }
}

#if defined(__AVX2__)
// Units of BITS <= 4 bytes (8 codes each) as 8 floats per unit: the codes themselves, or their levels looked up
// in registers (LEVELS: lev16 holds 16 floats, the 2**BITS levels then padding; codes of 4 bits pick between two
// 8-level permutes by their top bit). Replaces a scalar unpack, gather and convert per coordinate.
template <int BITS, bool LEVELS>
inline void units_to_floats(const uint8_t* q, int units, const float* lev16, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  if (LEVELS) {
    lo = _mm256_loadu_ps(lev16);
    hi = _mm256_loadu_ps(lev16 + 8);
  }
  for (int j = 0; j < units; ++j, q += BITS) {
    uint32_t u = q[0];
    if (BITS > 1) u |= uint32_t(q[1]) << 8;
    if (BITS > 2) u |= uint32_t(q[2]) << 16;
    if (BITS > 3) u |= uint32_t(q[3]) << 24;
    __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(u)), shifts), mask);
    __m256 v;
    if (!LEVELS) {
      v = _mm256_cvtepi32_ps(idx);
    } else if (BITS <= 3) {
      v = _mm256_permutevar8x32_ps(lo, idx);
    } else {
      v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                           _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    }
    _mm256_storeu_ps(out + 8 * j, v);
  }
}

// Whole units of 1..4-bit codes from field `first` (a multiple of 8) as floats; false: not such a case.
inline bool units_fast(const uint8_t* p, int64_t first, int n, int bits, const float* lev16, float* out) {
  if (bits > 4 || (first & 7) || (n & 7)) return false;
  const uint8_t* q = p + (first / 8) * bits;
  int units = n / 8;
  switch (bits * 2 + (lev16 ? 1 : 0)) {
    case 2: units_to_floats<1, false>(q, units, lev16, out); return true;
    case 3: units_to_floats<1, true>(q, units, lev16, out); return true;
    case 4: units_to_floats<2, false>(q, units, lev16, out); return true;
    case 5: units_to_floats<2, true>(q, units, lev16, out); return true;
    case 6: units_to_floats<3, false>(q, units, lev16, out); return true;
    case 7: units_to_floats<3, true>(q, units, lev16, out); return true;
    case 8: units_to_floats<4, false>(q, units, lev16, out); return true;
    default: units_to_floats<4, true>(q, units, lev16, out); return true;
  }
}
#else
inline bool units_fast(const uint8_t*, int64_t, int, int, const float*, float*) { return false; }
#endif

// n consecutive fields from field `first` as floats.
inline void fields(const uint8_t* p, int64_t first, int n, int bits, float* out) {
  if (units_fast(p, first, n, bits, nullptr, out)) return;
  if (bits == 8) {
    const uint8_t* q = p + first;
    for (int j = 0; j < n; ++j) out[j] = float(q[j]);
    return;
  }
  alignas(64) uint8_t codes[256];
  unpack(p, first, n, bits, codes);
  for (int j = 0; j < n; ++j) out[j] = float(codes[j]);
}

// A (B, H, rows, cols) array's element (g = b * H + h, row, 0): views (slices of a cache's buffers) keep their
// strides; the last axis is contiguous.
struct View {
  const uint8_t* base = nullptr;
  int64_t sb = 0, sh = 0, srow = 0;  // strides in bytes
  int64_t H = 1;
  const uint8_t* at(int64_t g, int64_t row) const { return base + (g / H) * sb + (g % H) * sh + row * srow; }
  // Head g's rows (the division once per task, not per row).
  struct Head {
    const uint8_t* p;
    int64_t srow;
    const uint8_t* row(int64_t r) const { return p + r * srow; }
  };
  Head head(int64_t g) const { return Head{base ? at(g, 0) : nullptr, srow}; }
};

View view(const array& a) {
  View v;
  v.base = a.data<uint8_t>();
  int64_t item = a.itemsize();
  v.sb = a.strides(0) * item;
  v.sh = a.strides(1) * item;
  v.srow = a.strides(2) * item;
  v.H = a.shape(1);
  return v;
}

struct Codes {
  View w, scales, biases;           // biases.base null: symmetric levels, bias = -zero * scale
  ScaleType dtype = ScaleType::f32;  // of scales and biases
  const float* levels = nullptr;    // codebook levels per code (Lloyd-Max), else the code itself
  alignas(32) float lev16[16] = {};  // the first 16 levels, padded (register lookups of codes up to 4 bits)
  bool tokens_last = false;
  int bits = 8, group = 64, d = 64;
  float zero = 0.0f;

  void set_levels(const float* l) {
    levels = l;
    if (l)
      for (int i = 0; i < std::min(16, 1 << bits); ++i) lev16[i] = l[i];
  }

  // n code values from field `first` of a row: the codes themselves, or their codebook levels.
  void values(const uint8_t* row, int64_t first, int n, float* out) const {
    if (!levels) return fields(row, first, n, bits, out);
    if (units_fast(row, first, n, bits, lev16, out)) return;
    alignas(64) uint8_t codes[256];
    unpack(row, first, n, bits, codes);
    for (int j = 0; j < n; ++j) out[j] = levels[codes[j]];
  }

  // Tokens [t0, t0 + nt) of head g decoded from codes with groups along tokens (per channel; nt <= TILE, inside
  // one group): CHANNEL_MAJOR writes out[c * TILE + tt] (keys, scored along tokens), else out[tt * d + c]
  // (values). Codes with groups along channels never come here: their keys are scored token by token
  // (score_tokens) and their values fold their scales into the weights (coded_task).
  template <bool CHANNEL_MAJOR>
  void decode(int64_t g, int64_t t0, int nt, float* out) const {
    const auto W = w.head(g), S = scales.head(g), Bs = biases.head(g);
    alignas(64) float tmp[MAX_D > TILE ? MAX_D : TILE];
    const int64_t blk = t0 / group;
    for (int c = 0; c < d; ++c) {
      values(W.row(c), t0, nt, tmp);
      float s = load_scale(S.row(c), dtype, blk);
      float b = biases.base ? load_scale(Bs.row(c), dtype, blk) : -zero * s;
      if (CHANNEL_MAJOR) {
        float* o = out + c * TILE;
        for (int tt = 0; tt < nt; ++tt) o[tt] = s * tmp[tt] + b;
      } else {
        for (int tt = 0; tt < nt; ++tt) out[tt * d + c] = s * tmp[tt] + b;
      }
    }
  }
};

// ------------------------------------------------------------------------------------------------
// the computation
// ------------------------------------------------------------------------------------------------
struct Problem {
  int64_t G = 0, n = 0, ne = 0;
  // The coded tokens attended: slots [spans[2i], spans[2i+1]) of the codes (sorted, disjoint; empty: all n). A
  // sliding window's evicted slots are a hole between two spans, skipped, never scored.
  std::vector<int64_t> spans;
  int R = 1, d = 64, dv = 64;
  const float *q = nullptr, *pk = nullptr, *pv = nullptr;
  const float *kmu = nullptr, *vmu = nullptr;  // (mu_rows, d): per g or per KV head (g % mu_rows)
  int64_t kmu_rows = 0, vmu_rows = 0;
  Codes k, v;
  // Second code streams (RVQ's residual codebook, TurboQuant-Prod's QJL signs), tokens first, levels given.
  // Keys: one more additive score term (pk2 q) . (scale2 * levels2[codes2]) in its own m2-dim space, with its
  // own per-token scales; values: levels added to the first stream's, under its scales and rotation.
  bool has_k2 = false, has_v2 = false;
  bool k2_summed = false;  // keys' second stream under the first's scales and rotation: levels summed (no pk2)
  Codes k2, v2;
  const float* pk2 = nullptr;  // (m2, d)
  int m2 = 0;
  View ek, ev;                                  // exact keys / values (B, H, ne, d) float32
  const uint8_t *cmask = nullptr, *emask = nullptr;
  bool emask_rows = false;  // emask (G*R, ne): one per query row (a prompt chunk's causal tail), else (G, ne)
  const float* sinks = nullptr;  // (G, R), log2 units
  float* out = nullptr;
  // A second coded part (a cache's coded tail: tokens waiting for their key block, coded per token), read in the
  // same pass and the same softmax: its own codes, rotations, means and mask; no spans, no second streams.
  const Problem* tail = nullptr;
  // Keys stored less their rotated mean before RoPE (a cache's rope_offset): slot t's score gains
  // q . R_pos mu = (R_{-s0} q) . (R_j mu), s0 the position of the first slot of t's block of `oblock` slots, j the
  // slot within it. otable (rows dividing G, oblock/TILE, d, TILE) holds R_j mu as channel-major tiles; oturns
  // (G, blocks, odims) the cos then sin of each pair's angle at -s0 per block (pairs (2p, 2p+1) when otrad, else
  // (p, p + odims/2)). Null otable: no offset.
  const float* otable = nullptr;
  int64_t otable_rows = 0, oturn_blocks = 0;
  const float* oturns = nullptr;
  int odims = 0, oblock = 0;
  bool otrad = false;
};

// One task's online-softmax state for R query rows: running max m, sum l, unnormalized output o (R x dv).
struct Partial {
  float m[MAX_R], l[MAX_R];
  float* o = nullptr;
  bool coded = false;
  bool tail = false;  // (coded) of the second coded part: its values in its own rotated domain
};

// ---- tile kernels: rows of a query group in blocks of up to 3 (accumulators stay in vector registers) ----
constexpr int ROW_BLOCK = 3;

// s[r * TILE + tt] = base[r] + sum_c qs[r * d + c] * kt[c * TILE + tt] for RB rows.
template <int RB>
inline void score_rows(const float* qs, const float* base, const float* kt, int d, float* s) {
  alignas(64) float acc[RB][TILE];
  for (int r = 0; r < RB; ++r)
    for (int tt = 0; tt < TILE; ++tt) acc[r][tt] = base[r];
  for (int c = 0; c < d; ++c) {
    const float* kc = kt + c * TILE;
    for (int r = 0; r < RB; ++r) {
      float q = qs[r * d + c];
      for (int tt = 0; tt < TILE; ++tt) acc[r][tt] += q * kc[tt];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int tt = 0; tt < TILE; ++tt) s[r * TILE + tt] = acc[r][tt];
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[j] += p * v_j for four vectors: one row's share of a 32-wide tile update (both tile kernels below).
inline void fma4(__m256 (&acc)[4], __m256 p, __m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  acc[0] = _mm256_fmadd_ps(p, v0, acc[0]);
  acc[1] = _mm256_fmadd_ps(p, v1, acc[1]);
  acc[2] = _mm256_fmadd_ps(p, v2, acc[2]);
  acc[3] = _mm256_fmadd_ps(p, v3, acc[3]);
}

// The same sums in AVX2 registers: RB x 4 accumulators of 8 tokens (the generic loops above spilled them to the
// stack, a store-to-load round trip per multiply-add).
template <int RB>
inline void score_rows_avx(const float* qs, const float* base, const float* kt, int d, float* s) {
  static_assert(TILE == 32, "four vectors of 8 tokens per row");
  __m256 acc[RB][4];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_set1_ps(base[r]);
  for (int c = 0; c < d; ++c) {
    const float* kc = kt + c * TILE;
    const __m256 k0 = _mm256_load_ps(kc), k1 = _mm256_load_ps(kc + 8), k2 = _mm256_load_ps(kc + 16),
                 k3 = _mm256_load_ps(kc + 24);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) fma4(acc[r], _mm256_broadcast_ss(qs + r * d + c), k0, k1, k2, k3);
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) _mm256_store_ps(s + r * TILE + 8 * j, acc[r][j]);
}
#define VQ_SCORE_ROWS score_rows_avx

// score_rows_avx for 8-bit key codes with groups along tokens (row c: channel c's code of every token, one byte
// each), converted in registers as they are scored: the tile is not written out as floats and read back. NV
// vectors of 8 tokens from token t0 + 8 * v0 (NV = 4: the whole tile; NV = 2: one half, so that up to six rows'
// accumulators fit the 16 registers). Prefetches each row at byte ``prefetch_at`` (negative: none).
template <int RB, int NV>
inline void score_rows_u8_avx(const float* qs, int ldq, const float* base, const View::Head& KW, int64_t t0, int v0,
                              int d, int64_t prefetch_at, float* s) {
  static_assert(TILE == 32 && (NV == 4 || NV == 2), "a tile of 32 one-byte codes per row, or half of it");
  __m256 acc[RB][NV];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_set1_ps(base[r]);
  for (int c = 0; c < d; ++c) {
    const uint8_t* row = KW.row(c);
    if (prefetch_at >= 0) __builtin_prefetch(row + prefetch_at);
    __m256 k[NV];
    if constexpr (NV == 4) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + t0));
      const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
      k[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      k[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      k[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      k[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + t0 + 8 * v0));
      k[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
      k[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    }
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m256 q = _mm256_broadcast_ss(qs + r * ldq + c);
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(q, k[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) _mm256_store_ps(s + r * TILE + 8 * (v0 + j), acc[r][j]);
}
#else
#define VQ_SCORE_ROWS score_rows
#endif

inline void score_tile(int R, const float* qs, const float* base, const float* kt, int d, float* s) {
  for (int r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    int rb = std::min(ROW_BLOCK, R - r0);
    const float *q = qs + r0 * d, *b = base + r0;
    float* out = s + r0 * TILE;
    if (rb == 3) VQ_SCORE_ROWS<3>(q, b, kt, d, out);
    else if (rb == 2) VQ_SCORE_ROWS<2>(q, b, kt, d, out);
    else VQ_SCORE_ROWS<1>(q, b, kt, d, out);
  }
}

// s[r * TILE + tt] += sum_c q[r * d + c] * u[c * TILE + tt] for RB rows: the key offset's scores on a tile (u:
// a tile of its table, read unaligned; s: the tile's scores so far).
template <int RB>
inline void add_score_rows(const float* q, const float* u, int d, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_load_ps(s + r * TILE + 8 * j);
  for (int c = 0; c < d; ++c) {
    const float* uc = u + c * TILE;
    const __m256 u0 = _mm256_loadu_ps(uc), u1 = _mm256_loadu_ps(uc + 8), u2 = _mm256_loadu_ps(uc + 16),
                 u3 = _mm256_loadu_ps(uc + 24);
    for (int r = 0; r < RB; ++r) fma4(acc[r], _mm256_broadcast_ss(q + r * d + c), u0, u1, u2, u3);
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 4; ++j) _mm256_store_ps(s + r * TILE + 8 * j, acc[r][j]);
#else
  for (int c = 0; c < d; ++c)
    for (int r = 0; r < RB; ++r) {
      const float qc = q[r * d + c];
      for (int tt = 0; tt < TILE; ++tt) s[r * TILE + tt] += qc * u[c * TILE + tt];
    }
#endif
}

inline void add_score_tile(int R, const float* q, const float* u, int d, float* s) {
  for (int r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    const int rb = std::min(ROW_BLOCK, R - r0);
    if (rb == 3) add_score_rows<3>(q + r0 * d, u, d, s + r0 * TILE);
    else if (rb == 2) add_score_rows<2>(q + r0 * d, u, d, s + r0 * TILE);
    else add_score_rows<1>(q + r0 * d, u, d, s + r0 * TILE);
  }
}

// out = R_{-s0} q for R rows (the queries turned back to a block's first position), from the block's cos / sin
// (computed by the caller as the reference computes them: veloxquant_mlx.quant.rope.turns).
inline void rotate_back(const Problem& pr, const float* q, int R, int d, const float* turns, float* out) {
  std::copy(q, q + R * d, out);
  const int half = pr.odims / 2;
  for (int p = 0; p < half; ++p) {
    const float c = turns[p], sn = turns[half + p];
    const int i1 = pr.otrad ? 2 * p : p, i2 = pr.otrad ? 2 * p + 1 : p + half;
    for (int r = 0; r < R; ++r) {
      const float x = q[r * d + i1], y = q[r * d + i2];
      out[r * d + i1] = x * c - y * sn;
      out[r * d + i2] = x * sn + y * c;
    }
  }
}

// o[r * ldo + c] += sum_tt w[r * TILE + tt] * x[tt * ldx + c] for RB rows, c in [c0, c1).
template <int RB>
inline void weighted_rows(const float* w, const float* x, int ldx, int nt, float* o, int ldo, int c0, int c1) {
  int c = c0;
  for (; c + 16 <= c1; c += 16) {
    alignas(64) float acc[RB][16];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 16; ++j) acc[r][j] = o[r * ldo + c + j];
    for (int tt = 0; tt < nt; ++tt) {
      const float* xt = x + tt * ldx + c;
      for (int r = 0; r < RB; ++r) {
        float p = w[r * TILE + tt];
        for (int j = 0; j < 16; ++j) acc[r][j] += p * xt[j];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 16; ++j) o[r * ldo + c + j] = acc[r][j];
  }
  for (; c < c1; ++c)
    for (int r = 0; r < RB; ++r) {
      float acc = o[r * ldo + c];
      for (int tt = 0; tt < nt; ++tt) acc += w[r * TILE + tt] * x[tt * ldx + c];
      o[r * ldo + c] = acc;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// The same sums in AVX2 registers, 32 then 8 columns at a time (accumulators RB x 4 vectors: no spills).
template <int RB>
inline void weighted_rows_avx(const float* w, const float* x, int ldx, int nt, float* o, int ldo, int c0, int c1) {
  int c = c0;
  for (; c + 32 <= c1; c += 32) {
    __m256 acc[RB][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_loadu_ps(o + r * ldo + c + 8 * j);
    for (int tt = 0; tt < nt; ++tt) {
      const float* xt = x + tt * ldx + c;
      const __m256 x0 = _mm256_loadu_ps(xt), x1 = _mm256_loadu_ps(xt + 8), x2 = _mm256_loadu_ps(xt + 16),
                   x3 = _mm256_loadu_ps(xt + 24);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) fma4(acc[r], _mm256_broadcast_ss(w + r * TILE + tt), x0, x1, x2, x3);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + r * ldo + c + 8 * j, acc[r][j]);
  }
  for (; c + 8 <= c1; c += 8) {
    __m256 acc[RB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_loadu_ps(o + r * ldo + c);
    for (int tt = 0; tt < nt; ++tt) {
      const __m256 xv = _mm256_loadu_ps(x + tt * ldx + c);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * TILE + tt), xv, acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(o + r * ldo + c, acc[r]);
  }
  if (c < c1) weighted_rows<RB>(w, x, ldx, nt, o, ldo, c, c1);
}
#define VQ_WEIGHTED_ROWS weighted_rows_avx

// weighted_rows_avx over 4-bit codes with groups along channels (token tt's row: its dv codes, two per byte, low
// nibble first), each code converted in registers as it is used: o[r * ldo + c] += sum_tt w[r * TILE + tt] *
// code(tt, c) for c in [c0, c1), multiples of 8 * NV. The values are not written out as floats and read back.
// NV vectors of 8 columns per pass: 4, or 2 so that up to six rows' accumulators fit the 16 registers.
template <int RB, int NV>
inline void weighted_rows_u4_avx(const float* w, const View::Head& VW, int64_t t0, int nt, float* o, int ldo, int c0,
                                 int c1) {
  static_assert(NV == 4 || NV == 2, "32 or 16 columns per pass");
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nibble = _mm256_set1_epi32(15);
  auto eight = [&](const uint8_t* q) {  // codes of 8 columns from 4 bytes
    uint32_t u;
    std::memcpy(&u, q, 4);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(u)), shifts), nibble));
  };
  for (int c = c0; c + 8 * NV <= c1; c += 8 * NV) {
    __m256 acc[RB][NV];
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_loadu_ps(o + r * ldo + c + 8 * j);
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* q = VW.row(t0 + tt) + c / 2;
      __m256 x[NV];
      for (int j = 0; j < NV; ++j) x[j] = eight(q + 4 * j);
#pragma GCC unroll 6
      for (int r = 0; r < RB; ++r) {
        const __m256 p = _mm256_broadcast_ss(w + r * TILE + tt);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(p, x[j], acc[r][j]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + r * ldo + c + 8 * j, acc[r][j]);
  }
}

// Query rows of a group in blocks straight from the codes: R rows in as few blocks as the registers allow (three
// rows of 32 accumulators, or six of 16 per pass over half a tile or 16 value columns), sizes balanced (R = 4:
// 2 + 2, not 3 + 1: a one-row block converts as many codes as a three-row one for a third of the multiply-adds).
// NV = 0: no fused block of R rows (the tile is decoded once to floats and scored / weighted from there).
struct RowPlan {
  int nv = 4, blocks = 1;
  int start[MAX_R + 1] = {};
};

inline RowPlan row_plan(int R, int nv) {
  RowPlan p;
  p.nv = nv;
  const int most = nv == 4 ? 3 : 6;
  p.blocks = (R + most - 1) / most;
  for (int b = 0; b <= p.blocks; ++b) p.start[b] = (b * R) / p.blocks;  // balanced: sizes differ by at most one
  return p;
}

// A whole tile of 8-bit key codes scored for R rows by `plan` (rows of qs ldq apart). Switches, not function
// tables: the calls inline.
inline void score_u8_tile(const RowPlan& plan, const float* qs, int ldq, const float* base, const View::Head& KW,
                          int64_t t0, int d, int64_t prefetch_at, float* s) {
  for (int b = 0; b < plan.blocks; ++b) {
    const int r0 = plan.start[b], rb = plan.start[b + 1] - r0;
    const float *q = qs + r0 * ldq, *bs = base + r0;
    float* out = s + r0 * TILE;
    const int64_t at = b == 0 ? prefetch_at : -1;
    if (plan.nv == 4) {
      switch (rb) {
        case 3: score_rows_u8_avx<3, 4>(q, ldq, bs, KW, t0, 0, d, at, out); break;
        case 2: score_rows_u8_avx<2, 4>(q, ldq, bs, KW, t0, 0, d, at, out); break;
        default: score_rows_u8_avx<1, 4>(q, ldq, bs, KW, t0, 0, d, at, out);
      }
      continue;
    }
    for (int half = 0; half < 2; ++half) {
      const int v0 = 2 * half;
      const int64_t pf = half ? -1 : at;
      switch (rb) {
        case 6: score_rows_u8_avx<6, 2>(q, ldq, bs, KW, t0, v0, d, pf, out); break;
        case 5: score_rows_u8_avx<5, 2>(q, ldq, bs, KW, t0, v0, d, pf, out); break;
        case 4: score_rows_u8_avx<4, 2>(q, ldq, bs, KW, t0, v0, d, pf, out); break;
        case 3: score_rows_u8_avx<3, 2>(q, ldq, bs, KW, t0, v0, d, pf, out); break;
        case 2: score_rows_u8_avx<2, 2>(q, ldq, bs, KW, t0, v0, d, pf, out); break;
        default: score_rows_u8_avx<1, 2>(q, ldq, bs, KW, t0, v0, d, pf, out);
      }
    }
  }
}

// Weighted 4-bit value codes for R rows by `plan` (weights w[r * TILE + tt], output rows ldo apart).
inline void weight_u4_tile(const RowPlan& plan, const float* w, const View::Head& VW, int64_t t0, int nt, float* o,
                           int ldo, int c0, int c1) {
  for (int b = 0; b < plan.blocks; ++b) {
    const int r0 = plan.start[b], rb = plan.start[b + 1] - r0;
    const float* wr = w + r0 * TILE;
    float* orow = o + r0 * ldo;
    if (plan.nv == 4) {
      switch (rb) {
        case 3: weighted_rows_u4_avx<3, 4>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
        case 2: weighted_rows_u4_avx<2, 4>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
        default: weighted_rows_u4_avx<1, 4>(wr, VW, t0, nt, orow, ldo, c0, c1);
      }
      continue;
    }
    switch (rb) {
      case 6: weighted_rows_u4_avx<6, 2>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
      case 5: weighted_rows_u4_avx<5, 2>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
      case 4: weighted_rows_u4_avx<4, 2>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
      case 3: weighted_rows_u4_avx<3, 2>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
      case 2: weighted_rows_u4_avx<2, 2>(wr, VW, t0, nt, orow, ldo, c0, c1); break;
      default: weighted_rows_u4_avx<1, 2>(wr, VW, t0, nt, orow, ldo, c0, c1);
    }
  }
}
#else
#define VQ_WEIGHTED_ROWS weighted_rows
#endif

inline void weighted_tile(int R, const float* w, const float* x, int ldx, int nt, float* o, int ldo, int c0, int c1) {
  for (int r0 = 0; r0 < R; r0 += ROW_BLOCK) {
    int rb = std::min(ROW_BLOCK, R - r0);
    const float* wr = w + r0 * TILE;
    float* orow = o + r0 * ldo;
    if (rb == 3) VQ_WEIGHTED_ROWS<3>(wr, x, ldx, nt, orow, ldo, c0, c1);
    else if (rb == 2) VQ_WEIGHTED_ROWS<2>(wr, x, ldx, nt, orow, ldo, c0, c1);
    else VQ_WEIGHTED_ROWS<1>(wr, x, ldx, nt, orow, ldo, c0, c1);
  }
}

// Sum of a[c] * b[c], n a multiple of 8 (eight partial sums: the compiler keeps them in one vector register).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int c = 0; c < n; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[c + j] * b[c + j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// out[r] = dot(q + r * ldq, x, n) for r < R (n a multiple of 8), x loaded once for up to three rows (token-by-token
// key scoring dotted every row with the token's decoded codes one row at a time); the lanes summed pairwise.
#if defined(__AVX2__) && defined(__FMA__)
template <int RB>
inline void dots_avx(const float* q, int ldq, const float* x, int n, float* out) {
  __m256 a[RB];
  for (int r = 0; r < RB; ++r) a[r] = _mm256_setzero_ps();
  for (int c = 0; c < n; c += 8) {
    const __m256 xv = _mm256_loadu_ps(x + c);
    for (int r = 0; r < RB; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * ldq + c), xv, a[r]);
  }
  // the rows' horizontal sums together: two pairwise additions within 128-bit lanes, then the two lanes
  const __m256 h01 = _mm256_hadd_ps(a[0], RB > 1 ? a[1] : a[0]);
  const __m256 h2 = _mm256_hadd_ps(RB > 2 ? a[2] : a[0], RB > 2 ? a[2] : a[0]);
  const __m256 h = _mm256_hadd_ps(h01, h2);  // lane j (of each 128-bit half): row j's partial sum (j = 3: row 2)
  alignas(16) float t[4];
  _mm_store_ps(t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int r = 0; r < RB; ++r) out[r] = t[r];
}

// Eight tokens' dots with one query row: lane i of the result is sum_c q[c] * xb[i * d + c] (xb: eight decoded
// token rows, d a multiple of 8): eight accumulators, then one transposing reduction instead of eight.
inline __m256 dots8_avx(const float* q, const float* xb, int d) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int c = 0; c < d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(_mm256_load_ps(xb + i * d + c), qv, a[i]);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

inline void row_dots(const float* q, int ldq, const float* x, int n, int R, float* out) {
  int r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; r + 3 <= R; r += 3) dots_avx<3>(q + r * ldq, ldq, x, n, out + r);
  if (R - r == 2) dots_avx<2>(q + r * ldq, ldq, x, n, out + r), r += 2;
  if (R - r == 1) dots_avx<1>(q + r * ldq, ldq, x, n, out + r), r += 1;
#endif
  for (; r < R; ++r) out[r] = dot(q + r * ldq, x, n);
}

// `dot` for any n (the rotations: a plain loop is one dependent chain of n multiply-adds, which at a few hundred
// tokens cost the kernel more than its tiles).
inline float dot_any(const float* a, const float* b, int n) {
  const int n8 = n / 8 * 8;
  float acc = n8 ? dot(a, b, n8) : 0.0f;
  for (int c = n8; c < n; ++c) acc += a[c] * b[c];
  return acc;
}

// Group k's scale (or bias) of tokens [t0, t0 + nt) of one head into out: eight at a time when they are float16
// and adjacent (one group per token, as the default's values), one load and conversion per token otherwise.
inline void load_token_scales(const View::Head& S, ScaleType dt, int k, int64_t t0, int nt, float* out) {
  int tt = 0;
#if defined(__F16C__) && defined(__AVX__)
  if (dt == ScaleType::f16 && S.srow == int64_t(sizeof(uint16_t))) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(S.row(t0)) + k;
    for (; tt + 8 <= nt; tt += 8)
      _mm256_storeu_ps(out + tt, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + tt))));
  }
#endif
  for (; tt < nt; ++tt) out[tt] = load_scale(S.row(t0 + tt), dt, k);
}

// Scores of tokens [t0, t0 + nt) of head g for codes with groups along channels (per token): each token's codes
// (or levels) decoded once into a row and dotted with every query row, the group's scale applied to the dot and
// its bias through the row's per-group query sums qgs (R x d/group). ADD: adds to s instead of writing base + ...
// SUMMED: a second stream under the same scales (RVQ) whose levels add to the first's before the dots.
template <bool ADD>
void score_tokens(const Codes& C, int64_t g, int R, const float* qc, const float* qgs, const float* base,
                  int64_t t0, int nt, float* s, const Codes* summed = nullptr) {
  const int d = C.d, grp = C.group, groups = d / grp;
  const auto W = C.w.head(g), S = C.scales.head(g), Bh = C.biases.head(g);
  const auto W2 = summed ? summed->w.head(g) : View::Head{nullptr, 0};
  const bool affine = C.biases.base || C.zero != 0.0f;
  alignas(64) float x[MAX_D], x2[MAX_D];
  int tt = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (!ADD && groups == 1 && !affine && d % 8 == 0) {  // one scale per token, no bias (codebook keys): 8 at a time
    alignas(64) float xb[8 * MAX_D];
    for (; tt + 8 <= nt; tt += 8) {
      alignas(32) float sc8[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t t = t0 + tt + i;
        float* xi = xb + i * d;
        C.values(W.row(t), 0, d, xi);
        if (summed) {
          summed->values(W2.row(t), 0, d, x2);
          for (int c = 0; c < d; ++c) xi[c] += x2[c];
        }
        sc8[i] = load_scale(S.row(t), C.dtype, 0);
      }
      const __m256 scv = _mm256_load_ps(sc8);
      for (int r = 0; r < R; ++r) {
        const __m256 dots = dots8_avx(qc + r * d, xb, d);
        _mm256_storeu_ps(s + r * TILE + tt, _mm256_fmadd_ps(scv, dots, _mm256_set1_ps(base[r])));
      }
    }
  }
#endif
  for (; tt < nt; ++tt) {
    const int64_t t = t0 + tt;
    C.values(W.row(t), 0, d, x);
    if (summed) {
      summed->values(W2.row(t), 0, d, x2);
      for (int c = 0; c < d; ++c) x[c] += x2[c];
    }
    float acc[MAX_R];
    for (int r = 0; r < R; ++r) acc[r] = ADD ? s[r * TILE + tt] : base[r];
    for (int k = 0; k < groups; ++k) {
      const float sc = load_scale(S.row(t), C.dtype, k);
      float dk[MAX_R];
      row_dots(qc + k * grp, d, x + k * grp, grp, R, dk);
      for (int r = 0; r < R; ++r) acc[r] += sc * dk[r];
      if (affine) {
        const float bc = C.biases.base ? load_scale(Bh.row(t), C.dtype, k) : -C.zero * sc;
        for (int r = 0; r < R; ++r) acc[r] += bc * qgs[r * groups + k];
      }
    }
    for (int r = 0; r < R; ++r) s[r * TILE + tt] = acc[r];
  }
}

// 1-bit codes with one scale per token (TurboQuant-Prod's QJL signs): per query row a table over the byte values
// of each 8 coordinates, lut[(r * bytes + j) * 256 + v] = sum_i q[8j + i] * levels[bit i of v], built once per
// task; a token's term is then one lookup per byte instead of 8 decoded levels and a dot.
void build_sign_tables(const float* q, int R, int m, const float* levels, float* lut) {
  const int nb = m / 8;
  const float l0 = levels[0], dl = levels[1] - levels[0];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nb; ++j) {
      float* T = lut + (int64_t(r) * nb + j) * 256;
      const float* qq = q + r * m + 8 * j;
      float base = 0.0f;
      for (int i = 0; i < 8; ++i) base += qq[i] * l0;
      T[0] = base;
      for (int v = 1; v < 256; ++v) T[v] = T[v & (v - 1)] + qq[__builtin_ctz(unsigned(v))] * dl;
    }
}

// s[r * TILE + tt] += scale_t * sum_j lut_r[j][byte j of token t] for tokens [t0, t0 + nt) of head g.
// Rows in blocks of up to three, their sums interleaved: each row's sum is a chain of dependent additions, and
// one chain at a time waited on every addition's latency.
template <int RB>
inline void sign_rows(const uint8_t* bytes, int nb, const float* lut, float sc, float* s, int tt) {
  float acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = 0.0f;
  for (int j = 0; j < nb; ++j) {
    const int b = j * 256 + bytes[j];
    for (int r = 0; r < RB; ++r) acc[r] += lut[int64_t(r) * nb * 256 + b];
  }
  for (int r = 0; r < RB; ++r) s[r * TILE + tt] += sc * acc[r];
}

void score_sign_tokens(const Codes& C, int64_t g, int R, const float* lut, int64_t t0, int nt, float* s) {
  const int nb = C.d / 8;
  const auto W = C.w.head(g), S = C.scales.head(g);
  for (int tt = 0; tt < nt; ++tt) {
    const int64_t t = t0 + tt;
    const uint8_t* bytes = W.row(t);
    const float sc = load_scale(S.row(t), C.dtype, 0);
    int r = 0;
    for (; r + 3 <= R; r += 3) sign_rows<3>(bytes, nb, lut + int64_t(r) * nb * 256, sc, s + r * TILE, tt);
    for (; r < R; ++r) sign_rows<1>(bytes, nb, lut + int64_t(r) * nb * 256, sc, s + r * TILE, tt);
  }
}

// Online softmax over a tile's scores s[r * TILE + tt] (base 2): updates m and l, rescales o, leaves the tile's
// weights 2**(s - m) in s.
inline void softmax_tile(Partial& P, int R, int nt, int dv, float* s) {
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * TILE;
    float mt = P.m[r];
    for (int tt = 0; tt < nt; ++tt) mt = std::max(mt, sr[tt]);
    float alpha = exp2_nonpositive(P.m[r] - mt);
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    if (nt == TILE) {  // a whole tile: 8 exponentials at a time, the same polynomial
      const __m256 m8 = _mm256_set1_ps(mt);
      __m256 acc = _mm256_setzero_ps();
      for (int tt = 0; tt < TILE; tt += 8) {
        __m256 e = exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(sr + tt), m8));
        _mm256_store_ps(sr + tt, e);
        acc = _mm256_add_ps(acc, e);
      }
      alignas(32) float part[8];
      _mm256_store_ps(part, acc);
      sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    } else
#endif
    {
      for (int tt = 0; tt < nt; ++tt) {
        sr[tt] = exp2_nonpositive(sr[tt] - mt);
        sum += sr[tt];
      }
    }
    for (int tt = nt; tt < TILE; ++tt) sr[tt] = 0.0f;
    P.m[r] = mt;
    P.l[r] = P.l[r] * alpha + sum;
    if (alpha != 1.0f) {
      float* o = P.o + r * dv;
      for (int c = 0; c < dv; ++c) o[c] *= alpha;
    }
  }
}

// Online-softmax update of a partial with a tile of scores s[r * TILE + tt] and values vals[tt * dv + c].
inline void absorb(Partial& P, int R, int nt, int dv, float* s, const float* vals) {
  softmax_tile(P, R, nt, dv, s);
  weighted_tile(R, s, vals, dv, nt, P.o, dv, 0, dv);
}

void init_partial(Partial& P, int R, int dv, bool coded) {
  for (int r = 0; r < R; ++r) {
    P.m[r] = NEG;
    P.l[r] = 0.0f;
  }
  std::fill(P.o, P.o + R * dv, 0.0f);
  P.coded = coded;
  P.tail = false;  // (partials are reused across calls: the tail task sets it after)
}

// How R query rows read the default's codes: 4 or 2 vectors per row block straight from the codes (row_plan),
// or 0: the tile decoded once to floats and read from there. which: 0 keys (8-bit, groups along tokens), 1 values
// (4-bit, groups along channels). `set_row_plan` overrides it (benchmarks/attention.py --row-plans).
std::atomic<int> g_row_plan[2] = {-1, -1};

// Measured at 16k tokens, 4 KV heads, d 64 / 128 (--row-plans, 2-core VM, 11 interleaved repeats): R <= 3 whole
// tiles (4) fastest; R 4..7 half tiles (2) for both, 8-18 % under decoding once (R=5, d=128: 4.59 vs 5.31 ms);
// from R = 8 values decoded once win by 2-4 % at d = 128 (tie at d = 64), keys stay within 3 % of either.
inline int auto_vectors(int which, int R) {
  if (R <= 3) return 4;
  return which == 1 && R >= 8 ? 0 : 2;
}

inline int plan_vectors(int which, int R) {
  const int forced = g_row_plan[which].load(std::memory_order_relaxed);
  return forced >= 0 ? forced : auto_vectors(which, R);
}

// Tokens [t_begin, t_end) of head g's codes; t_begin is a multiple of TILE (tiles of codes grouped along tokens
// lie in one group), and tokens before `valid_from` (a span starting inside the first tile) are masked out.
void coded_task(const Problem& pr, int64_t g, int64_t t_begin, int64_t t_end, int64_t valid_from, Partial& P) {
  const int R = pr.R, d = pr.d, dv = pr.dv;
  init_partial(P, R, dv, true);
  // queries in the keys' rotated domain (q_rot = Pk q), and q . mu_k (per-token keys store x - mu)
  alignas(64) float qr[MAX_R * MAX_D];
  float qmu[MAX_R];
  const float* qg = pr.q + g * R * d;
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < d; ++i) qr[r * d + i] = dot_any(pr.pk + i * d, qg + r * d, d);
    qmu[r] = pr.kmu ? dot_any(qg + r * d, pr.kmu + (g % pr.kmu_rows) * d, d) : 0.0f;
  }
  const Codes &K = pr.k, &V = pr.v;
  // Per-group query sums (the biases of per-token key codes), and the second key stream's query (pk2 q).
  alignas(64) float qgs[MAX_R * MAX_D / 8], q2[MAX_R * MAX_D], qgs2[MAX_R * MAX_D / 8];
  if (!K.tokens_last)
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < d / K.group; ++k) {
        float acc = 0.0f;
        for (int c = k * K.group; c < (k + 1) * K.group; ++c) acc += qr[r * d + c];
        qgs[r * (d / K.group) + k] = acc;
      }
  if (pr.has_k2 && !pr.k2_summed) {
    const int m2 = pr.m2;
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < m2; ++i) q2[r * m2 + i] = dot_any(pr.pk2 + int64_t(i) * d, qg + r * d, d);
      for (int k = 0; k < m2 / pr.k2.group; ++k) {
        float acc = 0.0f;
        for (int c = k * pr.k2.group; c < (k + 1) * pr.k2.group; ++c) acc += q2[r * m2 + c];
        qgs2[r * (m2 / pr.k2.group) + k] = acc;
      }
    }
  }
  // Sign codes (1 bit, one scale per token, no bias): scored through per-row byte tables.
  static thread_local std::vector<float> sign_tables;
  const bool signs = pr.has_k2 && !pr.k2_summed && pr.k2.bits == 1 && pr.k2.group == pr.m2 && pr.k2.levels;
  if (signs) {
    sign_tables.resize(size_t(R) * (pr.m2 / 8) * 256);
    build_sign_tables(q2, R, pr.m2, pr.k2.levels, sign_tables.data());
  }
  // Keys with groups along tokens: a tile lies in one group, so each channel's scale folds into the query and
  // its bias into a per-row constant; the tile's codes are scored as they are (no decoded copy).
  const bool fold_keys = K.tokens_last && !K.levels && K.biases.base;
  // Values with groups along channels: each token's scale folds into its weight, its bias into a per-row sum.
  const bool fold_values = !V.tokens_last;
  // 8-bit block keys and 4-bit affine values (the default's) straight from their codes, rows in blocks (row_plan)
#if defined(__AVX2__) && defined(__FMA__)
  const int key_nv = plan_vectors(0, R), value_nv = plan_vectors(1, R);
  const RowPlan key_plan = row_plan(R, key_nv ? key_nv : 4), value_plan = row_plan(R, value_nv ? value_nv : 4);
  const bool fused_values = fold_values && !pr.has_v2 && V.bits == 4 && !V.levels && value_nv &&
                            V.group % (8 * value_nv) == 0;
#else
  const bool fused_values = false;
#endif
  alignas(64) float kt[MAX_D * TILE];   // keys, channel-major: kt[c * TILE + tt]
  alignas(64) float vt[TILE * MAX_D];   // values, token-major: vt[tt * dv + c]
  alignas(64) float s[MAX_R * TILE], w[MAX_R * TILE];
  alignas(64) float qs[MAX_R * MAX_D];
  float base[MAX_R];
  const uint8_t* mask = pr.cmask ? pr.cmask + g * pr.n : nullptr;
  int64_t folded_block = -1, offset_block = -1;
  alignas(64) float qo[MAX_R * MAX_D];  // the queries turned back to the current offset block's first position
  const auto KW = K.w.head(g), KS = K.scales.head(g), KB = K.biases.head(g);
  const auto VW = V.w.head(g), VS = V.scales.head(g), VB = V.biases.head(g);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += TILE) {
    int nt = int(std::min<int64_t>(TILE, t_end - t0));
    bool scored = false;  // this tile's scores already written (8-bit keys scored from the codes)
    if (fold_keys) {
      int64_t blk = t0 / K.group;
      if (blk != folded_block) {  // a new block: its per-channel scales into the queries, biases into base
        folded_block = blk;
        for (int r = 0; r < R; ++r) base[r] = qmu[r];
        for (int c = 0; c < d; ++c) {
          float sc = load_scale(KS.row(c), K.dtype, blk);
          float bc = load_scale(KB.row(c), K.dtype, blk);
          for (int r = 0; r < R; ++r) {
            qs[r * d + c] = qr[r * d + c] * sc;
            base[r] += qr[r * d + c] * bc;
          }
        }
      }
      // Each channel is its own stream through memory (rows of the transposed codes): prefetch a few tiles
      // ahead, more streams than the hardware prefetchers follow.
      const int64_t ahead = ((t0 + PREFETCH_TILES * TILE) * K.bits) / 8;
      const bool pf = t0 + PREFETCH_TILES * TILE < t_end;
#if defined(__AVX2__) && defined(__FMA__)
      if (K.bits == 8 && nt == TILE && key_nv) {  // (the default's keys) scored straight from the codes
        score_u8_tile(key_plan, qs, d, base, KW, t0, d, pf ? ahead : -1, s);
        scored = true;
      } else
#endif
      for (int c = 0; c < d; ++c) {
        if (pf) __builtin_prefetch(KW.row(c) + ahead);
        fields(KW.row(c), t0, nt, K.bits, kt + c * TILE);
      }
    } else if (K.tokens_last) {
      K.decode<true>(g, t0, nt, kt);
    }
    if (K.tokens_last && !scored) {
      if (nt < TILE)  // a last partial tile: zero the unused key slots so full-width loops read defined values
        for (int c = 0; c < d; ++c) std::fill(kt + c * TILE + nt, kt + (c + 1) * TILE, 0.0f);
      score_tile(R, fold_keys ? qs : qr, fold_keys ? base : qmu, kt, d, s);
    } else if (!K.tokens_last) {
      score_tokens<false>(K, g, R, qr, qgs, qmu, t0, nt, s, pr.k2_summed ? &pr.k2 : nullptr);
    }
    if (signs) score_sign_tokens(pr.k2, g, R, sign_tables.data(), t0, nt, s);
    else if (pr.has_k2 && !pr.k2_summed) score_tokens<true>(pr.k2, g, R, q2, qgs2, nullptr, t0, nt, s);
    if (pr.otable) {  // (t0 is a multiple of TILE, which divides oblock: the tile lies in one offset block)
      const int64_t ob = t0 / pr.oblock;
      if (ob != offset_block) {
        offset_block = ob;
        rotate_back(pr, qg, R, d, pr.oturns + (g * pr.oturn_blocks + ob) * pr.odims, qo);
      }
      const float* u = pr.otable + ((g % pr.otable_rows) * (pr.oblock / TILE) + (t0 % pr.oblock) / TILE) * d * TILE;
      add_score_tile(R, qo, u, d, s);
    }
    if (mask)
      for (int r = 0; r < R; ++r)
        for (int tt = 0; tt < nt; ++tt)
          if (!mask[t0 + tt]) s[r * TILE + tt] = NEG;
    if (t0 < valid_from)
      for (int r = 0; r < R; ++r)
        for (int tt = 0; tt < std::min<int64_t>(nt, valid_from - t0); ++tt) s[r * TILE + tt] = NEG;
    softmax_tile(P, R, nt, dv, s);
    if (fold_values) {
      int groups = dv / V.group;
      if (!fused_values)
        for (int tt = 0; tt < nt; ++tt) V.values(VW.row(t0 + tt), 0, dv, vt + tt * dv);
      if (pr.has_v2) {  // the second stream's levels add to the first's (same scales, same rotation)
        const auto V2W = pr.v2.w.head(g);
        alignas(64) float x2[MAX_D];
        for (int tt = 0; tt < nt; ++tt) {
          pr.v2.values(V2W.row(t0 + tt), 0, dv, x2);
          float* row = vt + tt * dv;
          for (int c = 0; c < dv; ++c) row[c] += x2[c];
        }
      }
      for (int k = 0; k < groups; ++k) {
        float sc[TILE], bc[TILE];
        load_token_scales(VS, V.dtype, k, t0, nt, sc);
        if (V.biases.base) load_token_scales(VB, V.dtype, k, t0, nt, bc);
        else
          for (int tt = 0; tt < nt; ++tt) bc[tt] = -V.zero * sc[tt];
        for (int r = 0; r < R; ++r) {
          const float* sr = s + r * TILE;
          float* wr = w + r * TILE;
          for (int tt = 0; tt < nt; ++tt) wr[tt] = sr[tt] * sc[tt];
          const float bsum = nt == TILE ? dot(sr, bc, TILE) : dot_any(sr, bc, nt);  // (eight partial sums)
          float* o = P.o + r * dv;
          for (int c = k * V.group; c < (k + 1) * V.group; ++c) o[c] += bsum;
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (fused_values) {
          weight_u4_tile(value_plan, w, VW, t0, nt, P.o, dv, k * V.group, (k + 1) * V.group);
          continue;
        }
#endif
        weighted_tile(R, w, vt, dv, nt, P.o, dv, k * V.group, (k + 1) * V.group);
      }
    } else {
      V.decode<false>(g, t0, nt, vt);
      weighted_tile(R, s, vt, dv, nt, P.o, dv, 0, dv);
    }
  }
}

void exact_task(const Problem& pr, int64_t g, Partial& P) {
  const int R = pr.R, d = pr.d, dv = pr.dv;
  init_partial(P, R, dv, false);
  const float* qg = pr.q + g * R * d;
  const uint8_t* mask_g = pr.emask ? pr.emask + g * (pr.emask_rows ? R : 1) * pr.ne : nullptr;
  const auto EK = pr.ek.head(g), EV = pr.ev.head(g);
  alignas(64) float s[MAX_R * TILE];
  for (int64_t t0 = 0; t0 < pr.ne; t0 += TILE) {
    int nt = int(std::min<int64_t>(TILE, pr.ne - t0));
    for (int r = 0; r < R; ++r)
      for (int tt = 0; tt < nt; ++tt) {
        const uint8_t* mask = mask_g && pr.emask_rows ? mask_g + r * pr.ne : mask_g;
        // eight partial sums, not one dependent chain of d multiply-adds per score (the tail is read every step)
        const float acc = dot_any(qg + r * d, reinterpret_cast<const float*>(EK.row(t0 + tt)), d);
        s[r * TILE + tt] = (mask && !mask[t0 + tt]) ? NEG : acc;
      }
    alignas(64) float vals[TILE * MAX_D];
    for (int tt = 0; tt < nt; ++tt)
      std::memcpy(vals + tt * dv, EV.row(t0 + tt), sizeof(float) * dv);
    absorb(P, R, nt, dv, s, vals);
  }
}

// Below this many (head, token) pairs a step runs on the calling thread: waking the workers costs more than the
// work (SmolLM2 in the model, 3 KV heads: serial 1.0-1.6 ms/step faster at 200 and 600 tokens, even at 1000,
// slower at 1500; this 2-core VM, paired in one process).
constexpr int64_t PARALLEL_MIN_TOKENS = 2048;

void solve(const Problem& pr) {
  Pool& workers = pool();
  // Coded tokens split into chunks (whole tiles from a multiple of TILE, within one span) so every thread gets
  // work even with few heads: (first token, end, first token attended) per chunk.
  std::vector<int64_t> spans = pr.spans.empty() ? std::vector<int64_t>{0, pr.n} : pr.spans;
  int64_t tiles = 0, covered = 0;
  for (size_t j = 0; j < spans.size(); j += 2)
    if (spans[j + 1] > spans[j]) {
      tiles += (spans[j + 1] - spans[j] / TILE * TILE + TILE - 1) / TILE;
      covered += spans[j + 1] - spans[j];
    }
  int64_t want = covered >= 512 ? std::max<int64_t>(1, (2 * workers.size() + pr.G - 1) / pr.G) : 1;
  int64_t tiles_per = tiles ? (tiles + std::min(want, tiles) - 1) / std::min(want, tiles) : 0;
  std::vector<std::array<int64_t, 3>> ranges;
  for (size_t j = 0; j < spans.size(); j += 2) {
    const int64_t lo = spans[j], hi = spans[j + 1];
    if (hi <= lo) continue;  // (an empty span: no chunk of masked tokens only)
    for (int64_t a = lo / TILE * TILE; a < hi; a += tiles_per * TILE)
      ranges.push_back({a, std::min(hi, a + tiles_per * TILE), lo});
  }
  const int64_t chunks = int64_t(ranges.size());
  // the tail: whole tiles, one chunk per head (it is short: at most a key block)
  const int64_t tail_n = pr.tail ? pr.tail->n : 0, tail_chunks = tail_n ? 1 : 0;
  int64_t per_g = chunks + tail_chunks + (pr.ne ? 1 : 0);
  // Reused across calls (one decode step per layer): no allocation, no page faults per step.
  static thread_local std::vector<Partial> parts_buffer;
  static thread_local std::vector<float> outs;
  std::vector<Partial>& parts = parts_buffer;  // (a thread_local named inside the lambda would be the worker's)
  parts.resize(size_t(pr.G * per_g));
  outs.resize(parts.size() * size_t(pr.R * pr.dv));
  for (size_t i = 0; i < parts.size(); ++i) parts[i].o = outs.data() + i * size_t(pr.R * pr.dv);
  workers.run(int(pr.G * per_g), [&](int task) {
    int64_t g = task / per_g, i = task % per_g;
    Partial& P = parts[size_t(task)];
    if (i < chunks) {
      const auto& c = ranges[size_t(i)];
      coded_task(pr, g, c[0], c[1], c[2], P);
    } else if (i < chunks + tail_chunks) {
      coded_task(*pr.tail, g, 0, tail_n, 0, P);
      P.tail = true;
    } else {
      exact_task(pr, g, P);
    }
  }, pr.G * (covered + tail_n + pr.ne) >= PARALLEL_MIN_TOKENS);
  const int R = pr.R, dv = pr.dv;
  for (int64_t g = 0; g < pr.G; ++g) {
    for (int r = 0; r < R; ++r) {
      float m = NEG;
      for (int64_t i = 0; i < per_g; ++i) m = std::max(m, parts[size_t(g * per_g + i)].m[r]);
      float sink_w = 0.0f;
      if (pr.sinks) {
        float sl = pr.sinks[g * R + r];
        float m2 = std::max(m, sl);
        sink_w = exp2_nonpositive(sl - m2);
        m = m2;
      }
      float l = sink_w, wc = 0.0f, wt = 0.0f;
      float orot[MAX_D], otail[MAX_D], oex[MAX_D];
      std::fill(orot, orot + dv, 0.0f);
      std::fill(otail, otail + dv, 0.0f);
      std::fill(oex, oex + dv, 0.0f);
      for (int64_t i = 0; i < per_g; ++i) {
        const Partial& P = parts[size_t(g * per_g + i)];
        float a = exp2_nonpositive(P.m[r] - m);
        l += a * P.l[r];
        float* acc = P.tail ? otail : P.coded ? orot : oex;
        if (P.tail) wt += a * P.l[r];
        else if (P.coded) wc += a * P.l[r];
        for (int c = 0; c < dv; ++c) acc[c] += a * P.o[r * dv + c];
      }
      float* out = pr.out + (g * R + r) * dv;
      float acc[MAX_D];
      for (int c = 0; c < dv; ++c) acc[c] = oex[c];
      // each coded part's values: y @ Pi back from its rotated domain, row by row (independent lanes, not one
      // chain per output), plus its mean with its total weight
      for (const Problem* part : {&pr, pr.tail}) {
        if (!part) continue;
        const bool is_tail = part != &pr;
        const float* vmu = part->vmu ? part->vmu + (g % part->vmu_rows) * dv : nullptr;
        const float w = is_tail ? wt : wc, *o = is_tail ? otail : orot;
        if (vmu)
          for (int c = 0; c < dv; ++c) acc[c] += w * vmu[c];
        for (int j = 0; j < dv; ++j) {
          const float y = o[j], *row = part->pv + j * dv;
          for (int c = 0; c < dv; ++c) acc[c] += y * row[c];
        }
      }
      for (int c = 0; c < dv; ++c) out[c] = acc[c] / l;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// the MLX primitive
// ------------------------------------------------------------------------------------------------
struct Params {
  bool k_tokens_last, v_tokens_last;
  int k_bits, k_group, v_bits, v_group;
  float v_zero;  // symmetric values' zero level when the values have no biases
  float k_zero;  // symmetric per-token keys' zero level when the keys have no biases and no levels
  bool has_kb, has_kmu, has_vmu, has_vb, has_cmask, has_emask, has_sinks, has_klev, has_vlev;
  int k2_bits, k2_group, v2_bits;  // 0: no second stream
  bool k2_summed;
  // the tail (Problem::tail), codes tokens first: t_k_bits 0 when there is none
  int t_k_bits, t_k_group, t_v_bits, t_v_group;
  float t_k_zero, t_v_zero;  // symmetric levels' zero where there are no biases
  bool t_has_kb, t_has_vb, t_has_kmu, t_has_vmu, t_has_cmask;
  // the key offset (Problem::otable): of the coded part, of the tail; its pairs' layout and block
  bool has_coffset, has_toffset;
  int o_dims, o_trad, o_block;

  bool operator==(const Params& o) const { return std::memcmp(this, &o, sizeof(Params)) == 0; }
};

// inputs: q, pk, pv, kw, ks, [kb], vw, vs, [vb], ek, ev, [kmu], [vmu], [cmask], [emask], [sinks], [k_levels],
// [v_levels], [k2w, k2s, pk2, k2_levels], [v2w, v2_levels], [tkw, tks, [tkb], tvw, tvs, [tvb], tpk, tpv, [tkmu],
// [tvmu], [tcmask]], [ctable, cturns], [ttable, tturns]
class CodedDecodeAttention : public UnaryPrimitive {
 public:
  CodedDecodeAttention(Stream s, Params p, std::vector<int64_t> spans)
      : UnaryPrimitive(s), p_(p), spans_(std::move(spans)) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override;
  void eval_gpu(const std::vector<array>& inputs, array& out) override {
    throw std::runtime_error("veloxquant coded attention has no GPU implementation (use the MLX reference)");
  }
  const char* name() const override { return "VeloxquantCodedDecodeAttention"; }
  bool is_equivalent(const Primitive& other) const override {
    const auto& o = static_cast<const CodedDecodeAttention&>(other);
    return p_ == o.p_ && spans_ == o.spans_;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    auto sh = inputs[0].shape();
    sh.back() = inputs[2].shape(0);  // (B, H, R, dv)
    return {sh};
  }

 private:
  Params p_;
  std::vector<int64_t> spans_;  // Problem::spans
};

void CodedDecodeAttention::eval_cpu(const std::vector<array>& inputs, array& out) {
  out.set_data(allocator::malloc(out.nbytes()));
  auto& enc = cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([inputs = inputs, out = array::unsafe_weak_copy(out), p = p_, spans = spans_]() mutable {
    size_t i = 0;
    const array &q = inputs[i++], &pk = inputs[i++], &pv = inputs[i++];
    const array &kw = inputs[i++], &ks = inputs[i++];
    const array* kb = p.has_kb ? &inputs[i++] : nullptr;
    const array &vw = inputs[i++], &vs = inputs[i++];
    const array* vb = p.has_vb ? &inputs[i++] : nullptr;
    const array &ek = inputs[i++], &ev = inputs[i++];
    const array* kmu = p.has_kmu ? &inputs[i++] : nullptr;
    const array* vmu = p.has_vmu ? &inputs[i++] : nullptr;
    const array* cmask = p.has_cmask ? &inputs[i++] : nullptr;
    const array* emask = p.has_emask ? &inputs[i++] : nullptr;
    const array* sinks = p.has_sinks ? &inputs[i++] : nullptr;
    const array* klev = p.has_klev ? &inputs[i++] : nullptr;
    const array* vlev = p.has_vlev ? &inputs[i++] : nullptr;
    const array *k2w = nullptr, *k2s = nullptr, *pk2 = nullptr, *k2lev = nullptr, *v2w = nullptr, *v2lev = nullptr;
    if (p.k2_bits) {
      k2w = &inputs[i++];
      if (!p.k2_summed) {
        k2s = &inputs[i++];
        pk2 = &inputs[i++];
      }
      k2lev = &inputs[i++];
    }
    if (p.v2_bits) {
      v2w = &inputs[i++];
      v2lev = &inputs[i++];
    }
    const array *tkw = nullptr, *tks = nullptr, *tkb = nullptr, *tvw = nullptr, *tvs = nullptr, *tvb = nullptr,
                *tpk = nullptr, *tpv = nullptr, *tkmu = nullptr, *tvmu = nullptr, *tcmask = nullptr;
    if (p.t_k_bits) {
      tkw = &inputs[i++];
      tks = &inputs[i++];
      if (p.t_has_kb) tkb = &inputs[i++];
      tvw = &inputs[i++];
      tvs = &inputs[i++];
      if (p.t_has_vb) tvb = &inputs[i++];
      tpk = &inputs[i++];
      tpv = &inputs[i++];
      if (p.t_has_kmu) tkmu = &inputs[i++];
      if (p.t_has_vmu) tvmu = &inputs[i++];
      if (p.t_has_cmask) tcmask = &inputs[i++];
    }
    const array* ctable = p.has_coffset ? &inputs[i++] : nullptr;
    const array* cturns = p.has_coffset ? &inputs[i++] : nullptr;
    const array* ttable = p.has_toffset ? &inputs[i++] : nullptr;
    const array* tturns = p.has_toffset ? &inputs[i++] : nullptr;
    for (const array& a : inputs)  // views of buffers keep a contiguous last axis; anything else is a bug here
      if (a.ndim() && a.strides().back() != 1 && a.shape().back() > 1)
        throw std::runtime_error("veloxquant coded attention: an input's last axis is not contiguous");
    Problem pr;
    pr.G = int64_t(q.shape(0)) * q.shape(1);
    pr.R = q.shape(2);
    pr.d = q.shape(3);
    pr.dv = pv.shape(0);
    pr.q = q.data<float>();
    pr.pk = pk.data<float>();
    pr.pv = pv.data<float>();
    pr.ne = ek.shape(2);
    pr.ek = view(ek);
    pr.ev = view(ev);
    auto codes = [&](Codes& c, const array& w, const array& s, const array* b, bool last, int bits, int group,
                     int d) {
      c.w = view(w);
      c.scales = view(s);
      if (b) c.biases = view(*b);
      c.dtype = s.dtype() == float16 ? ScaleType::f16 : s.dtype() == bfloat16 ? ScaleType::bf16
                : s.dtype() == uint8 ? ScaleType::u8log : ScaleType::f32;
      c.tokens_last = last;
      c.bits = bits;
      c.group = group;
      c.d = d;
    };
    codes(pr.k, kw, ks, kb, p.k_tokens_last, p.k_bits, p.k_group, pr.d);
    codes(pr.v, vw, vs, vb, p.v_tokens_last, p.v_bits, p.v_group, pr.dv);
    pr.v.zero = p.v_zero;
    pr.k.zero = p.k_zero;
    pr.k.set_levels(klev ? klev->data<float>() : nullptr);
    pr.v.set_levels(vlev ? vlev->data<float>() : nullptr);
    if (k2w) {
      pr.has_k2 = true;
      pr.k2_summed = p.k2_summed;
      pr.m2 = pk2 ? pk2->shape(0) : pr.d;
      codes(pr.k2, *k2w, k2s ? *k2s : ks, nullptr, false, p.k2_bits, p.k2_group, pr.m2);
      pr.k2.set_levels(k2lev->data<float>());
      pr.pk2 = pk2 ? pk2->data<float>() : nullptr;
    }
    if (v2w) {
      pr.has_v2 = true;
      codes(pr.v2, *v2w, vs, nullptr, false, p.v2_bits, p.v_group, pr.dv);
      pr.v2.set_levels(v2lev->data<float>());
    }
    pr.n = p.k_tokens_last ? int64_t(kw.shape(3)) * 32 / p.k_bits : kw.shape(2);
    if (kmu) {
      pr.kmu = kmu->data<float>();
      pr.kmu_rows = kmu->shape(0);
    }
    if (vmu) {
      pr.vmu = vmu->data<float>();
      pr.vmu_rows = vmu->shape(0);
    }
    pr.cmask = cmask ? cmask->data<uint8_t>() : nullptr;
    pr.emask = emask ? emask->data<uint8_t>() : nullptr;
    pr.emask_rows = emask && emask->shape(0) != pr.G;
    pr.sinks = sinks ? sinks->data<float>() : nullptr;
    pr.out = out.data<float>();
    pr.spans = spans;
    auto offset = [&](Problem& part, const array* table, const array* turns) {
      if (!table) return;
      part.otable = table->data<float>();
      part.otable_rows = table->shape(0);
      part.oturns = turns->data<float>();
      part.oturn_blocks = turns->shape(1);
      part.odims = p.o_dims;
      part.otrad = p.o_trad != 0;
      part.oblock = p.o_block;
    };
    offset(pr, ctable, cturns);
    Problem tail;
    if (tkw) {  // the same queries, exact tokens and output; its own codes, rotations, means and mask
      tail = pr;
      tail.spans.clear();
      tail.has_k2 = tail.has_v2 = tail.k2_summed = false;
      tail.k = Codes{};
      tail.v = Codes{};
      codes(tail.k, *tkw, *tks, tkb, false, p.t_k_bits, p.t_k_group, pr.d);
      codes(tail.v, *tvw, *tvs, tvb, false, p.t_v_bits, p.t_v_group, pr.dv);
      tail.k.zero = p.t_k_zero;
      tail.v.zero = p.t_v_zero;
      tail.n = tkw->shape(2);
      tail.pk = tpk->data<float>();
      tail.pv = tpv->data<float>();
      tail.kmu = tkmu ? tkmu->data<float>() : nullptr;
      tail.kmu_rows = tkmu ? tkmu->shape(0) : 0;
      tail.vmu = tvmu ? tvmu->data<float>() : nullptr;
      tail.vmu_rows = tvmu ? tvmu->shape(0) : 0;
      tail.cmask = tcmask ? tcmask->data<uint8_t>() : nullptr;
      tail.otable = nullptr;
      offset(tail, ttable, tturns);
      pr.tail = &tail;
    }
    solve(pr);
  });
}

// ------------------------------------------------------------------------------------------------
// the op: checks everything the computation relies on, so a bad call is a Python error, never a crash
// ------------------------------------------------------------------------------------------------
// The message is built only when the check fails (formatting shapes on every call was ~8 % of a decode step's
// kernel call at a few hundred tokens).
#define require(ok, what)                                  \
  do {                                                     \
    if (!(ok)) throw std::invalid_argument(std::string(what)); \
  } while (0)

std::string shape_str(const array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << ")";
  return s.str();
}

bool lead_ok(const array& a, int B, int H) { return a.ndim() == 4 && a.shape(0) == B && a.shape(1) == H; }

void check_codes(const std::string& nm, const array& w, const array& s, const array* b, bool last, int bits,
                 int group, int B, int H, int d, int64_t n) {
  require(bits >= 1 && bits <= 8, nm + ": bits must be 1..8");
  require(group == 32 || group == 64 || group == 128 || (!last && group == d && d % 8 == 0),
          nm + ": group must be 32, 64 or 128 (or, tokens first, the whole vector, a multiple of 8)");
  require(w.dtype() == uint32 && lead_ok(w, B, H), nm + " codes must be uint32 (B, H, ., .), got " + shape_str(w));
  require(s.dtype() == float16 || s.dtype() == bfloat16 || s.dtype() == float32 || (s.dtype() == uint8 && !b),
          nm + " scales: a float dtype, or uint8 log-grid codes of symmetric levels (no biases)");
  require(lead_ok(s, B, H), nm + " scales must be (B, H, ., .), got " + shape_str(s));
  if (last) {
    require(w.shape(2) == d && n % group == 0 && int64_t(w.shape(3)) * 32 == n * bits,
            nm + " codes (tokens last) must be (B, H, d, n*bits/32) with whole groups, got " + shape_str(w));
    require(s.shape(2) == d && s.shape(3) == n / group,
            nm + " scales (tokens last) must be (B, H, d, n/group), got " + shape_str(s));
  } else {
    require(d % group == 0 && w.shape(2) == n && int64_t(w.shape(3)) * 32 == int64_t(d) * bits,
            nm + " codes (tokens first) must be (B, H, n, d*bits/32), got " + shape_str(w));
    require(s.shape(2) == n && s.shape(3) == d / group,
            nm + " scales (tokens first) must be (B, H, n, d/group), got " + shape_str(s));
  }
  if (b) require(b->shape() == s.shape() && b->dtype() == s.dtype(), nm + " biases must match the scales");
}

array coded_decode_attention(const array& q, const array& pk, const array& pv, const array& kw, const array& ks,
                             const std::optional<array>& kb, bool k_tokens_last, int k_bits, int k_group, const array& vw,
                             const array& vs, const std::optional<array>& vb, bool v_tokens_last, int v_bits,
                             int v_group, float v_zero, const array& ek, const array& ev,
                             const std::optional<array>& kmu, const std::optional<array>& vmu,
                             const std::optional<array>& cmask, const std::optional<array>& emask,
                             const std::optional<array>& sinks, const std::optional<array>& k_levels,
                             const std::optional<array>& v_levels, const std::optional<array>& k2w,
                             const std::optional<array>& k2s, const std::optional<array>& pk2,
                             const std::optional<array>& k2_levels, int k2_bits, const std::optional<array>& v2w,
                             const std::optional<array>& v2_levels, int v2_bits,
                             const std::optional<std::vector<int64_t>>& spans,
                             const std::optional<std::vector<array>>& tail, const std::optional<std::vector<int>>& tail_layout,
                             float tail_k_zero, float tail_v_zero,
                             const std::optional<std::vector<array>>& key_offset,
                             const std::optional<std::vector<int>>& offset_layout, float k_zero) {
  require(q.dtype() == float32 && q.ndim() == 4, "q must be float32 (B, Hkv, R, d), got " + shape_str(q));
  int B = q.shape(0), H = q.shape(1), R = q.shape(2), d = q.shape(3);
  int64_t G = int64_t(B) * H;
  int dv = pv.ndim() == 2 ? pv.shape(0) : -1;
  require(R >= 1 && R <= MAX_R, "q: at most 16 query heads per KV head");
  require(d >= 1 && d <= MAX_D && dv >= 1 && dv <= MAX_D, "head dims must be 1..256");
  require(pk.dtype() == float32 && pk.ndim() == 2 && pk.shape(0) == d && pk.shape(1) == d, "pk must be (d, d) float32");
  require(pv.dtype() == float32 && pv.shape(1) == dv, "pv must be (dv, dv) float32");
  require(k_bits >= 1, "k_bits must be positive");
  int64_t n = kw.ndim() == 4 ? (k_tokens_last ? int64_t(kw.shape(3)) * 32 / k_bits : kw.shape(2)) : 0;
  check_codes("keys", kw, ks, kb ? &*kb : nullptr, k_tokens_last, k_bits, k_group, B, H, d, n);
  check_codes("values", vw, vs, vb ? &*vb : nullptr, v_tokens_last, v_bits, v_group, B, H, dv, n);
  require(ek.dtype() == float32 && ev.dtype() == float32 && lead_ok(ek, B, H) && lead_ok(ev, B, H) &&
          ek.shape(3) == d && ev.shape(3) == dv && ek.shape(2) == ev.shape(2),
          "exact keys / values must be float32 (B, H, ne, d) / (B, H, ne, dv)");
  int64_t ne = ek.shape(2), attended = n;
  if (spans) {
    require(spans->size() % 2 == 0, "spans: pairs of token slots (lo, hi)");
    attended = 0;
    for (size_t j = 0; j < spans->size(); j += 2) {
      const int64_t lo = (*spans)[j], hi = (*spans)[j + 1];
      require(0 <= lo && lo <= hi && hi <= n && (j == 0 || (*spans)[j - 1] <= lo),
              "spans: sorted disjoint slots [lo, hi) within the codes' n tokens");
      attended += hi - lo;
    }
  }
  require(attended + ne > 0, "the history holds no token");
  auto mu_ok = [&](const std::optional<array>& m, int w) {
    return !m || (m->dtype() == float32 && m->ndim() == 2 && m->shape(1) == w && m->shape(0) >= 1 &&
                  G % m->shape(0) == 0);
  };
  require(mu_ok(kmu, d) && mu_ok(vmu, dv), "means must be float32 (rows dividing B*H, d)");
  require(!cmask || (cmask->dtype() == bool_ && cmask->shape() == Shape{int(G), int(n)}), "cmask must be bool (B*H, n)");
  require(!emask || (emask->dtype() == bool_ && (emask->shape() == Shape{int(G), int(ne)} ||
                                                  emask->shape() == Shape{int(G * R), int(ne)})),
          "emask must be bool (B*H, ne), or one row per query row (B*H*R, ne)");
  require(!sinks || (sinks->dtype() == float32 && sinks->shape() == Shape{int(G), R}), "sinks must be float32 (B*H, R)");
  auto lev_ok = [](const std::optional<array>& l, int bits) {
    return !l || (l->dtype() == float32 && l->ndim() == 1 && l->shape(0) == (1 << bits));
  };
  require(lev_ok(k_levels, k_bits) && lev_ok(v_levels, v_bits), "levels must be float32 (2**bits,)");
  require(kb || k_levels || k_zero != 0.0f, "keys need biases, levels or a zero level (symmetric codes)");
  require(k_zero == 0.0f || (!kb && !k_levels && !k_tokens_last),
          "k_zero: symmetric per-token keys (no biases, no levels, tokens first)");
  // second streams: all of their arrays or none; tokens first, levels given
  const bool has_k2 = k2w || k2s || pk2 || k2_levels;
  const bool has_v2 = v2w || v2_levels;
  int m2 = 0;
  const bool k2_summed = has_k2 && !k2s && !pk2;  // under the first stream's scales and rotation (RVQ)
  if (has_k2) {
    require(k2w && k2_levels && bool(k2s) == bool(pk2),
            "k2w and k2_levels go together, with k2s and pk2 both or (levels summed with the first stream's) neither");
    require(!k_tokens_last, "a second key stream needs per-token keys (k_tokens_last false)");
    if (k2_summed) {
      require(k_levels && !kb, "a summed second key stream needs codebook keys (k_levels, no biases)");
      check_codes("second keys", *k2w, ks, nullptr, false, k2_bits, k_group, B, H, d, n);
    } else {
      m2 = pk2->ndim() == 2 ? pk2->shape(0) : -1;
      require(pk2->dtype() == float32 && m2 >= 8 && m2 <= MAX_D && m2 % 8 == 0 && pk2->shape(1) == d,
              "pk2 must be float32 (m2, d) with m2 a multiple of 8 up to 256");
      check_codes("second keys", *k2w, *k2s, nullptr, false, k2_bits, m2, B, H, m2, n);
    }
    require(lev_ok(k2_levels, k2_bits), "k2_levels must be float32 (2**k2_bits,)");
  }
  if (has_v2) {
    require(v2w && v2_levels && v_levels && !v_tokens_last && !vb && v_zero == 0.0f,
            "a second value stream needs v2w and v2_levels, and per-token codebook values (v_levels, no biases)");
    check_codes("second values", *v2w, vs, nullptr, false, v2_bits, v_group, B, H, dv, n);
    require(lev_ok(v2_levels, v2_bits), "v2_levels must be float32 (2**v2_bits,)");
  }
  // The tail: arrays [tkw, tks, tkb, tvw, tvs, tvb, tpk, tpv, tkmu, tvmu, tcmask] (an empty array where there is
  // none: biases, means, mask) and layout [k_bits, k_group, v_bits, v_group], both codes tokens first; symmetric
  // codes (no biases) sit around tail_k_zero / tail_v_zero.
  require(bool(tail) == bool(tail_layout), "tail and tail_layout go together");
  auto given = [&](int j) { return (*tail)[j].size() > 0; };
  int64_t tn = 0;
  if (tail) {
    require(tail->size() == 11 && tail_layout->size() == 4,
            "tail: [tkw, tks, tkb, tvw, tvs, tvb, tpk, tpv, tkmu, tvmu, tcmask] (None: empty), tail_layout: "
            "[k_bits, k_group, v_bits, v_group]");
    const auto& t = *tail;
    const auto& tl = *tail_layout;
    tn = t[0].ndim() == 4 ? t[0].shape(2) : 0;
    require(tn >= 1, "tail keys must be uint32 (B, H, n, d*bits/32) with at least one token, got " + shape_str(t[0]));
    check_codes("tail keys", t[0], t[1], given(2) ? &t[2] : nullptr, false, tl[0], tl[1], B, H, d, tn);
    check_codes("tail values", t[3], t[4], given(5) ? &t[5] : nullptr, false, tl[2], tl[3], B, H, dv, tn);
    const bool rotations_ok = t[6].dtype() == float32 && t[6].ndim() == 2 && t[6].shape(0) == d &&
                              t[6].shape(1) == d && t[7].dtype() == float32 && t[7].ndim() == 2 &&
                              t[7].shape(0) == dv && t[7].shape(1) == dv;
    require(rotations_ok,
            "tail rotations must be float32 (d, d) and (dv, dv)");
    require(mu_ok(given(8) ? std::optional<array>(t[8]) : std::nullopt, d) &&
                mu_ok(given(9) ? std::optional<array>(t[9]) : std::nullopt, dv),
            "tail means must be float32 (rows dividing B*H, d)");
    require(!given(10) || (t[10].dtype() == bool_ && t[10].ndim() == 2 && t[10].shape(0) == G &&
                           t[10].shape(1) == tn),
            "tail mask must be bool (B*H, tail tokens)");
  }
  // The key offset: arrays [ctable, cturns, ttable, tturns] (empty arrays where a part has none), layout
  // [dims, traditional, block]; turns (B*H, blocks covering the part, dims): cos then sin per block.
  require(bool(key_offset) == bool(offset_layout), "key_offset and offset_layout go together");
  bool has_coffset = false, has_toffset = false;
  int o_dims = 0, o_trad = 0, o_block = 0;
  if (key_offset) {
    const auto& o = *key_offset;
    const auto& ol = *offset_layout;
    require(o.size() == 4 && ol.size() == 3,
            "key_offset: [ctable, cturns, ttable, tturns] (None: empty), offset_layout: [dims, traditional, block]");
    o_dims = ol[0];
    o_trad = ol[1];
    o_block = ol[2];
    require(o_dims >= 2 && o_dims % 2 == 0 && o_dims <= d && (o_trad == 0 || o_trad == 1),
            "offset_layout: dims even in 2..d, traditional 0 or 1");
    require(o_block >= TILE && o_block % TILE == 0, "offset_layout: block a multiple of 32");
    has_coffset = o[0].size() > 0;
    has_toffset = o[2].size() > 0;
    require(has_coffset || has_toffset, "key_offset holds no table");
    require(!has_toffset || tail, "a tail key offset comes with a tail");
    for (int j : {0, 2}) {
      if (!o[j].size()) continue;
      const auto& tb = o[j];
      const auto& tu = o[j + 1];
      const int64_t covered = j == 0 ? n : tn;  // slots the turns must cover
      require(tb.dtype() == float32 && tb.ndim() == 4 && tb.shape(0) >= 1 && G % tb.shape(0) == 0 &&
                  tb.shape(1) == o_block / TILE && tb.shape(2) == d && tb.shape(3) == TILE,
              std::string(j == 0 ? "ctable" : "ttable") + " must be float32 (rows dividing B*H, block/32, d, 32), got " +
                  shape_str(tb));
      require(tu.dtype() == float32 && tu.ndim() == 3 && tu.shape(0) == G && tu.shape(2) == o_dims &&
                  int64_t(tu.shape(1)) * o_block >= covered,
              std::string(j == 0 ? "cturns" : "tturns") + " must be float32 (B*H, blocks covering the part, dims), got " +
                  shape_str(tu));
    }
  }
  Params p{k_tokens_last, v_tokens_last, k_bits, k_group, v_bits, v_group, v_zero, k_zero, bool(kb), bool(kmu), bool(vmu), bool(vb),
           bool(cmask), bool(emask), bool(sinks), bool(k_levels), bool(v_levels), has_k2 ? k2_bits : 0,
           k2_summed ? k_group : (has_k2 ? m2 : 0), has_v2 ? v2_bits : 0, k2_summed,
           tail ? (*tail_layout)[0] : 0, tail ? (*tail_layout)[1] : 0, tail ? (*tail_layout)[2] : 0,
           tail ? (*tail_layout)[3] : 0, tail ? tail_k_zero : 0.0f, tail ? tail_v_zero : 0.0f, tail && given(2), tail && given(5),
           tail && given(8), tail && given(9), tail && given(10), has_coffset, has_toffset, o_dims, o_trad, o_block};
  // Small inputs are made contiguous; codes and exact tokens are read through their strides (cache views). Arrays
  // already evaluated and contiguous (rotations, levels, means: the same every step) pass as they are: one graph
  // node fewer each per layer and step.
  auto c = [](const array& a) { return a.is_available() && a.flags().row_contiguous ? a : contiguous(a); };
  std::vector<array> in{c(q), c(pk), c(pv), kw, ks};
  if (kb) in.push_back(*kb);
  in.push_back(vw);
  in.push_back(vs);
  if (vb) in.push_back(*vb);
  // The exact tokens (a sink and a tail, at most a few blocks) pass through contiguous(): reading them through
  // their views gave wrong decode logits on 2-rank pipeline runs (tests/test_distributed.py) though right in one
  // process, lazily or not; the mechanism is not understood, the copy costs little and fixed it.
  in.push_back(c(ek));
  in.push_back(c(ev));
  for (auto* o : {&kmu, &vmu, &cmask, &emask, &sinks, &k_levels, &v_levels})
    if (*o) in.push_back(c(**o));
  if (has_k2) {
    in.push_back(*k2w);
    if (!k2_summed) {
      in.push_back(*k2s);
      in.push_back(c(*pk2));
    }
    in.push_back(c(*k2_levels));
  }
  if (has_v2) {
    in.push_back(*v2w);
    in.push_back(c(*v2_levels));
  }
  if (tail)  // codes through their strides (cache views); the rest contiguous
    for (int j = 0; j < 11; ++j)
      if (given(j)) in.push_back(j <= 5 ? (*tail)[j] : c((*tail)[j]));
  if (key_offset) {
    for (int j : {0, 2})
      if ((*key_offset)[j].size()) {
        in.push_back(c((*key_offset)[j]));
        in.push_back(c((*key_offset)[j + 1]));
      }
  }
  // On the caller's current stream (mlx_lm decodes inside its own generation stream): a primitive on another
  // stream than the ops producing its inputs was measured reading the exact tokens before they were written.
  Stream s = to_stream(StreamOrDevice{});
  require(s.device == Device::cpu, "the compiled attention runs on the CPU: make the CPU the default device");
  return array(Shape{B, H, R, dv}, float32,
               std::make_shared<CodedDecodeAttention>(s, p, spans ? *spans : std::vector<int64_t>{}), in);
}

}  // namespace vq

#ifndef VELOXQUANT_ARCH
#define VELOXQUANT_ARCH ""
#endif
namespace vq {
// The instruction-set flags build_kernel.py passed, behind a marker kernel.py finds in the file's bytes before it
// imports the module (whose static initializers already run instructions of these sets).
extern const char kArchMarker[];
__attribute__((used)) const char kArchMarker[] = "VELOXQUANT_ARCH_FLAGS=" VELOXQUANT_ARCH;

// The instruction-set extensions this binary was compiled to use (its -m flags) that the running CPU lacks: the
// library refuses the module (kernel.py) instead of dying on an illegal instruction. __builtin_cpu_supports takes
// string literals only, hence one line per feature.
std::vector<std::string> missing_cpu_features() {
  std::vector<std::string> missing;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#define VQ_NEEDS(name) \
  if (!__builtin_cpu_supports(name)) missing.push_back(name);
#if defined(__AVX__)
  VQ_NEEDS("avx")
#endif
#if defined(__AVX2__)
  VQ_NEEDS("avx2")
#endif
#if defined(__FMA__)
  VQ_NEEDS("fma")
#endif
#if defined(__F16C__)
  VQ_NEEDS("f16c")
#endif
#if defined(__BMI2__)
  VQ_NEEDS("bmi2")
#endif
#if defined(__AVX512F__)
  VQ_NEEDS("avx512f")
#endif
#if defined(__AVX512BW__)
  VQ_NEEDS("avx512bw")
#endif
#if defined(__AVX512VL__)
  VQ_NEEDS("avx512vl")
#endif
#undef VQ_NEEDS
#endif
  return missing;
}
}  // namespace vq

void bind_affine_encode(nb::module_& m);  // affine_encode.cpp
void bind_gather_rows(nb::module_& m);    // gather_rows.cpp

NB_MODULE(_coded_attention, m) {
  m.doc() = "veloxquant_mlx's compiled attention on affine codes (CPU); the reference is packed_sdpa.attend_one_query";
  m.attr("built_with_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                              std::to_string(MLX_VERSION_PATCH);
#ifndef VELOXQUANT_SOURCE_HASH
#define VELOXQUANT_SOURCE_HASH "unknown"
#endif
  m.attr("built_from_sources") = VELOXQUANT_SOURCE_HASH;  // build_kernel.source_hash() of the sources built
  m.attr("built_with_flags") = vq::kArchMarker + std::strlen("VELOXQUANT_ARCH_FLAGS=");
  m.def("missing_cpu_features", &vq::missing_cpu_features,
        "instruction-set extensions this module was compiled for that this CPU lacks (empty: it can run here)");
  m.attr("log_scale_offset") = vq::LOG_SCALE_OFFSET;
  m.attr("log_scale_steps") = vq::LOG_SCALE_STEPS;
  m.def("threads", [] { return vq::pool().size(); }, "worker threads (VELOXQUANT_KERNEL_THREADS, else all cores)");
  m.def(
      "set_row_plan",
      [](int keys, int values) {
        for (int v : {keys, values})
          if (v != -1 && v != 0 && v != 2 && v != 4) throw std::invalid_argument("row plan: -1 (auto), 0, 2 or 4");
        vq::g_row_plan[0] = keys;
        vq::g_row_plan[1] = values;
      },
      nb::arg("keys"), nb::arg("values"),
      "benchmarks only: vectors per row block read straight from the default's key / value codes (4 or 2; 0: "
      "decode each tile once; -1: the measured choice per query rows per KV head)");
  m.def("coded_decode_attention", &vq::coded_decode_attention, nb::arg("q"), nb::arg("pk"), nb::arg("pv"),
        nb::arg("kw"), nb::arg("ks"), nb::arg("kb").none(), nb::arg("k_tokens_last"), nb::arg("k_bits"), nb::arg("k_group"),
        nb::arg("vw"), nb::arg("vs"), nb::arg("vb").none(), nb::arg("v_tokens_last"), nb::arg("v_bits"),
        nb::arg("v_group"), nb::arg("v_zero"), nb::arg("ek"), nb::arg("ev"), nb::arg("kmu").none(),
        nb::arg("vmu").none(), nb::arg("cmask").none(), nb::arg("emask").none(), nb::arg("sinks").none(),
        nb::arg("k_levels").none() = nb::none(), nb::arg("v_levels").none() = nb::none(),
        nb::arg("k2w").none() = nb::none(), nb::arg("k2s").none() = nb::none(), nb::arg("pk2").none() = nb::none(),
        nb::arg("k2_levels").none() = nb::none(), nb::arg("k2_bits") = 0, nb::arg("v2w").none() = nb::none(),
        nb::arg("v2_levels").none() = nb::none(), nb::arg("v2_bits") = 0, nb::arg("spans").none() = nb::none(),
        nb::arg("tail").none() = nb::none(), nb::arg("tail_layout").none() = nb::none(), nb::arg("tail_k_zero") = 0.0f,
        nb::arg("tail_v_zero") = 0.0f, nb::arg("key_offset").none() = nb::none(),
        nb::arg("offset_layout").none() = nb::none(), nb::arg("k_zero") = 0.0f);
  m.attr("reads_tail") = true;  // coded_decode_attention takes a second coded part (kernel.py asks)
  m.attr("reads_key_offset") = true;  // key_offset: keys stored less their rotated mean before RoPE (kernel.py asks)
  m.attr("reads_key_zero") = true;  // k_zero: symmetric per-token keys as the coded part (kernel.py asks)
  bind_affine_encode(m);
  bind_gather_rows(m);
}
