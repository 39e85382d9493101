// Affine codes of rotated vectors in one MLX primitive (CPU): what `mx.quantize` followed by the codecs' float16
// clamp computes, bit for bit, in one pass instead of five to twelve graph operations.
//
// The reference is veloxquant_mlx.codecs._affine_encode.reference_affine_encode (used by codecs.affine, per-token
// groups along channels, and codecs.affine_block, groups along tokens per channel, keys stored transposed):
// mx.quantize's grid (the larger-magnitude end of a group is its bias and a grid point, the scale adjusted so that
// zero is one too), a group holding a non-finite value gets a NaN bias (tokens-last layout only, as affine_block),
// a per-channel offset added to the biases (the rotated key mean), then scales and biases clamped into float16's
// finite range (inf and NaN kept) and stored as float16, or stored as float32. Each operation is the reference's,
// in the same order and precision; tests/test_affine_encode.py compares the arrays bit for bit. A decode step codes
// one 64-token block of one row (12k numbers): there the reference's cost was its operations (~0.4 ms per layer
// for a block of keys), not its arithmetic; a prefill's blocks run 4-7x faster than mx.quantize's scalar loop here.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/types/half_types.h"
#include "mlx/utils.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace vq_encode {

constexpr float FLOAT16_MAX = 65504.0f;

struct Params {
  int bits, group;
  bool tokens_last;  // groups along tokens per channel, output (..., d, T*bits/32): affine_block's K^T layout
  bool has_offset;   // (H, d) float32 added to every bias of head h, channel c (tokens_last only)
  bool half;         // scales / biases stored as float16 (clamped), else float32
  bool operator==(const Params& o) const {
    return bits == o.bits && group == o.group && tokens_last == o.tokens_last && has_offset == o.has_offset &&
           half == o.half;
  }
};

// mx.quantize's grid of a group with extremes w_min, w_max: its CPU arithmetic, operation for operation.
inline void grid1(float w_min, float w_max, int bits, float& scale_out, float& bias_out) {
  const float n_bins = float((1 << bits) - 1);
  const float eps = 1e-7f;
  const bool mask = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, eps);
  scale = mask ? scale : -scale;
  const float edge = mask ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  scale_out = scale;
  bias_out = bias;
}

inline uint8_t code1(float x, float scale, float bias, int bits) {
  const float n_bins = float((1 << bits) - 1);
  float w = std::rint((x - bias) / scale);
  w = std::min(std::max(w, 0.0f), n_bins);
  // NaN (a non-finite group) codes as 0, as mx.quantize's CPU code does on x86; such a group decodes non-finite
  // either way (its scale or bias is), which is what the caches rely on.
  return (w == w) ? uint8_t(w) : 0;
}

// One group of `n` values read with stride `step` -> codes q[0..n), scale and bias (portable path).
inline void quantize_group(const float* x, int64_t step, int n, int bits, uint8_t* q, float& scale, float& bias) {
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (int j = 0; j < n; ++j) {
    const float v = x[j * step];
    w_max = std::max(w_max, v);
    w_min = std::min(w_min, v);
  }
  grid1(w_min, w_max, bits, scale, bias);
  for (int j = 0; j < n; ++j) q[j] = code1(x[j * step], scale, bias, bits);
}

// Codes q[0..n) (each < 2^bits) appended to the little-endian bit stream at `out` (n * bits a multiple of 32).
inline void pack_codes(const uint8_t* q, int n, int bits, uint32_t* out) {
  if constexpr (std::endian::native == std::endian::little) {  // whole bytes of fields: no carried accumulator
    uint8_t* o = reinterpret_cast<uint8_t*>(out);
    if (bits == 8) {
      std::memcpy(o, q, n);
      return;
    }
    if (bits == 4) {
      for (int j = 0; j < n; j += 2) o[j / 2] = uint8_t(q[j] | (q[j + 1] << 4));
      return;
    }
    if (bits == 2) {
      for (int j = 0; j < n; j += 4) o[j / 4] = uint8_t(q[j] | (q[j + 1] << 2) | (q[j + 2] << 4) | (q[j + 3] << 6));
      return;
    }
  }
  uint64_t acc = 0;
  int filled = 0;
  for (int j = 0; j < n; ++j) {
    acc |= uint64_t(q[j]) << filled;
    filled += bits;
    if (filled >= 32) {
      *out++ = uint32_t(acc);
      acc >>= 32;
      filled -= 32;
    }
  }
}

