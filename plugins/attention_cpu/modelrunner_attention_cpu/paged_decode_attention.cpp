// Decode attention over a paged KV cache, for CPUs: one query per sequence, keys and values read
// in place through the block table (no gather, no copy), softmax in float.
//
// Registered as the torch operator modelrunner_cpu::paged_decode_attention so that eager code,
// torch.compile graphs and torch.export programs all call the same kernel.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Eight floats as one vector (one AVX register; the compiler splits it where vectors are narrower).
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline v8 load(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline float sum(v8 v) {
  v4 lo, hi;
  __builtin_memcpy(&lo, &v, sizeof(lo));
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const v4 s = lo + hi;
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// exp(x) for x <= 0 (scores minus their maximum) with relative error about 1e-7:
// 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial of exp.
inline v8 exp_nonpositive(v8 x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const v8 shifter = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const v8 n = (x * splat(1.44269504f) + shifter) - shifter;
  const v8 r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);
  v8 p = splat(1.f / 720);
  p = p * r + splat(1.f / 120);
  p = p * r + splat(1.f / 24);
  p = p * r + splat(1.f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  v8 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  v8 acc = splat(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float total = sum(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// dot(a, rows[r] + offset, n) for four rows at once, each summed in the same order as dot: four
// independent chains of multiply-adds instead of one waiting on its own latency.
inline void dot4(const float* a, const float* const* rows, int64_t offset, int64_t n, float* out) {
  const float *r0 = rows[0] + offset, *r1 = rows[1] + offset, *r2 = rows[2] + offset, *r3 = rows[3] + offset;
  v8 c0 = splat(0.f), c1 = c0, c2 = c0, c3 = c0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v8 x = load(a + i);
    c0 += x * load(r0 + i);
    c1 += x * load(r1 + i);
    c2 += x * load(r2 + i);
    c3 += x * load(r3 + i);
  }
  out[0] = sum(c0), out[1] = sum(c1), out[2] = sum(c2), out[3] = sum(c3);
  for (; i < n; ++i) out[0] += a[i] * r0[i], out[1] += a[i] * r1[i], out[2] += a[i] * r2[i], out[3] += a[i] * r3[i];
}

// Replaces s[0, n) by exp(s - max) and returns their sum.
inline float exp_and_sum(float* s, int64_t n, float max) {
  v8 total = splat(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v8 e = exp_nonpositive(load(s + i) - splat(max));
    store(s + i, e);
    total += e;
  }
  float rest = 0.f;
  for (; i < n; ++i) rest += (s[i] = std::exp(s[i] - max));
  return sum(total) + rest;
}

// acc[0, n) += sum over rows r < count of weights[r] * rows[r][offset, offset + n): each accumulator
// vector is loaded and stored once for all the rows.
inline void weighted_rows(float* acc, const float* const* rows, int64_t offset, const float* weights, int64_t count,
                          int64_t n) {
  int64_t i = 0;
  if (count == 4) {
    const v8 w0 = splat(weights[0]), w1 = splat(weights[1]), w2 = splat(weights[2]), w3 = splat(weights[3]);
    const float *r0 = rows[0] + offset, *r1 = rows[1] + offset, *r2 = rows[2] + offset, *r3 = rows[3] + offset;
    for (; i + kLanes <= n; i += kLanes)
      store(acc + i, load(acc + i) + w0 * load(r0 + i) + w1 * load(r1 + i) + w2 * load(r2 + i) + w3 * load(r3 + i));
  }
  for (; i + kLanes <= n; i += kLanes) {
    v8 a = load(acc + i);
    for (int64_t r = 0; r < count; ++r) a += splat(weights[r]) * load(rows[r] + offset + i);
    store(acc + i, a);
  }
  for (; i < n; ++i)
    for (int64_t r = 0; r < count; ++r) acc[i] += weights[r] * rows[r][offset + i];
}

// The rows of one cache block that a work item reads, as float pointers: into the cache itself for
// float caches, into `buffer` (converted) for the others.
template <typename T>
struct BlockRows {
  const float* rows[256];
  std::vector<float> buffer;

  int64_t fetch(const T* block, int64_t token_stride, int64_t from, int64_t to, int64_t width) {
    for (int64_t t = from; t < to; ++t) {
      const T* src = block + t * token_stride;
      if constexpr (std::is_same_v<T, float>) {
        rows[t - from] = src;
      } else {
        buffer.resize(static_cast<size_t>(256 * width));
        float* dst = buffer.data() + (t - from) * width;
        for (int64_t i = 0; i < width; ++i) dst[i] = static_cast<float>(src[i]);
        rows[t - from] = dst;
      }
    }
    return to - from;
  }
};

// One cache line asked of memory ahead of its use. On x86 by an asm statement: GCC 12's dead-code
// elimination removed __builtin_prefetch from prefetch_rows' loops once inlined here.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Rows [t0, t1) of a cache block, asked of memory ahead of their use. Blocks lie anywhere in the
// cache, which the hardware prefetcher cannot follow.
template <typename T>
inline void prefetch_rows(const T* block, int64_t token_stride, int64_t t0, int64_t t1, int64_t width) {
  const char* base = reinterpret_cast<const char*>(block);
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T)), stride = token_stride * sizeof(T);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t o = 0; o < row_bytes; o += 64) prefetch_line(base + t * stride + o);
}

// Softmax state of one sequence's heads over a range of its positions: the weighted sum of values
// (not yet divided), the largest score and the sum of exp(score - largest), per head.
struct Partial {
  float* acc;     // [heads][head_dim]
  float* maxima;  // [heads]
  float* sums;    // [heads]
};

// Every query head of one sequence attends to the positions [first, end), each cached row read
// once for all the heads; the result is left in `partial`.
// kHeadDim: the head size when known at compile time (0: `dynamic_head_dim`), so the loops over a
// head unroll completely.
template <typename T, typename Index, int64_t kHeadDim, bool kPrefetch>
void attend(const float* q, const T* key_cache, const T* value_cache, const Index* blocks, int64_t first,
            int64_t end, int64_t kv_heads, int64_t group, int64_t dynamic_head_dim, int64_t block_size,
            int64_t block_stride, int64_t token_stride, std::vector<float>& scratch, BlockRows<T>& rows,
            Partial partial) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : dynamic_head_dim;
  const int64_t span = end - first, heads = kv_heads * group, row_width = kv_heads * head_dim;
  std::fill(partial.acc, partial.acc + heads * head_dim, 0.f);
  std::fill(partial.sums, partial.sums + heads, 0.f);
  std::fill(partial.maxima, partial.maxima + heads, -std::numeric_limits<float>::infinity());
  if (span <= 0) return;
  scratch.resize(static_cast<size_t>(heads * span));
  float* scores = scratch.data();  // [heads][span]
  float* maxima = partial.maxima;

  // One block-table lookup per block; rows in memory order, each read whole before the next.
  const auto block_range = [&](int64_t b) {
    const int64_t start = b * block_size;
    return std::pair<int64_t, int64_t>(std::max(start, first) - start, std::min(start + block_size, end) - start);
  };
  const int64_t first_block = first / block_size, end_block = (end + block_size - 1) / block_size;
  const auto for_each_block = [&](const T* cache, auto&& visit) {
    for (int64_t b = first_block; b < end_block; ++b) {
      const auto [from, to] = block_range(b);
      const T* base = cache + static_cast<int64_t>(blocks[b]) * block_stride;
      visit(b, b * block_size + from - first, rows.fetch(base, token_stride, from, to, row_width));
    }
  };
  // Rows [t0, t1) of block b of a cache, asked of memory ahead of their use (see prefetch_rows),
  // in the kPrefetch instantiation only: a run-time test here made small calls 10% slower.
  const auto prefetch_block = [&](const T* cache, int64_t b, int64_t t0, int64_t t1) {
    if constexpr (kPrefetch) {
      if (b >= end_block) return;
      const auto [from, to] = block_range(b);
      prefetch_rows(cache + static_cast<int64_t>(blocks[b]) * block_stride, token_stride, std::max(from, t0),
                    std::min(to, t1), row_width);
    }
  };
  // Keys four rows at a time (dot4), the rest one by one. Alongside, the same rows of the next key
  // block and of this block's values (read after the softmax) are fetched.
  prefetch_block(key_cache, first_block, 0, block_size);
  for_each_block(key_cache, [&](int64_t b, int64_t i0, int64_t count) {
    const int64_t from = block_range(b).first;
    int64_t r = 0;
    for (; r + 4 <= count; r += 4) {
      prefetch_block(key_cache, b + 1, from + r, from + r + 4);
      prefetch_block(value_cache, b, from + r, from + r + 4);
      for (int64_t kh = 0; kh < kv_heads; ++kh)
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          float* score = scores + h * span + i0 + r;
          dot4(q + h * head_dim, rows.rows + r, kh * head_dim, head_dim, score);
          maxima[h] = std::max({maxima[h], score[0], score[1], score[2], score[3]});
        }
    }
    prefetch_block(key_cache, b + 1, from + r, block_size);
    prefetch_block(value_cache, b, from + r, block_size);
    for (; r < count; ++r)
      for (int64_t kh = 0; kh < kv_heads; ++kh)
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
          const float score = dot(q + h * head_dim, rows.rows[r] + kh * head_dim, head_dim);
          scores[h * span + i0 + r] = score;
          maxima[h] = std::max(maxima[h], score);
        }
  });
  for (int64_t h = 0; h < heads; ++h) partial.sums[h] = exp_and_sum(scores + h * span, span, maxima[h]);
  // Values four rows at a time: the accumulators are loaded and stored once per four rows.
  for_each_block(value_cache, [&](int64_t, int64_t i0, int64_t count) {
    for (int64_t r = 0; r < count; r += 4)
      for (int64_t kh = 0; kh < kv_heads; ++kh)
        for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
          weighted_rows(partial.acc + h * head_dim, rows.rows + r, kh * head_dim, scores + h * span + i0 + r,
                        std::min<int64_t>(4, count - r), head_dim);
  });
}

