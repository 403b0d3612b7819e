// trtspec's own CPU Linear kernel for float32 weights re-laid in panels (see native.py).
//
// A weight [N, K] is stored as ceil(N / P) panels of [K, P] (P outputs, zero-padded at the
// end). A call streams each panel once and, for every input row r and every k, adds
// x[r, k] * panel[k, :] into P accumulators: each output is the sum over k in order 0..K-1 of
// one fused multiply-add per k, whatever the number of rows. So a row's result is bit-identical
// whether it runs alone (a decode step) or beside others (a verify step, a batch).
//
// Vectors are GCC vector extensions compiled for this machine (-march=native): 16 floats on a
// CPU with AVX-512, 8 with AVX2. Rows are taken in chunks that keep the accumulators in
// registers (ROWS); the chunks after the first read the panel again from cache.
//
// Weight-only quantized panels (int8_wo, int4_wo) hold the codes in the same order, 32 outputs a
// panel: int8 as one byte a weight, scaled per output at the end; int4 as 16 bytes a k (byte i:
// output i in the low nibble, output i + 16 in the high one), with a scale and a min per output
// and group of 32 inputs, so sum_k x_k (q_k s + m) = s sum_k x_k q_k + m sum_k x_k per group.
// On a CPU with AVX512-BF16, bfloat16 activations take int4 panels re-laid in k pairs (pair_q4):
// a pair of codes becomes a bfloat16 pair by a table look-up and one dot-product instruction adds
// both products (linear_q4_bf16), half the instructions of the float32 path for the same bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;   // floats per vector
constexpr int NB = 2;    // vectors per panel
constexpr int ROWS = 12; // rows per chunk: ROWS * NB accumulators of 32 registers
#else
constexpr int VW = 8;
constexpr int NB = 4;
constexpr int ROWS = 3;  // of 16 registers
#endif
constexpr int P = VW * NB;  // outputs per panel: 32 either way

typedef float vec __attribute__((vector_size(VW * 4)));
typedef int32_t ivec __attribute__((vector_size(VW * 4)));
constexpr int GROUP = 32;  // int4_wo: inputs per scale and min
#if defined(__AVX512F__)
constexpr int ROWS_Q4 = 4;  // 3 * ROWS_Q4 * NB vectors: accumulators and two sets of group sums
#else
constexpr int ROWS_Q4 = 1;
#endif

inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof(vec)); return v; }

// VW bytes -> VW int32, sign- or zero-extended (intrinsics: GCC widens a byte vector lane by lane)
#if defined(__AVX512F__)
inline ivec widen_s8(const void* p) { return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_u8(const void* p) { return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
#else
inline ivec widen_s8(const void* p) { return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec widen_u8(const void* p) { return (ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
#endif
inline vec to_float(ivec v) { return __builtin_convertvector(v, vec); }

inline void store(const vec (&acc)[NB], const float* scale, const float* bias, float* dst, int64_t width, int64_t n0) {
  float row[P];
  std::memcpy(row, acc, sizeof(row));
  for (int64_t i = 0; i < width; i++) {
    float v = scale ? row[i] * scale[i] : row[i];
    dst[i] = bias ? v + bias[n0 + i] : v;
  }
}

template <int R>
void chunk(const float* x, int64_t K, const float* panel, const float* bias, float* out, int64_t N, int64_t n0) {
  vec acc[R][NB];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NB; j++) acc[r][j] = vec{};
  for (int64_t k = 0; k < K; k++) {
    vec w[NB];
    for (int j = 0; j < NB; j++) w[j] = load(panel + k * P + j * VW);
    for (int r = 0; r < R; r++) {
      const float xs = x[r * K + k];
      for (int j = 0; j < NB; j++) acc[r][j] += xs * w[j];
    }
  }
  const int64_t width = std::min<int64_t>(P, N - n0);
  for (int r = 0; r < R; r++) store(acc[r], nullptr, bias, out + r * N + n0, width, n0);
}

// int8 codes [K, P] of one panel, a scale per output
template <int R>
void chunk_q8(const float* x, int64_t K, const int8_t* codes, const float* scale, const float* bias, float* out,
              int64_t N, int64_t n0) {
  vec acc[R][NB];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NB; j++) acc[r][j] = vec{};
  for (int64_t k = 0; k < K; k++) {
    vec w[NB];
    for (int j = 0; j < NB; j++) w[j] = to_float(widen_s8(codes + k * P + j * VW));
    for (int r = 0; r < R; r++) {
      const float xs = x[r * K + k];
      for (int j = 0; j < NB; j++) acc[r][j] += xs * w[j];
    }
  }
  const int64_t width = std::min<int64_t>(P, N - n0);
  for (int r = 0; r < R; r++) store(acc[r], scale, bias, out + r * N + n0, width, n0);
}

// P scales (float32, or bfloat16 as its upper 16 bits) -> NB vectors
inline vec load_scales(const float* p, int j) { return load(p + j * VW); }
inline vec load_scales(const uint16_t* p, int j) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + j * VW)));
  return (vec)_mm512_slli_epi32(v, 16);