#if defined(__AVX2__)
// quantize_group's arithmetic on 8 lanes, each lane its own group (the same operations, in the same order, per
// lane): std::max(a, b) is (a < b) ? b : a, which is _mm256_max_ps(b, a) (NaN in b: a), std::min(a, b) is
// _mm256_min_ps(b, a); rint is round-to-nearest-even; q0 != 0 holds for NaN (unordered compare).
struct Grid8 {
  __m256 scale, bias;
};

inline Grid8 grid8(__m256 w_min, __m256 w_max, int bits) {
  const __m256 n_bins = _mm256_set1_ps(float((1 << bits) - 1));
  const __m256 eps = _mm256_set1_ps(1e-7f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 mask = _mm256_cmp_ps(_mm256_andnot_ps(sign, w_min), _mm256_andnot_ps(sign, w_max), _CMP_GT_OQ);
  __m256 scale = _mm256_max_ps(eps, _mm256_div_ps(_mm256_sub_ps(w_max, w_min), n_bins));
  scale = _mm256_blendv_ps(_mm256_xor_ps(scale, sign), scale, mask);
  const __m256 edge = _mm256_blendv_ps(w_max, w_min, mask);
  const __m256 q0 = _mm256_round_ps(_mm256_div_ps(edge, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 nz = _mm256_cmp_ps(q0, _mm256_setzero_ps(), _CMP_NEQ_UQ);
  scale = _mm256_blendv_ps(scale, _mm256_div_ps(edge, q0), nz);
  const __m256 bias = _mm256_and_ps(edge, nz);
  return {scale, bias};
}

// Codes of 8 values under their lanes' grids -> 8 int32 (NaN codes as 0, as quantize_group).
inline __m256i codes8(__m256 x, const Grid8& g, __m256 n_bins) {
  __m256 w = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(x, g.bias), g.scale),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  w = _mm256_min_ps(n_bins, _mm256_max_ps(_mm256_setzero_ps(), w));
  w = _mm256_and_ps(w, _mm256_cmp_ps(w, w, _CMP_ORD_Q));  // NaN -> 0
  return _mm256_cvttps_epi32(w);
}
#endif

inline float clamp_half_range(float x) {
  // the codecs' float16 clamp: where(isinf(x), x, clip(x, -65504, 65504)); MLX's clip keeps NaN
  if (std::isinf(x) || std::isnan(x)) return x;
  return std::min(std::max(x, -FLOAT16_MAX), FLOAT16_MAX);
}

inline void store(void* p, int64_t i, float x, bool half) {
  if (half)
    static_cast<float16_t*>(p)[i] = static_cast<float16_t>(clamp_half_range(x));
  else
    static_cast<float*>(p)[i] = x;
}

// inputs: y float32 (B, H, T, d) row-contiguous, [offset float32 (H, d)]; outputs: w uint32, scales, biases
class AffineEncode : public Primitive {
 public:
  AffineEncode(Stream s, Params p) : Primitive(s), p_(p) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("veloxquant affine encode has no GPU implementation (use the MLX reference)");
  }
  const char* name() const override { return "VeloxquantAffineEncode"; }
  bool is_equivalent(const Primitive& other) const override {
    return p_ == static_cast<const AffineEncode&>(other).p_;
  }

 private:
  Params p_;
};

void AffineEncode::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
  auto& enc = cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  // y is usually a matmul's output (row-contiguous); anything else is gathered here through its strides rather
  // than by one more graph operation on every call
  enc.dispatch([y = inputs[0], offset = p_.has_offset ? inputs[1] : inputs[0], w = array::unsafe_weak_copy(outputs[0]),
                s = array::unsafe_weak_copy(outputs[1]), b = array::unsafe_weak_copy(outputs[2]), p = p_]() mutable {
    const float* off = p.has_offset ? offset.data<float>() : nullptr;
    const int64_t B = y.shape(0), H = y.shape(1), T = y.shape(2), d = y.shape(3);
    const float* x = y.data<float>();
    std::vector<float> gathered;
    if (!y.flags().row_contiguous) {
      const auto& st = y.strides();
      gathered.resize(size_t(B * H * T * d));
      float* g = gathered.data();
      for (int64_t i0 = 0; i0 < B; ++i0)
        for (int64_t i1 = 0; i1 < H; ++i1)
          for (int64_t i2 = 0; i2 < T; ++i2)
            for (int64_t i3 = 0; i3 < d; ++i3)
              *g++ = x[i0 * st[0] + i1 * st[1] + i2 * st[2] + i3 * st[3]];
      x = gathered.data();
    }
    uint32_t* wq = w.data<uint32_t>();
    void* sp = s.data<void>();
    void* bp = b.data<void>();
    const int64_t wpg = int64_t(p.group) * p.bits / 32;  // uint32 words per group
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    alignas(32) uint8_t q[8][128];
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t h = bh % H;
      const float* xh = x + bh * T * d;
      if (p.tokens_last) {  // channel c's groups run along tokens (stride d); arrays (B, H, d, T / group)
        const int64_t groups = T / p.group;
        auto finish = [&](int64_t c, int64_t g, float scale, float bias, bool finite) {
          if (!finite) bias = qnan;  // affine_block: a channel block holding a non-finite value decodes NaN
          if (off) bias = bias + off[h * d + c];
          const int64_t i = (bh * d + c) * groups + g;
          store(sp, i, scale, p.half);
          store(bp, i, bias, p.half);
        };
        int64_t c0 = 0;
#if defined(__AVX2__)
        const __m256 n_bins = _mm256_set1_ps(float((1 << p.bits) - 1));
        const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; c0 + 8 <= d; c0 += 8) {  // eight channels at a time, one per lane
          for (int64_t g = 0; g < groups; ++g) {
            const float* xg = xh + g * p.group * d + c0;
            __m256 mn = inf, mxv = _mm256_sub_ps(_mm256_setzero_ps(), inf);
            __m256 fin = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (int j = 0; j < p.group; ++j) {
              const __m256 v = _mm256_loadu_ps(xg + j * d);
              mxv = _mm256_max_ps(v, mxv);
              mn = _mm256_min_ps(v, mn);
              fin = _mm256_and_ps(fin, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_LT_OQ));
            }
            const Grid8 gr = grid8(mn, mxv, p.bits);
            alignas(32) int32_t qi[8];
            for (int j = 0; j < p.group; ++j) {
              _mm256_store_si256(reinterpret_cast<__m256i*>(qi), codes8(_mm256_loadu_ps(xg + j * d), gr, n_bins));
              for (int l = 0; l < 8; ++l) q[l][j] = uint8_t(qi[l]);
            }
            alignas(32) float sc[8], bi[8], fi[8];
            _mm256_store_ps(sc, gr.scale);
            _mm256_store_ps(bi, gr.bias);
            _mm256_store_ps(fi, fin);
            for (int l = 0; l < 8; ++l) {
              pack_codes(q[l], p.group, p.bits, wq + ((bh * d + c0 + l) * groups + g) * wpg);
              uint32_t f;
              std::memcpy(&f, &fi[l], 4);
              finish(c0 + l, g, sc[l], bi[l], f != 0);
            }
          }
        }
#endif
        for (int64_t c = c0; c < d; ++c) {
          for (int64_t g = 0; g < groups; ++g) {
            const float* xg = xh + g * p.group * d + c;
            float scale, bias;
            quantize_group(xg, d, p.group, p.bits, q[0], scale, bias);
            pack_codes(q[0], p.group, p.bits, wq + ((bh * d + c) * groups + g) * wpg);
            bool finite = true;
            for (int j = 0; j < p.group; ++j) finite = finite && std::isfinite(xg[j * d]);
            finish(c, g, scale, bias, finite);
          }
        }
      } else {  // per token: groups along channels; arrays (B, H, T, d / group)
        const int64_t groups = d / p.group;
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t g = 0; g < groups; ++g) {
            const float* xg = xh + t * d + g * p.group;
            const int64_t i = (bh * T + t) * groups + g;
            float scale, bias;
#if defined(__AVX2__)
            const __m256 n_bins = _mm256_set1_ps(float((1 << p.bits) - 1));
            __m256 mn = _mm256_set1_ps(std::numeric_limits<float>::infinity());
            __m256 mxv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
            for (int j = 0; j < p.group; j += 8) {
              const __m256 v = _mm256_loadu_ps(xg + j);
              mxv = _mm256_max_ps(v, mxv);
              mn = _mm256_min_ps(v, mn);
            }
            // lanes folded in another order than one pass: the extremes are the same values (NaN skipped either
            // way; a +-0 extreme only sets an edge that rounds to q0 = 0, bias 0: the same grid)
            alignas(32) float lo[8], hi[8];
            _mm256_store_ps(lo, mn);
            _mm256_store_ps(hi, mxv);
            float w_min = lo[0], w_max = hi[0];
            for (int l = 1; l < 8; ++l) {
              w_max = std::max(w_max, hi[l]);
              w_min = std::min(w_min, lo[l]);
            }
            grid1(w_min, w_max, p.bits, scale, bias);
            const Grid8 gr{_mm256_set1_ps(scale), _mm256_set1_ps(bias)};
            alignas(32) int32_t qi[8];
            for (int j = 0; j < p.group; j += 8) {
              _mm256_store_si256(reinterpret_cast<__m256i*>(qi), codes8(_mm256_loadu_ps(xg + j), gr, n_bins));
              for (int l = 0; l < 8; ++l) q[0][j + l] = uint8_t(qi[l]);
            }
#else
            quantize_group(xg, 1, p.group, p.bits, q[0], scale, bias);
#endif
            pack_codes(q[0], p.group, p.bits, wq + i * wpg);
            store(sp, i, scale, p.half);
            store(bp, i, bias, p.half);
          }
        }
      }
    }
  });
}

