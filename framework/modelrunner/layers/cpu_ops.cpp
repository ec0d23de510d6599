// Fused elementwise layer ops for CPUs: RMSNorm (with the residual add before it), rotary
// embeddings, the gated MLP's silu(gate) * up, the KV-cache write, and the sampler's scans of the
// logits (argmax, and the finite check), each one operator call. A decode step of a small model runs
// them ~100 times per token on a few hundred floats each: torch's CPU versions are 5-8 operator
// calls apiece (pow, mean, add, rsqrt, mul, ...; index_select, chunk, mul, sub, cat, ...), so their
// dispatch, not their arithmetic, is what the step pays. Float32 on the CPU, and bfloat16 for the
// norms, rotary, silu(gate) * up and the KV write, rounded where torch's bfloat16 versions round (a
// bfloat16 engine's layers); the Python side (cpu_ops.py) checks dtypes and devices and keeps torch's versions
// for everything else.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // independent partial sums: the compiler vectorises them

inline float sum_of_squares(const float* x, int64_t n) {
  float part[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += x[k + j] * x[k + j];
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += part[j];
  for (; k < n; ++k) total += x[k] * x[k];
  return total;
}

inline void norm_row(const float* x, const float* w, double eps, int64_t n, float* out) {
  const float r = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t k = 0; k < n; ++k) out[k] = x[k] * r * w[k];
}

// A bfloat16 row as torch's bfloat16 RMSNorm computes it (modelrunner.layers.norm): normalised in
// float32, rounded to bfloat16, then times the bfloat16 weight, rounded again. `tmp` holds n floats.
inline void norm_row(const at::BFloat16* x, const at::BFloat16* w, double eps, int64_t n, at::BFloat16* out,
                     float* tmp) {
  for (int64_t k = 0; k < n; ++k) tmp[k] = static_cast<float>(x[k]);
  const float r = 1.f / std::sqrt(sum_of_squares(tmp, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t k = 0; k < n; ++k)
    out[k] = at::BFloat16(static_cast<float>(w[k]) * static_cast<float>(at::BFloat16(tmp[k] * r)));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK_VALUE((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.device().is_cpu(), name,
                    " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), name, " must be contiguous, got strides ", x.strides());
  TORCH_CHECK_VALUE(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1),
                    "weight must be ", x.scalar_type(), " [", x.size(-1), "], got ", w.scalar_type(), " ", w.sizes());
}

template <typename F>
void for_rows(int64_t rows, int64_t width, F&& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, width)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) body(r);
  });
}

// Each chunk of rows with a float32 scratch row of its own (the bfloat16 norm's).
template <typename F>
void for_rows_scratch(int64_t rows, int64_t width, F&& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, width)), [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(static_cast<size_t>(width));
    for (int64_t r = r0; r < r1; ++r) body(r, tmp.data());
  });
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const T *xp = x.const_data_ptr<T>(), *wp = weight.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    for_rows(rows, n, [&](int64_t r) { norm_row(xp + r * n, wp, eps, n, op + r * n); });
  } else {
    for_rows_scratch(rows, n, [&](int64_t r, float* tmp) { norm_row(xp + r * n, wp, eps, n, op + r * n, tmp); });
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x, weight, eps, out);
  else
    rms_norm_rows<at::BFloat16>(x, weight, eps, out);
  return out;
}

// sum = x + residual (rounded to the dtype, as torch's add), then its norm.
template <typename T>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out, at::Tensor& sum) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const T *xp = x.const_data_ptr<T>(), *rp = residual.const_data_ptr<T>(), *wp = weight.const_data_ptr<T>();
  T *op = out.data_ptr<T>(), *sp = sum.data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    for_rows(rows, n, [&](int64_t r) {
      float* s = sp + r * n;
      for (int64_t k = 0; k < n; ++k) s[k] = xp[r * n + k] + rp[r * n + k];
      norm_row(s, wp, eps, n, op + r * n);
    });
  } else {
    for_rows_scratch(rows, n, [&](int64_t r, float* tmp) {
      T* s = sp + r * n;
      for (int64_t k = 0; k < n; ++k) s[k] = T(static_cast<float>(xp[r * n + k]) + static_cast<float>(rp[r * n + k]));
      norm_row(s, wp, eps, n, op + r * n, tmp);
    });
  }
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  check_rows(residual, weight, "residual");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ",
                    residual.sizes());
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_rows<float>(x, residual, weight, eps, out, sum);
  else
    add_rms_norm_rows<at::BFloat16>(x, residual, weight, eps, out, sum);
  return {out, sum};
}