template <typename T, typename Index>
void run(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
         const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3), num_blocks = kv_cache.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t block_stride = kv_cache.stride(1), token_stride = kv_cache.stride(2);
  const T* key_cache = kv_cache.const_data_ptr<T>();
  const T* value_cache = key_cache + kv_cache.stride(0);
  const Index* table = block_table.const_data_ptr<Index>();
  const int64_t table_stride = block_table.stride(0);
  const int64_t* lengths = seq_lens.const_data_ptr<int64_t>();

  int64_t rows = 0, longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lengths[s] >= 1, "every sequence needs at least one cached position, got seq_len ", lengths[s]);
    TORCH_CHECK(lengths[s] <= block_table.size(1) * block_size, "a seq_len of ", lengths[s], " needs more than the ",
                block_table.size(1), " blocks of ", block_size, " slots in block_table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, lengths[s] - window) : 0;
    for (int64_t b = first / block_size; b < (lengths[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[s * table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_table[", s, ", ", b, "] = ", block,
                  " is not a block of the cache (0..", num_blocks - 1, ")");
    }
    rows += lengths[s] - first;
    longest = std::max(longest, lengths[s] - first);
  }
  // Few sequences: each one's positions are cut into chunks of whole blocks (at least 256 positions)
  // attended in parallel, then merged (flash-decoding), so that long contexts use every thread.
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = num_seqs >= 4 * threads ? 1 : (4 * threads + num_seqs - 1) / num_seqs;
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, longest / 256));
  const int64_t state = heads * (head_dim + 2);  // floats of one Partial
  std::vector<float> partials(static_cast<size_t>(num_seqs * splits * state));
  const auto partial_at = [&](int64_t s, int64_t c) {
    float* base = partials.data() + (s * splits + c) * state;
    return Partial{base, base + heads * head_dim, base + heads * head_dim + heads};
  };
  // Waking the other threads costs more than a few thousand rows of work (a short decode of batch 1).
  const int64_t grain = rows * kv_heads < 1024 ? num_seqs * splits : 1;
  // Calls that read 1 MiB of cache or more prefetch the blocks ahead: the layers of a step then read
  // more than the CPU's caches keep between steps. Timed on Zen 3, 30 layers' caches, 2 threads,
  // medians of 4 alternating rounds: 64 sequences of 64 positions (6.3 MB a layer) 591 -> 563 us;
  // one of 2,048 positions (3.1 MB) 266 -> 246 us. Below it they cost more than they save: one
  // sequence of 72 positions took 10.5 -> 12.2 us with them.
  const int64_t cache_bytes = rows * 2 * kv_heads * head_dim * static_cast<int64_t>(sizeof(T));
  const bool prefetch = cache_bytes >= (int64_t{1} << 20);
  at::parallel_for(0, num_seqs * splits, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(heads * head_dim)), scratch;
    BlockRows<T> block_rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / splits, c = item % splits;
      const int64_t length = lengths[s], first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t per_chunk = ((length - first + splits - 1) / splits + block_size - 1) / block_size * block_size;
      const int64_t from = std::min(length, first + c * per_chunk), to = std::min(length, from + per_chunk);
      const T* query_row = query.const_data_ptr<T>() + s * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) q[i] = static_cast<float>(query_row[i]) * static_cast<float>(scale);
      const Index* blocks = table + s * table_stride;
      const Partial partial = partial_at(s, c);
      const auto call = [&]<int64_t kHeadDim, bool kPrefetch>() {
        attend<T, Index, kHeadDim, kPrefetch>(q.data(), key_cache, value_cache, blocks, from, to, kv_heads, group,
                                              head_dim, block_size, block_stride, token_stride, scratch, block_rows,
                                              partial);
      };
      const auto with_head_dim = [&]<bool kPrefetch>() {
        if (head_dim == 64)
          call.template operator()<64, kPrefetch>();
        else if (head_dim == 128)
          call.template operator()<128, kPrefetch>();
        else
          call.template operator()<0, kPrefetch>();
      };
      prefetch ? with_head_dim.template operator()<true>() : with_head_dim.template operator()<false>();
    }
  });
  // Merge each sequence's chunks: rescale every chunk to the overall largest score, then divide.
  T* o = out.data_ptr<T>();
  std::vector<float> merged(static_cast<size_t>(head_dim));
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t h = 0; h < heads; ++h) {
      float largest = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < splits; ++c) largest = std::max(largest, partial_at(s, c).maxima[h]);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t c = 0; c < splits; ++c) {
        const Partial p = partial_at(s, c);
        if (p.sums[h] == 0.f) continue;  // an empty chunk
        const float weight = std::exp(p.maxima[h] - largest);
        total += p.sums[h] * weight;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += p.acc[h * head_dim + d] * weight;
      }
      for (int64_t d = 0; d < head_dim; ++d) o[(s * heads + h) * head_dim + d] = static_cast<T>(merged[d] / total);
    }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got shape ", query.sizes());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got shape ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.size(2) <= 256, "block_size must be at most 256, got ", kv_cache.size(2));
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode_attention runs on CPU tensors only");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query dtype ", query.scalar_type(),
              " differs from kv_cache dtype ", kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_dim of query (", query.size(2), ") and kv_cache (",
              kv_cache.size(4), ") differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "num_heads (", query.size(1),
              ") must be a multiple of num_kv_heads (", kv_cache.size(3), ")");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == query.size(0),
              "block_table must be [num_seqs, max_blocks] with num_seqs = ", query.size(0), ", got shape ",
              block_table.sizes());
  TORCH_CHECK(block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong,
              "block_table must be int32 or int64, got ", block_table.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0),
              "seq_lens must be [num_seqs] with num_seqs = ", query.size(0), ", got shape ", seq_lens.sizes());
  const at::Tensor q = query.contiguous();
  const at::Tensor table = block_table.stride(1) == 1 ? block_table : block_table.contiguous();
  const at::Tensor lengths = seq_lens.to(at::kLong).contiguous();
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (table.scalar_type() == at::kInt)
      run<scalar_t, int32_t>(q, kv_cache, table, lengths, scale, window, out);
    else
      run<scalar_t, int64_t>(q, kv_cache, table, lengths, scale, window, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(modelrunner_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(modelrunner_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