void require(bool ok, const std::string& what, const char* op = "affine_encode") {
  if (!ok) throw std::invalid_argument(std::string(op) + ": " + what);
}

// y (B, H, T, d) float32 -> (w_q, scales, biases) as the reference codecs store them.
std::vector<array> affine_encode(const array& y, std::optional<array> offset, int bits, int group, bool tokens_last,
                                 bool half) {
  require(y.ndim() == 4 && y.dtype() == float32, "y must be float32 (B, H, T, d)");
  require(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 2, 3, 4, 5, 6 or 8");
  require(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128");
  const int B = y.shape(0), H = y.shape(1), T = y.shape(2), d = y.shape(3);
  require((tokens_last ? T : d) % group == 0, "the grouped axis must hold whole groups");
  require(!offset || (tokens_last && offset->dtype() == float32 && offset->ndim() == 2 && offset->shape(0) == H &&
                      offset->shape(1) == d),
          "offset must be float32 (H, d), with tokens_last");
  Stream s = to_stream(StreamOrDevice{});
  require(s.device == Device::cpu, "runs on the CPU: make the CPU the default device");
  Params p{bits, group, tokens_last, bool(offset), half};
  // the offset (a codec's rotated mean) is computed once and evaluated: passed as it is when contiguous
  auto c = [](const array& a) { return a.is_available() && a.flags().row_contiguous ? a : contiguous(a); };
  std::vector<array> in{y};
  if (offset) in.push_back(c(*offset));
  Shape wsh = tokens_last ? Shape{B, H, d, T * bits / 32} : Shape{B, H, T, d * bits / 32};
  Shape ssh = tokens_last ? Shape{B, H, d, T / group} : Shape{B, H, T, d / group};
  Dtype sd = half ? float16 : float32;
  return array::make_arrays({wsh, ssh, ssh}, {uint32, sd, sd}, std::make_shared<AffineEncode>(s, p), in);
}

// ---- symmetric codes with one-byte log-grid scales (codecs.affine_sym_log.log_scale_codes + pack_codes) ----
// Per group of `group` values along d: the grid scale of least squared error among the CLIP_STEPS grid points at and
// below max|y| / c, each step of the reference in the same float32 operations and order (the sum of squared errors
// accumulated in token order, as MLX's CPU reduction does on this layout). A group holding inf or NaN gets scale
// code 255 and codes that decode nothing (the reference's are undefined there); a group of zeros code 0, levels c.
constexpr int LOG_STEPS = 8, LOG_OFFSET = 142, NON_FINITE = 255, CLIP_STEPS = 7;

struct SymParams {
  int bits, group;
  bool levels;  // Lloyd-Max codes (inputs y, levels, inner boundaries) instead of symmetric levels (input y)
  bool operator==(const SymParams& o) const { return bits == o.bits && group == o.group && levels == o.levels; }
};

// One primitive for both per-token codes with one-byte log-grid scales: symmetric levels, or Lloyd-Max levels
// (`SymParams::levels`); the same rows, groups and outputs.
class LogScaleEncode : public Primitive {
 public:
  LogScaleEncode(Stream s, SymParams p) : Primitive(s), p_(p) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override;
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("veloxquant log-scale encode has no GPU implementation (use the MLX reference)");
  }
  const char* name() const override { return "VeloxquantLogScaleEncode"; }
  bool is_equivalent(const Primitive& other) const override {
    return p_ == static_cast<const LogScaleEncode&>(other).p_;
  }

 private:
  SymParams p_;
};

// One group x[0..n) -> levels q[0..n) and its scale code.
inline uint8_t sym_log_group(const float* x, int n, int bits, uint8_t* q) {
  const float c = float((1 << bits) - 1) / 2.0f, top_level = float((1 << bits) - 1);
  float amax = 0.0f;
  bool bad = false;
  for (int j = 0; j < n; ++j) {
    const float a = std::abs(x[j]);
    if (!std::isfinite(a)) bad = true;
    amax = std::max(amax, a);
  }
  if (bad) {
    std::fill(q, q + n, uint8_t(0));
    return uint8_t(NON_FINITE);
  }
  if (amax == 0.0f) {
    std::fill(q, q + n, uint8_t(c));  // (c = 2^(b-1) - 1/2 truncated, as the reference's cast)
    return 0;
  }
  const float top = std::ceil(float(LOG_STEPS) * std::log2(std::max(amax, 1e-30f) / c)) + float(LOG_OFFSET);
  float best_err = 0.0f, best_code = 0.0f, best_s = 0.0f;
  for (int r = 0; r < CLIP_STEPS; ++r) {
    const float code = std::min(std::max(top - float(r), 1.0f), float(NON_FINITE - 1));
    const float sc = std::pow(2.0f, (code - float(LOG_OFFSET)) / float(LOG_STEPS));
    float err = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float lv = std::min(std::max(std::rint(x[j] / sc + c), 0.0f), top_level);
      const float e = sc * (lv - c) - x[j];
      err += e * e;
    }
    if (r == 0 || err < best_err) {
      best_err = err;
      best_code = code;
      best_s = sc;
    }
  }
  for (int j = 0; j < n; ++j) q[j] = uint8_t(std::min(std::max(std::rint(x[j] / best_s + c), 0.0f), top_level));
  return uint8_t(best_code);
}