// x [tokens, heads, head_dim] (any strides but a contiguous last dimension) rotated by the
// cos/sin table's rows `positions` (table [max_position, head_dim]: cos half, then sin half, x's
// dtype), into a new contiguous tensor: out = cat(x1 cos - x2 sin, x2 cos + x1 sin), x1/x2 the halves
// of x. In bfloat16 each product and each sum is rounded, as torch's bfloat16 ops round them.
inline float rounded(float v, float) { return v; }
inline float rounded(float v, at::BFloat16) { return static_cast<float>(at::BFloat16(v)); }

template <typename T>
void rotate_rows(const int64_t* pp, const at::Tensor& x, const at::Tensor& table, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T *xp = x.const_data_ptr<T>(), *tp = table.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  const T tag{};
  for_rows(tokens, heads * dim, [&](int64_t t) {
    const T* cs = tp + pp[t] * dim;
    const T* sn = cs + half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* in = xp + t * st + h * sh;
      T* o = op + (t * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(in[i]), x2 = static_cast<float>(in[i + half]);
        const float c = static_cast<float>(cs[i]), s = static_cast<float>(sn[i]);
        o[i] = T(rounded(x1 * c, tag) - rounded(x2 * s, tag));
        o[i + half] = T(rounded(x2 * c, tag) + rounded(x1 * s, tag));
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& table) {
  TORCH_CHECK_VALUE((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.device().is_cpu() &&
                        x.dim() == 3 && x.stride(2) == 1,
                    "x must be a float32 or bfloat16 CPU tensor [tokens, heads, head_dim] with a contiguous last "
                    "dimension");
  TORCH_CHECK_VALUE(table.scalar_type() == x.scalar_type() && table.dim() == 2 && table.is_contiguous() &&
                        table.size(1) == x.size(2) && x.size(2) % 2 == 0,
                    "table must be contiguous ", x.scalar_type(), " [max_position, ", x.size(2), "], got ",
                    table.scalar_type(), " ", table.sizes());
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0),
                    "positions must be int64 [", x.size(0), "], got ", positions.scalar_type(), " ", positions.sizes());
  const at::Tensor pos = positions.contiguous();
  const int64_t limit = table.size(0);
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK_VALUE(pp[t] >= 0 && pp[t] < limit, "position ", pp[t], " of token ", t, " is outside the table's [0, ",
                      limit, ")");
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotate_rows<float>(pp, x, table, out);
  else
    rotate_rows<at::BFloat16>(pp, x, table, out);
  return out;
}

// silu(gate) * up of x = [..., gate | up]: torch's two kernels, called from here (the Python side's
// chunk, silu and mul are three dispatches).
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "x must end in an even dimension [..., 2 * d], got ",
                    x.sizes());
  const int64_t d = x.size(-1) / 2;
  at::Tensor out = at::silu(x.narrow(-1, 0, d));
  out.mul_(x.narrow(-1, d, d));
  return out;
}