#else
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + j * VW)));
  return (vec)_mm256_slli_epi32(v, 16);
#endif
}

// One chunk of R rows through one int4 panel, group by group: ``sums(g, part)`` adds group g's
// products into two sets of sums (``part``, zeroed), which are then scaled and added with the
// group's min times the rows' sums of its inputs (xsum [R, K / GROUP]); scales and mins
// [K / GROUP, P] (S: float or bfloat16 bits).
template <int R, typename S, typename Sums>
void by_groups(const float* xsum, int64_t K, const S* scales, const S* mins, const float* bias, float* out,
               int64_t N, int64_t n0, Sums&& sums) {
  vec acc[R][NB];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NB; j++) acc[r][j] = vec{};
  const int64_t groups = K / GROUP;
  for (int64_t g = 0; g < groups; g++) {
    vec part[2][R][NB];
    for (int e = 0; e < 2; e++)
      for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) part[e][r][j] = vec{};
    sums(g, part);
    for (int j = 0; j < NB; j++) {
      const vec sc = load_scales(scales + g * P, j), m = load_scales(mins + g * P, j);
      for (int r = 0; r < R; r++) acc[r][j] += sc * (part[0][r][j] + part[1][r][j]) + xsum[r * groups + g] * m;
    }
  }
  const int64_t width = std::min<int64_t>(P, N - n0);
  for (int r = 0; r < R; r++) store(acc[r], nullptr, bias, out + r * N + n0, width, n0);
}

// int4 codes [K, P / 2] of one panel, x float32 [R, K]. Two sets of group sums (even and odd k)
// keep two multiply-add chains per vector in flight where one row alone would wait on each.
template <int R, typename S>
void chunk_q4(const float* x, const float* xsum, int64_t K, const uint8_t* codes, const S* scales, const S* mins,
              const float* bias, float* out, int64_t N, int64_t n0) {
  constexpr int HALF = NB / 2;  // vectors per nibble half
  by_groups<R>(xsum, K, scales, mins, bias, out, N, n0, [&](int64_t g, vec (&part)[2][R][NB]) {
    for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 2) {
      for (int e = 0; e < 2; e++) {
        vec w[NB];
        for (int h = 0; h < HALF; h++) {
          const ivec v = widen_u8(codes + (k + e) * (P / 2) + h * VW);
          w[h] = to_float(v & 15);
          w[h + HALF] = to_float(v >> 4);
        }
        for (int r = 0; r < R; r++) {
          const float xs = x[r * K + k + e];
          for (int j = 0; j < NB; j++) part[e][r][j] += xs * w[j];
        }
      }
    }
  });
}

#if defined(__AVX512BF16__)
// How far ahead of the codes being read their next bytes are asked for: a panel's codes are a
// few KiB, so the hardware's prefetcher alone waits at each panel's start. Streaming the demo
// draft's 66 MB of int4 Linears, one row: 3.87 ms without, 3.17 ms at 4 KiB (1 KiB 3.19, 16 KiB
// 3.55; a quiet 2-core EPYC, all within +-5%).
constexpr int64_t PREFETCH_Q4 = 4096;