// y (B, H, T, d) float32 -> (w_q uint32 (B, H, T, d*bits/32), scale codes uint8 (B, H, T, d/group)).
std::vector<array> sym_log_encode(const array& y, int bits, int group) {
  require(y.ndim() == 4 && y.dtype() == float32, "y must be float32 (B, H, T, d)", "sym_log_encode");
  require(bits >= 2 && bits <= 8 && bits != 7, "bits must be 2, 3, 4, 5, 6 or 8", "sym_log_encode");
  require(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128", "sym_log_encode");
  const int B = y.shape(0), H = y.shape(1), T = y.shape(2), d = y.shape(3);
  require(d % group == 0 && d <= 256 && (d * bits) % 32 == 0, "d must hold whole groups (at most 256)", "sym_log_encode");
  Stream s = to_stream(StreamOrDevice{});
  require(s.device == Device::cpu, "runs on the CPU: make the CPU the default device", "sym_log_encode");
  return array::make_arrays({Shape{B, H, T, d * bits / 32}, Shape{B, H, T, d / group}}, {uint32, uint8},
                            std::make_shared<LogScaleEncode>(s, SymParams{bits, group, false}), {y});
}

// ---- Lloyd-Max codes with one-byte log-grid scales (codecs.token_lloyd.reference_level_log_encode) ----
// Per group of `group` values along d: the RMS's grid point (rounded), then the grid scale of least squared error
// among LEVEL_SCALE_STEPS points around it; each value's code is its level interval's (the count of inner
// boundaries below y / s). Sums run in index order in float32, as the reference's reductions on this layout.
constexpr int LEVEL_STEP_LO = -4, LEVEL_STEP_HI = 4;  // grid steps tried: [LO, HI)

// The count of inner boundaries below u (sorted ascending): u's level.
inline uint8_t level_index(float u, const float* inner, int m) {
  return uint8_t(std::lower_bound(inner, inner + m, u) - inner);
}

// One group x[0..n) -> codes q[0..n) and its scale code.
inline uint8_t level_log_group(const float* x, int n, const float* levels, const float* inner, int m, uint8_t* q) {
  float ss = 0.0f;
  bool bad = false;
  for (int j = 0; j < n; ++j) {
    if (!std::isfinite(x[j])) bad = true;
    ss += x[j] * x[j];
  }
  const float rms = std::sqrt(ss / float(n));
  if (bad || !std::isfinite(rms)) {
    std::fill(q, q + n, uint8_t(0));
    return uint8_t(NON_FINITE);
  }
  if (rms == 0.0f) {
    for (int j = 0; j < n; ++j) q[j] = level_index(0.0f, inner, m);
    return 0;
  }
  const float mid = std::rint(float(LOG_STEPS) * std::log2(std::max(rms, 1e-30f))) + float(LOG_OFFSET);
  float best_err = 0.0f, best_code = 0.0f, best_s = 0.0f;
  for (int r = LEVEL_STEP_LO; r < LEVEL_STEP_HI; ++r) {
    const float code = std::min(std::max(mid + float(r), 1.0f), float(NON_FINITE - 1));
    const float sc = std::pow(2.0f, (code - float(LOG_OFFSET)) / float(LOG_STEPS));
    float err = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float e = sc * levels[level_index(x[j] / sc, inner, m)] - x[j];
      err += e * e;
    }
    if (r == LEVEL_STEP_LO || err < best_err) {
      best_err = err;
      best_code = code;
      best_s = sc;
    }
  }
  for (int j = 0; j < n; ++j) q[j] = level_index(x[j] / best_s, inner, m);
  return uint8_t(best_code);
}