// key/value [tokens, kv_heads, head_dim] (a contiguous last dimension; e.g. views of a fused qkv
// projection) into kv_cache [2, blocks, block_size, kv_heads, head_dim] (contiguous, same dtype) at
// the flat slots slot_mapping [tokens], in place: one copy per token and head (index_copy_ through
// Python views costs ~15 us per layer here).
void store_kv(at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, ",
                    "head_dim] alike, got ", key.sizes(), " and ", value.sizes());
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK_VALUE(kv_cache.is_contiguous() && kv_cache.dim() >= 3 && kv_cache.size(0) == 2 &&
                        kv_cache.size(-1) == dim && kv_cache.size(-2) == heads,
                    "kv_cache must be contiguous [2, ..., ", heads, ", ", dim, "], got ", kv_cache.sizes());
  TORCH_CHECK_VALUE(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
                    "key, value and kv_cache must have one dtype, got ", key.scalar_type(), ", ", value.scalar_type(),
                    " and ", kv_cache.scalar_type());
  TORCH_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, "key and value need a contiguous last dimension");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
                    "slot_mapping must be int64 [", tokens, "], got ", slot_mapping.scalar_type(), " ",
                    slot_mapping.sizes());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t slots_per_half = kv_cache.numel() / (2 * heads * dim), item = kv_cache.element_size();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < slots_per_half, "slot ", sp[t], " of token ", t,
                      " is outside the cache's [0, ", slots_per_half, ")");
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* sources[2] = {static_cast<const char*>(key.const_data_ptr()),
                            static_cast<const char*>(value.const_data_ptr())};
  const int64_t strides[2][2] = {{key.stride(0), key.stride(1)}, {value.stride(0), value.stride(1)}};
  for (int half = 0; half < 2; ++half) {
    char* base = cache + half * slots_per_half * heads * dim * item;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(base + ((sp[t] * heads + h) * dim) * item,
                    sources[half] + (t * strides[half][0] + h * strides[half][1]) * item, dim * item);
  }
}

}  // namespace

// Logits rows [S, V] (float32, contiguous): torch's argmax and isfinite/all/any take 45-65 us each
// on one 49k-token row here, where a vectorised pass takes a few.
void check_logits(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
                    "logits must be a contiguous float32 CPU tensor [rows, vocab], got ", x.scalar_type(), " ",
                    x.sizes(), " on ", x.device());
}

struct RowScan {
  float max;     // the largest non-NaN value (-inf if none)
  bool bad;      // a NaN or +inf somewhere
};

// The compilers here do not vectorise this max-with-flags reduction by themselves: intrinsics where
// the build has them (-march=native), plain code otherwise.
inline RowScan scan_row(const float* x, int64_t n) {
  RowScan r{-INFINITY, false};
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __mmask16 bad = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    m = _mm512_max_ps(v, m);                             // a NaN in v keeps m
    bad |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);      // NaN or +inf
  }
  r.max = _mm512_reduce_max_ps(m);
  r.bad = bad != 0;
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  const __m256 inf = _mm256_set1_ps(INFINITY);
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    m = _mm256_max_ps(v, m);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) r.max = v > r.max ? v : r.max;
  r.bad = _mm256_movemask_ps(bad) != 0;
#endif
  for (; k < n; ++k) {
    r.max = x[k] > r.max ? x[k] : r.max;
    r.bad |= !(x[k] < INFINITY);
  }
  return r;
}

// The first index of row [n] holding value (n - 1 when none does).
inline int64_t first_equal(const float* row, int64_t n, float value) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; k + 16 <= n; k += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + k), target, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz(hit);
  }
#endif
  for (; k < n - 1 && row[k] != value; ++k) {}
  return k;
}

// Per row, the index torch.argmax gives: the first maximum, or the first NaN (argmax ranks NaN highest).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_logits(x);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK_VALUE(n > 0, "argmax of an empty row (logits ", x.sizes(), ")");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(rows, n, [&](int64_t r) {
    const float* row = xp + r * n;
    const RowScan s = scan_row(row, n);
    if (s.bad) {  // the first NaN if there is one; else the +inf is the maximum below
      int64_t k = 0;
      for (; k < n && row[k] == row[k]; ++k) {}
      if (k < n) {
        op[r] = k;
        return;
      }
    }
    op[r] = first_equal(row, n, s.max);
  });
  return out;
}

// Per row: whether it holds a NaN or +inf, or is all -inf (no token can be sampled from it).
at::Tensor broken_rows(const at::Tensor& x) {
  check_logits(x);
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kBool));
  const float* xp = x.const_data_ptr<float>();
  bool* op = out.data_ptr<bool>();
  for_rows(rows, n, [&](int64_t r) {
    const RowScan s = scan_row(xp + r * n, n);
    op[r] = s.bad || s.max == -INFINITY;
  });
  return out;
}

TORCH_LIBRARY(modelrunner_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor positions, Tensor x, Tensor table) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("store_kv(Tensor(a!) kv_cache, Tensor slot_mapping, Tensor key, Tensor value) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("broken_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelrunner_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kv", &store_kv);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("broken_rows", &broken_rows);
}