// int4 codes of one panel in k pairs [K / 2, P] bytes (byte 2i + e: output i's code at k + e in
// the low nibble, output i + 16's in the high one); x bfloat16 [R, K], its pairs read as one
// 32-bit word. Each pair of codes becomes a bfloat16 pair by a table look-up and one dot-product
// instruction adds both products exactly (bfloat16 products fit float32), so a k pair costs
// seven vector instructions for 64 weights, where chunk_q4 spends fourteen.
template <int R, typename S>
void chunk_q4_bf16(const uint16_t* x, const float* xsum, int64_t K, const uint8_t* codes, const S* scales,
                   const S* mins, const float* bias, float* out, int64_t N, int64_t n0) {
  static_assert(NB == 2, "a panel of two 16-float vectors");
  // bfloat16 of 0..15 (the upper 16 bits of the float), indexed by a word's low 5 bits
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                         0x4040, 0x4000, 0x3f80, 0x0000);
  const __m512i low = _mm512_set1_epi16(15);
  by_groups<R>(xsum, K, scales, mins, bias, out, N, n0, [&](int64_t g, vec (&part)[2][R][NB]) {
    for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 4) {
      _mm_prefetch((const char*)(codes + k * (P / 2)) + PREFETCH_Q4, _MM_HINT_T0);
      for (int e = 0; e < 2; e++) {
        const int64_t kp = k + 2 * e;  // this pair's first k
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + kp * (P / 2))));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low), table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        for (int r = 0; r < R; r++) {
          uint32_t pair;
          std::memcpy(&pair, x + r * K + kp, 4);
          const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
          part[e][r][0] = (vec)_mm512_dpbf16_ps((__m512)part[e][r][0], lo, xs);
          part[e][r][1] = (vec)_mm512_dpbf16_ps((__m512)part[e][r][1], hi, xs);
        }
      }
    }
  });
}
#endif

// Calls f.template operator()<n>() for a chunk of n rows (n a compile-time count up to the limit).
template <int LIMIT, typename F>
void dispatch(int64_t n, F&& f) {
  if constexpr (LIMIT >= 1) {
    if (n == LIMIT) return f.template operator()<LIMIT>();
    dispatch<LIMIT - 1>(n, f);
  }
}

// Every panel (in parallel) and every chunk of at most LIMIT rows (as even as possible):
// f.template operator()<rows>(first row, panel).
template <int LIMIT, typename F>
void each_panel(int64_t R, int64_t N, F&& f) {
  const int64_t chunks = (R + LIMIT - 1) / LIMIT;
  const int64_t panels = (N + P - 1) / P;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      int64_t r0 = 0;
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = (R - r0) / (chunks - c);
        dispatch<LIMIT>(n, [&]<int n_>() { f.template operator()<n_>(r0, p); });
        r0 += n;
      }
    }
  });
}

const float* bias_of(const c10::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.numel() == N && keep.scalar_type() == torch::kFloat32, "linear: bias must be [N] float32");
  return keep.data_ptr<float>();
}

torch::Tensor input_of(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "linear: x must be [rows, in] float32");
  TORCH_CHECK(x.size(1) == K, "linear: the input's width does not match the panels");
  return x.contiguous();
}

void check_panels(const torch::Tensor& panels, int64_t N, int64_t width) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == width, "linear: panels do not match x");
  TORCH_CHECK(panels.size(0) * P >= N && N > (panels.size(0) - 1) * P, "linear: N does not match the panels");
}

// [N, K] -> [ceil(N / P), K, P]: rows padded with zeros to whole panels, each panel's k-th row
// its P outputs' k-th weights
torch::Tensor by_panels(const torch::Tensor& t) {
  const int64_t N = t.size(0), K = t.size(1), panels = (N + P - 1) / P;
  auto padded = torch::zeros({panels * P, K}, t.options());
  padded.narrow(0, 0, N).copy_(t);
  return padded.view({panels, P, K}).transpose(1, 2).contiguous();
}

// What every call starts with: the checked inputs and its output [R, N]
struct Call {
  torch::Tensor x, bias_keep, out;
  const float* bias;
  int64_t K;
};

Call begin(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias, int64_t N,
           int64_t width) {
  check_panels(panels, N, width);
  Call c;
  c.x = input_of(x, panels.size(1));
  c.bias = bias_of(bias, N, c.bias_keep);
  c.out = torch::empty({x.size(0), N}, x.options());
  c.K = c.x.size(1);
  return c;
}

}  // namespace