void LogScaleEncode::eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) {
  for (auto& o : outputs) o.set_data(allocator::malloc(o.nbytes()));
  auto& enc = cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  enc.dispatch([y = inputs[0], lv = p_.levels ? inputs[1] : inputs[0], bd = p_.levels ? inputs[2] : inputs[0],
                w = array::unsafe_weak_copy(outputs[0]), s = array::unsafe_weak_copy(outputs[1]), p = p_]() mutable {
    const int64_t rows = y.size() / y.shape(3), d = y.shape(3), groups = d / p.group;
    const int64_t wpg = int64_t(p.group) * p.bits / 32;
    const auto& st = y.strides();
    const int64_t H = y.shape(1), T = y.shape(2);
    const float* x = y.data<float>();
    const float* levels = p.levels ? lv.data<float>() : nullptr;
    const float* inner = p.levels ? bd.data<float>() : nullptr;
    const int m = p.levels ? int(bd.size()) : 0;
    uint32_t* wq = w.data<uint32_t>();
    uint8_t* sc = s.data<uint8_t>();
    alignas(32) float row[256];
    alignas(32) uint8_t q[256];
    for (int64_t i = 0; i < rows; ++i) {  // (B, H, T) row i, read through y's strides
      const int64_t b = i / (H * T), h = (i / T) % H, t = i % T;
      const float* xi = x + b * st[0] + h * st[1] + t * st[2];
      for (int64_t c = 0; c < d; ++c) row[c] = xi[c * st[3]];
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = row + g * p.group;
        sc[i * groups + g] = p.levels ? level_log_group(xg, p.group, levels, inner, m, q)
                                      : sym_log_group(xg, p.group, p.bits, q);
        pack_codes(q, p.group, p.bits, wq + (i * groups + g) * wpg);
      }
    }
  });
}