// [N, K] float32 -> [ceil(N / P), K, P] float32 panels, zero-padded
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack: a 2-D float32 weight");
  return by_panels(weight);
}

// x [R, K] float32, panels from pack, bias [N] or None -> [R, N]
torch::Tensor linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N) {
  auto c = begin(x, panels, bias, N, P);
  const int64_t K = c.K;
  const float *xp = c.x.data_ptr<float>(), *w = panels.data_ptr<float>();
  float* o = c.out.data_ptr<float>();
  each_panel<ROWS>(x.size(0), N, [&]<int R>(int64_t r0, int64_t p) {
    chunk<R>(xp + r0 * K, K, w + p * K * P, c.bias, o + r0 * N, N, p * P);
  });
  return c.out;
}

// [N, K] int8 codes, [N] scales -> ([ceil(N / P), K, P] int8 panels, [ceil(N / P) * P] float32 scales)
std::vector<torch::Tensor> pack_q8(torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8, "pack_q8: 2-D int8 codes");
  const int64_t N = codes.size(0), panels = (N + P - 1) / P;
  auto s = torch::ones({panels * P}, scales.options().dtype(torch::kFloat32));
  s.narrow(0, 0, N).copy_(scales.reshape({N}));
  return {by_panels(codes), s};
}

torch::Tensor linear_q8(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, c10::optional<torch::Tensor> bias,
                        int64_t N) {
  TORCH_CHECK(panels.scalar_type() == torch::kInt8 && scales.numel() == panels.size(0) * P, "linear_q8: bad panels");
  auto c = begin(x, panels, bias, N, P);
  const int64_t K = c.K;
  const float *xp = c.x.data_ptr<float>(), *sp = scales.data_ptr<float>(), *b = c.bias;
  const int8_t* w = panels.data_ptr<int8_t>();
  float* o = c.out.data_ptr<float>();
  each_panel<ROWS>(x.size(0), N, [&]<int R>(int64_t r0, int64_t p) {
    chunk_q8<R>(xp + r0 * K, K, w + p * K * P, sp + p * P, b, o + r0 * N, N, p * P);
  });
  return c.out;
}

// codes [N, K] (uint8, 0..15), scales and mins [N, K / GROUP] ->
// ([ceil(N / P), K, P / 2] uint8, [ceil(N / P), K / GROUP, P] scales (bfloat16 or float32), the same for mins)
std::vector<torch::Tensor> pack_q4(torch::Tensor codes, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "pack_q4: 2-D uint8 codes");
  const int64_t K = codes.size(1);
  TORCH_CHECK(K % GROUP == 0, "pack_q4: in_features must be a multiple of 32");
  auto byk = by_panels(codes);  // [panels, K, P]
  auto lo = byk.narrow(2, 0, P / 2), hi = byk.narrow(2, P / 2, P / 2);
  auto packed = lo.bitwise_or(hi.bitwise_left_shift(4)).contiguous();  // [panels, K, P / 2]
  // bfloat16 scales stay bfloat16 (half the bytes); any other dtype is widened to float32
  const auto dtype = scales.scalar_type() == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
  return {packed, by_panels(scales.to(dtype)), by_panels(mins.to(dtype))};  // [panels, K / GROUP, P] each
}

torch::Tensor linear_q4(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, torch::Tensor mins,
                        c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(panels.scalar_type() == torch::kUInt8 && scales.sizes() == mins.sizes(), "linear_q4: bad panels");
  auto c = begin(x, panels, bias, N, P / 2);
  const int64_t K = c.K, groups = K / GROUP;
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == groups && scales.size(2) == P, "linear_q4: scales do not match");
  auto xsum = c.x.view({x.size(0), groups, GROUP}).sum(-1).contiguous();  // [R, groups]
  const float *xp = c.x.data_ptr<float>(), *xs = xsum.data_ptr<float>(), *b = c.bias;
  const uint8_t* w = panels.data_ptr<uint8_t>();
  float* o = c.out.data_ptr<float>();
  auto run = [&](const auto* sp, const auto* mp) {
    each_panel<ROWS_Q4>(x.size(0), N, [&]<int R>(int64_t r0, int64_t p) {
      chunk_q4<R>(xp + r0 * K, xs + r0 * groups, K, w + p * K * (P / 2), sp + p * groups * P, mp + p * groups * P, b,
                  o + r0 * N, N, p * P);
    });
  };
  if (scales.scalar_type() == torch::kBFloat16)
    run((const uint16_t*)scales.data_ptr(), (const uint16_t*)mins.data_ptr());
  else {
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32, "linear_q4: scales must be bfloat16 or float32");
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
  }
  return c.out;
}

#if defined(__AVX512BF16__)
bool has_q4_bf16() { return true; }

// [ceil(N / P), K, P / 2] codes (pack_q4's) -> the same in k pairs: [ceil(N / P), K / 2, P] bytes
torch::Tensor pair_q4(torch::Tensor panels) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) % 2 == 0 && panels.size(2) == P / 2, "pair_q4: pack_q4's codes");
  const int64_t n = panels.size(0), K = panels.size(1);
  return panels.view({n, K / 2, 2, P / 2}).transpose(2, 3).contiguous().view({n, K / 2, P});
}

// x bfloat16 [R, K], panels from pair_q4, scales and mins from pack_q4 -> float32 [R, N]
torch::Tensor linear_q4_bf16(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, torch::Tensor mins,
                             c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear_q4_bf16: x must be [rows, in] bfloat16");
  TORCH_CHECK(panels.scalar_type() == torch::kUInt8 && panels.dim() == 3 && panels.size(2) == P, "linear_q4_bf16: bad panels");
  const int64_t K = panels.size(1) * 2, groups = K / GROUP;
  TORCH_CHECK(x.size(1) == K && panels.size(0) * P >= N && N > (panels.size(0) - 1) * P, "linear_q4_bf16: shapes do not match");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == groups && scales.size(2) == P && scales.sizes() == mins.sizes(),
              "linear_q4_bf16: scales do not match");
  auto xc = x.contiguous();
  torch::Tensor keep;
  const float* b = bias_of(bias, N, keep);
  auto out = torch::empty({x.size(0), N}, x.options().dtype(torch::kFloat32));
  auto xsum = xc.view({x.size(0), groups, GROUP}).sum(-1, false, torch::kFloat32).contiguous();  // [R, groups]
  const uint16_t* xp = (const uint16_t*)xc.data_ptr();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* w = panels.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  auto run = [&](const auto* sp, const auto* mp) {
    each_panel<ROWS_Q4>(x.size(0), N, [&]<int R>(int64_t r0, int64_t p) {
      chunk_q4_bf16<R>(xp + r0 * K, xs + r0 * groups, K, w + p * K * (P / 2), sp + p * groups * P,
                       mp + p * groups * P, b, o + r0 * N, N, p * P);
    });
  };
  if (scales.scalar_type() == torch::kBFloat16)
    run((const uint16_t*)scales.data_ptr(), (const uint16_t*)mins.data_ptr());
  else
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
  return out;
}
#else
bool has_q4_bf16() { return false; }
#endif

int64_t panel_width() { return P; }

// As torch operators too, so a compiled step calls them from its graph with no Python in between.
TORCH_LIBRARY(trtspec_native, m) {
  m.def("linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("linear_q8(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor panels, Tensor scales, Tensor mins, Tensor? bias, int n) -> Tensor");
#if defined(__AVX512BF16__)
  m.def("linear_q4_bf16(Tensor x, Tensor panels, Tensor scales, Tensor mins, Tensor? bias, int n) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(trtspec_native, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_q8", &linear_q8);
  m.impl("linear_q4", &linear_q4);
#if defined(__AVX512BF16__)
  m.impl("linear_q4_bf16", &linear_q4_bf16);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("pack_q8", &pack_q8);
  m.def("linear_q8", &linear_q8);
  m.def("pack_q4", &pack_q4);
  m.def("linear_q4", &linear_q4);
  m.def("panel_width", &panel_width);
  m.def("has_q4_bf16", &has_q4_bf16);
#if defined(__AVX512BF16__)
  m.def("pair_q4", &pair_q4);
  m.def("linear_q4_bf16", &linear_q4_bf16);
#endif
}