// y (B, H, T, d) float32, levels (2^bits,), inner boundaries (2^bits - 1,) float32 -> (w_q uint32
// (B, H, T, d*bits/32), scale codes uint8 (B, H, T, d/group)).
std::vector<array> level_log_encode(const array& y, const array& levels, const array& inner, int bits, int group) {
  const char* op = "level_log_encode";
  require(y.ndim() == 4 && y.dtype() == float32, "y must be float32 (B, H, T, d)", op);
  require(bits >= 2 && bits <= 8 && bits != 7, "bits must be 2, 3, 4, 5, 6 or 8", op);
  require(group == 32 || group == 64 || group == 128, "group must be 32, 64 or 128", op);
  require(levels.dtype() == float32 && levels.ndim() == 1 && levels.shape(0) == (1 << bits),
          "levels must be float32 (2**bits,)", op);
  require(inner.dtype() == float32 && inner.ndim() == 1 && inner.shape(0) == (1 << bits) - 1,
          "inner boundaries must be float32 (2**bits - 1,)", op);
  const int B = y.shape(0), H = y.shape(1), T = y.shape(2), d = y.shape(3);
  require(d % group == 0 && d <= 256 && (d * bits) % 32 == 0, "d must hold whole groups (at most 256)", op);
  Stream s = to_stream(StreamOrDevice{});
  require(s.device == Device::cpu, "runs on the CPU: make the CPU the default device", op);
  auto c = [](const array& a) { return a.is_available() && a.flags().row_contiguous ? a : contiguous(a); };
  return array::make_arrays({Shape{B, H, T, d * bits / 32}, Shape{B, H, T, d / group}}, {uint32, uint8},
                            std::make_shared<LogScaleEncode>(s, SymParams{bits, group, true}), {y, c(levels), c(inner)});
}

}  // namespace vq_encode

void bind_affine_encode(nb::module_& m) {
  m.def("affine_encode", &vq_encode::affine_encode, nb::arg("y"), nb::arg("offset").none(), nb::arg("bits"),
        nb::arg("group"), nb::arg("tokens_last"), nb::arg("half"),
        "affine codes (w_q, scales, biases) of rotated float32 (B, H, T, d), as mx.quantize and the codecs' clamp");
  m.def("sym_log_encode", &vq_encode::sym_log_encode, nb::arg("y"), nb::arg("bits"), nb::arg("group"),
        "symmetric codes with one-byte log-grid scales (w_q, scale codes) of rotated float32 (B, H, T, d), as "
        "codecs.affine_sym_log");
  m.def("level_log_encode", &vq_encode::level_log_encode, nb::arg("y"), nb::arg("levels"), nb::arg("inner"),
        nb::arg("bits"), nb::arg("group"),
        "Lloyd-Max codes with one-byte log-grid scales (w_q, scale codes) of rotated float32 (B, H, T, d), as "
        "codecs.token_lloyd");
}
