// yggtree::rows_attention -- attention of W query rows, each computed on its own, over the two
// parts runtime/model.py's _rows_attention defines (built with w4a8.cpp into one library by
// runtime/w4a8.py; models in the w4a8 format use it, runtime/quant.py):
//
//   part 1: the slots a row reads in place, head[b, r, s] true, s < C, in slot order;
//   part 2: its window, window[b, r, t] >= 0, t < T, in window order (its last T visible slots).
//
// For query head h (KV head h / G) of row r: scores s_j = (q . k_j) * (1 / sqrt(D)) over the
// visible slots only (part 1, then part 2), m = max_j s_j, p_j = exp(s_j - m),
// out = (sum_part1 p_j v_j + sum_part2 p_j v_j) / (sum_part1 p_j + sum_part2 p_j).
// Every sum runs in a fixed order over the row's own visible slots (the dot product over D in
// LANES-wide chunks then a fixed lane reduction; the others slot by slot, LANES at a time for the
// probabilities' sums), so a row's result depends neither on the call's other rows nor on the
// bucket C nor on the thread count; a tree node and the plain step at its position see the same
// part 1 and the same window values, hence the same bits. Work is proportional to the visible
// slots, not to the context bucket. float32 or bfloat16 (q, K and V read as float32, every sum in
// float32, the output rounded to bfloat16 at the end: _rows_attention's .float() and .to(dtype)),
// or float32 q over a 16-bit cache (float16 or bfloat16 K and V, read as float32, exactly: a float32
// model's 16-bit KV cache); D one of the head dims the library is built for (16 x YGGTREE_HEAD_CHUNKS,
// set by runtime/kernels.py's HEAD_DIMS).
//
// yggtree::tree_attention (below): the same op, the same bits, with the rows of a call sharing one pass
// over each KV head's cache instead of one pass each.
#include "kernels.h"
#include "loops.h"
#include "prefetch.h"
#include "simd.h"
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace yggtree::simd;
using yggtree::BF16;
using yggtree::F16;

// Fetch one K or V row (D values) into the first-level cache (yggtree::attention_ahead's slots ahead of a read)
template <typename K>
inline void fetch_row(const K* row, int64_t D) {
  const char* c = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(K)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// e^x for LANES floats <= 0 (the scores minus their maximum): 2^n e^r with n = round(x log2 e) and
// r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf polynomial; below -104 the result is 0.
inline F exp_neg(F x) {
  x = max(x, set1(-104.f));
  const F n = round_even(mul(x, set1(1.44269504088896341f)));
  F r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.f)));
  return scalef(p, n);
}

// sum of n floats: LANES lanes slot by slot (a tail adds zeros), then the lanes in a fixed order
inline float sum_of(const float* x, int64_t n) {
  F acc = zero();
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) acc = add(acc, load(x + j));
  if (j < n) acc = add(acc, load_n(x + j, int(n - j)));
  return reduce_add(acc);
}

// LANES values of q, K or V as float32, and LANES results stored in the model's dtype: bfloat16 is the
// high half of a float32; the store rounds to nearest even, as a tensor's .to(torch.bfloat16)
inline F load16(const float* p) { return load(p); }
inline F load16(const BF16* p) { return load(reinterpret_cast<const uint16_t*>(p)); }
inline F load16(const F16* p) { return load_half(p); }
inline void store16(float* p, F v) { store(p, v); }
inline void store16(BF16* p, F v) { store_bf16(reinterpret_cast<uint16_t*>(p), v); }

// The head dims D = 16 ND the kernels are compiled for (-DYGGTREE_HEAD_CHUNKS from runtime/kernels.py's
// HEAD_DIMS, which also sends other dims to torch's attention): each holds a head's queries in registers
// as its own set of functions, and each such set costs the library's build a few seconds
using HeadChunks = std::integer_sequence<int, YGGTREE_HEAD_CHUNKS>;
constexpr int HEAD_CHUNKS[] = {YGGTREE_HEAD_CHUNKS};

// The index of D in HEAD_CHUNKS, -1 where the library has no kernel for it
inline int chunk_index(int64_t D) {
  for (int i = 0; i < static_cast<int>(std::size(HEAD_CHUNKS)); ++i)
    if (16 * HEAD_CHUNKS[i] == D) return i;
  return -1;
}

// One head's n > 0 scores (n1 of part 1, then part 2) to their exp(s_j - m) in place; returns their sum
inline float softmax(float* sg, int64_t n, int64_t n1) {
  F mx = set1(sg[0]);  // the maximum (exact in any order)
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) mx = max(mx, load(sg + j));
  if (j < n) mx = max(mx, load_n(sg + j, int(n - j), sg[0]));
  const F mv = set1(reduce_max(mx));
  for (j = 0; j + LANES <= n; j += LANES) store(sg + j, exp_neg(sub(load(sg + j), mv)));
  if (j < n) store_n(sg + j, exp_neg(sub(load_n(sg + j, int(n - j)), mv)), int(n - j));
  return sum_of(sg, n1) + sum_of(sg + n1, n - n1);
}

// Scratch of one thread: the visible slots' scores and their slot numbers (reused across calls)
struct Scratch {
  std::vector<float> sc;
  std::vector<int64_t> slot;
};

// NG heads of one query row that share a KV head (see the header), with ND = D / 16 known at
// compile time so the queries and the weighted sums' accumulators stay in registers. Each head's
// arithmetic is what it would be alone, in the same order (the heads only share the loads of K
// and V rows and fill each other's latency), so the grouping changes no bit.
template <typename E, typename K, int ND, int NG>
void head_group(const E* qh, int64_t qs, const K* kb, const K* vb, int64_t ks1, int64_t vs1, const bool* hm,
                int64_t C, const int64_t* win, int64_t T, float scale, E* o, int64_t os, Scratch& buf) {
  constexpr int NC = ND * 16 / LANES;  // vectors a head's D = 16 ND values
  const int64_t cap = C + T;
  float* sc = buf.sc.data();  // [NG, C + T] scores, then probabilities
  int64_t* slot = buf.slot.data();
  F qv[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = load16(qh + g * qs + LANES * c);
  auto score = [&](int64_t s, int64_t j) {
    const K* kr = kb + s * ks1;
    F acc[NG];
    const F k0 = load16(kr);
    for (int g = 0; g < NG; ++g) acc[g] = mul(qv[g][0], k0);
    for (int c = 1; c < NC; ++c) {
      const F kc = load16(kr + LANES * c);
      for (int g = 0; g < NG; ++g) acc[g] = fmadd(qv[g][c], kc, acc[g]);
    }
    for (int g = 0; g < NG; ++g) sc[g * cap + j] = reduce_add(acc[g]) * scale;
  };
  // K and V rows are read in slot order, each KV head's slots one contiguous run (the cache is
  // head-major); the rows `ahead` slots on are fetched first where that is this machine's choice
  const int64_t ahead = yggtree::attention_ahead();
  int64_t n = 0;
  for (int64_t s = 0; s < C; ++s)
    if (hm[s]) {
      if (ahead) fetch_row(kb + std::min(s + ahead, C - 1) * ks1, ND * 16);
      slot[n] = s, score(s, n++);
    }
  const int64_t n1 = n;
  for (int64_t t = 0; t < T; ++t)
    if (win[t] >= 0) slot[n] = win[t], score(win[t], n++);
  if (n == 0) {  // a row that sees nothing (never in a decode step): zeros
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < NC; ++c) store16(o + g * os + LANES * c, zero());
    return;
  }
  float total[NG];
  for (int g = 0; g < NG; ++g) total[g] = softmax(sc + g * cap, n, n1);
  F a1[NG][NC], a2[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) a1[g][c] = zero(), a2[g][c] = zero();
  auto weigh = [&](F (&a)[NG][NC], int64_t jj) {
    const K* vr = vb + slot[jj] * vs1;
    for (int c = 0; c < NC; ++c) {
      const F vc = load16(vr + LANES * c);
      for (int g = 0; g < NG; ++g) a[g][c] = fmadd(set1(sc[g * cap + jj]), vc, a[g][c]);
    }
  };
  for (int64_t jj = 0; jj < n1; ++jj) {
    if (ahead) fetch_row(vb + slot[std::min(jj + ahead, n1 - 1)] * vs1, ND * 16);
    weigh(a1, jj);
  }
  for (int64_t jj = n1; jj < n; ++jj) weigh(a2, jj);
  for (int g = 0; g < NG; ++g) {
    const F tv = set1(total[g]);
    for (int c = 0; c < NC; ++c) store16(o + g * os + LANES * c, div(add(a1[g][c], a2[g][c]), tv));
  }
}

constexpr int MAX_GROUP = 4;  // heads computed together (a KV head's query heads, up to this many)

template <typename E, typename K>
using GroupFn = void (*)(const E*, int64_t, const K*, const K*, int64_t, int64_t, const bool*, int64_t, const int64_t*,
                         int64_t, float, E*, int64_t, Scratch&);

template <typename E, typename K, int ND, int... G>
constexpr std::array<GroupFn<E, K>, sizeof...(G)> group_fns(std::integer_sequence<int, G...>) {
  return {&head_group<E, K, ND, G + 1>...};
}

template <typename E, typename K, int... ND>
constexpr std::array<std::array<GroupFn<E, K>, MAX_GROUP>, sizeof...(ND)> all_fns(std::integer_sequence<int, ND...>) {
  return {group_fns<E, K, ND>(std::make_integer_sequence<int, MAX_GROUP>{})...};
}

// q, k, v and out of a call in its dtypes (E: q's and out's, K: the cache's)
template <typename E, typename K>
std::tuple<const E*, const K*, const K*, E*> pointers(const yggtree::AttentionCall& a) {
  return {static_cast<const E*>(a.q), static_cast<const K*>(a.k), static_cast<const K*>(a.v), static_cast<E*>(a.out)};
}

template <typename E, typename K>
void run(const yggtree::AttentionCall& a) {
  const int64_t B = a.B, W = a.W, H = a.H, D = a.D, C = a.C, Hkv = a.Hkv, T = a.T, G = H / Hkv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const auto [qp, kp, vp, op] = pointers<E, K>(a);
  const bool* hp = a.head;
  const int64_t* wp = a.window;
  const int64_t ks0 = a.ks0, ks1 = a.ks1, ks2 = a.ks2, vs0 = a.vs0, vs1 = a.vs1, vs2 = a.vs2;
  static constexpr auto fns = all_fns<E, K>(HeadChunks{});
  const auto& by_group = fns[chunk_index(D)];
  // Work items in (batch, KV head, row, query head of the group) order: a thread's share holds
  // whole KV heads where it can, so each reads its KV heads' K and V rows once from memory and
  // then from its cache for the other rows (in (row, head) order a W-row call had every thread
  // stream every KV head). Which thread computes a (row, head) changes no bit of it.
  yggtree::parallel_for(0, B * W * H, 1, [&](int64_t i0, int64_t i1) {
    static thread_local Scratch buf;
    if (static_cast<int64_t>(buf.slot.size()) < C + T) buf.sc.resize(MAX_GROUP * (C + T)), buf.slot.resize(C + T);
    for (int64_t i = i0; i < i1;) {  // this thread's heads, in runs that share a KV head
      const int64_t b = i / (W * H), g = (i / (W * G)) % Hkv, r = (i / G) % W, h = g * G + i % G;
      const int64_t ng = std::min<int64_t>({i1 - i, (g + 1) * G - h, MAX_GROUP});
      by_group[ng - 1](qp + ((b * W + r) * H + h) * D, D, kp + b * ks0 + g * ks2, vp + b * vs0 + g * vs2, ks1, vs1,
                       hp + (b * W + r) * C, C, wp + (b * W + r) * T, T, scale, op + (b * W + r) * H * D + h * D, D, buf);
      i += ng;
    }
  });
}

// ---- yggtree::tree_attention: rows_attention's rows, bit for bit, from one pass over the cache ----
//
// A verify step's rows read nested part 1s: every tree row sees the committed prefix, and its part 1 is
// that prefix's first visible slots (the rest is in its window), so each row's part-1 slots are the first
// n1 of U, the slots some row of the batch entry reads in part 1. Per (batch entry, KV head) the kernel
// walks U once for all the rows and query heads it computes there, LANES slots at a time: a tile of K rows
// is fetched once (16-bit rows converted once) and scored against every query, each V row is loaded once
// per block of queries, while each (row, head) does the arithmetic head_group does for it, in the same
// order -- its scores (the LANES-wide partial sums over D reduced by reduce_add_each, bitwise reduce_add),
// its softmax (the same function), its weighted sums slot by slot. Its window stays its own. A row whose
// part 1 is not a prefix of U (masks that are not nested) is computed by head_group, so any mask gives
// rows_attention's bits; only the sharing is lost. A one-row call runs rows_attention's loop.

// The part 1 a batch entry's rows share, and their windows
struct Shared {
  std::vector<int64_t> slots;  // U: the slots some row reads in part 1, in slot order
  std::vector<int64_t> n1;     // per row: its part 1 is U's first n1 slots (-1: it is not a prefix of U)
  std::vector<int64_t> win;    // per row: its window's slots, T each (the first n2 of them set)
  std::vector<int64_t> n2;
};

// hm [W, C] and wp [W, T]: one batch entry's masks and windows, 64 slots of every row at a time
Shared share(const bool* hm, const int64_t* wp, int64_t W, int64_t C, int64_t T) {
  Shared sh;
  sh.n1.assign(W, 0), sh.n2.assign(W, 0), sh.win.assign(W * T, 0);
  std::vector<uint64_t> bits(W);
  std::vector<char> gap(W, 0);  // the row skipped a slot of U: any later slot it reads ends its prefix
  for (int64_t s0 = 0; s0 < C; s0 += 64) {
    const int64_t m = std::min<int64_t>(64, C - s0);
    uint64_t any = 0;
    for (int64_t r = 0; r < W; ++r) {
      const bool* row = hm + r * C + s0;
      uint64_t x = 0;
      if (m == 64)
        x = nonzero_bytes(row);
      else
        for (int64_t t = 0; t < m; ++t) x |= uint64_t(row[t]) << t;
      bits[r] = x, any |= x;
    }
    for (int64_t r = 0; r < W; ++r) {
      const uint64_t seen = bits[r], missed = any & ~seen;
      if (sh.n1[r] >= 0 && seen) {
        if (gap[r] || (missed && 63 - __builtin_clzll(seen) > __builtin_ctzll(missed)))
          sh.n1[r] = -1;
        else
          sh.n1[r] += __builtin_popcountll(seen);
      }
      gap[r] |= missed != 0;
    }
    for (uint64_t x = any; x; x &= x - 1) sh.slots.push_back(s0 + __builtin_ctzll(x));
  }
  for (int64_t r = 0; r < W; ++r)
    for (int64_t t = 0; t < T; ++t)
      if (wp[r * T + t] >= 0) sh.win[r * T + sh.n2[r]++] = wp[r * T + t];
  return sh;
}

// Every batch entry's Shared for the masks hm [B, W, C] and windows wp [B, W, T]: the last call's where its masks
// and windows were these, byte for byte (a step's layers all pass the step's; one computation a step instead of one
// a layer, each a serial scan of W x C mask bytes while the other threads wait), else computed and kept. Kept per
// calling thread; the same inputs give the same Shared, so reuse changes no bit.
const std::vector<Shared>& shared_parts(const bool* hm, const int64_t* wp, int64_t B, int64_t W, int64_t C, int64_t T) {
  struct Memo {
    std::array<int64_t, 4> shape{-1, -1, -1, -1};  // B, W, C, T
    std::vector<char> mask;                      // the masks' bytes
    std::vector<int64_t> window;
    std::vector<Shared> shared;
  };
  static thread_local Memo memo;
  const std::array<int64_t, 4> shape{B, W, C, T};
  const size_t nm = static_cast<size_t>(B * W * C), nw = static_cast<size_t>(B * W * T);
  const bool same = memo.shape == shape && (nm == 0 || std::memcmp(memo.mask.data(), hm, nm) == 0) &&
                    (nw == 0 || std::memcmp(memo.window.data(), wp, nw * sizeof(int64_t)) == 0);
  if (!same) {
    memo.shape = {-1, -1, -1, -1};  // matches nothing until the whole memo is written (a throw leaves it so)
    memo.mask.assign(reinterpret_cast<const char*>(hm), reinterpret_cast<const char*>(hm) + nm);
    memo.window.assign(wp, wp + nw);
    memo.shared.clear();
    for (int64_t b = 0; b < B; ++b) memo.shared.push_back(share(hm + b * W * C, wp + b * W * T, W, C, T));
    memo.shape = shape;
  }
  return memo.shared;
}

// LANES K rows, slots[0, n) (the rest repeat the first), as float32 into kt [LANES, D]
template <typename K>
void load_tile(const K* kb, int64_t ks1, const int64_t* slots, int64_t n, int64_t D, float* kt) {
  for (int s = 0; s < LANES; ++s) {
    const K* kr = kb + slots[s < n ? s : 0] * ks1;
    for (int64_t c = 0; c < D; c += LANES) store(kt + s * D + c, load16(kr + c));
  }
}

// One query's scores against nt tiles of LANES K rows (tile t's rows D = 16 ND floats each, strides[t] apart),
// each summed as head_group's score sums it: out[LANES t, LANES t + LANES). The query is read chunk by chunk,
// every slot's sum advancing one chunk at a time (each sum still runs over the chunks in order), so only the
// LANES sums and one chunk take registers (16 registers hold no more) and the query's loads serve a whole tile
template <int ND>
void tile_scores(const float* q, const float* const* tiles, const int64_t* strides, int nt, float scale, float* out) {
  constexpr int NC = ND * 16 / LANES;
  const F sv = set1(scale);
  for (int t = 0; t < nt; ++t) {
    const float* k = tiles[t];
    const int64_t stride = strides[t];
    F acc[LANES];
    const F q0 = load(q);
    for (int s = 0; s < LANES; ++s) acc[s] = mul(q0, load(k + s * stride));
    for (int c = 1; c < NC; ++c) {
      const F qc = load(q + LANES * c);
      for (int s = 0; s < LANES; ++s) acc[s] = fmadd(qc, load(k + s * stride + LANES * c), acc[s]);
    }
    store(out + LANES * t, mul(reduce_add_each(acc), sv));
  }
}

// The same for a few rows (slots[0, n)), one at a time: where most of a tile would be padding
template <typename K>
void few_scores(const float* q, const K* kb, int64_t ks1, const int64_t* slots, int64_t n, int64_t D, float scale,
                float* out) {
  for (int64_t s = 0; s < n; ++s) {
    const K* kr = kb + slots[s] * ks1;
    F acc = mul(load(q), load16(kr));
    for (int64_t c = LANES; c < D; c += LANES) acc = fmadd(load(q + c), load16(kr + c), acc);
    out[s] = reduce_add(acc) * scale;
  }
}

using ScoreFn = void (*)(const float*, const float* const*, const int64_t*, int, float, float*);
template <int... ND>
constexpr std::array<ScoreFn, sizeof...(ND)> score_fns(std::integer_sequence<int, ND...>) {
  return {&tile_scores<ND>...};
}

constexpr int WEIGH_SLOTS = 64;  // V rows the weighted sums take a block at a time (8 KB of float16 rows at D = 64)

// NB queries' weighted sums over V's chunks [c0, c0 + CB) (LANES floats each), for every c0 < nc: query i adds
// p[i][u] v(slots[u]) for u < n[i], slot by slot as head_group's weigh does, and stores the sums at out[i].
// Each V chunk is loaded once for all NB queries up to the shortest n[i]; NB x CB sums stay in registers. The
// slots go WEIGH_SLOTS at a time, every chunk of a block's rows before the next block (the sums kept in out
// between blocks, exactly), so a row is read from memory once and its other chunks come from the first-level
// cache (chunk by chunk over all the slots, each pass swept the cold rows again for their next cache line)
template <typename K, int NB, int CB>
void weigh(const K* vb, int64_t vs1, const int64_t* slots, const float* const* p, const int64_t* n, float* const* out,
           int nc) {
  int64_t common = n[0];
  for (int i = 1; i < NB; ++i) common = std::min(common, n[i]);
  const int64_t ahead = yggtree::attention_ahead();
  for (int64_t u0 = 0; u0 == 0 || u0 < common; u0 += WEIGH_SLOTS) {
    const int64_t u1 = std::min(common, u0 + WEIGH_SLOTS);
    for (int64_t u = u1; u < std::min(common, u1 + WEIGH_SLOTS); ++u)
      fetch_row(vb + slots[u] * vs1, int64_t(nc) * LANES);  // the next block's rows, while this one is summed
    for (int c0 = 0; c0 < nc; c0 += CB) {
      F a[NB][CB];
      for (int i = 0; i < NB; ++i)
        for (int c = 0; c < CB; ++c) a[i][c] = u0 == 0 ? zero() : load(out[i] + LANES * (c0 + c));
      for (int64_t u = u0; u < u1; ++u) {
        if (ahead && c0 == 0) fetch_row(vb + slots[std::min(u + ahead, common - 1)] * vs1, int64_t(nc) * LANES);
        const K* vr = vb + slots[u] * vs1 + LANES * c0;
        F vc[CB];
        for (int c = 0; c < CB; ++c) vc[c] = load16(vr + LANES * c);
        for (int i = 0; i < NB; ++i) {
          const F pu = set1(p[i][u]);
          for (int c = 0; c < CB; ++c) a[i][c] = fmadd(pu, vc[c], a[i][c]);
        }
      }
      if (u1 == common)  // the last block: each query's slots past the common ones
        for (int i = 0; i < NB; ++i)
          for (int64_t u = common; u < n[i]; ++u) {
            const K* vr = vb + slots[u] * vs1 + LANES * c0;
            const F pu = set1(p[i][u]);
            for (int c = 0; c < CB; ++c) a[i][c] = fmadd(pu, load16(vr + LANES * c), a[i][c]);
          }
      for (int i = 0; i < NB; ++i)
        for (int c = 0; c < CB; ++c) store(out[i] + LANES * (c0 + c), a[i][c]);
    }
  }
}

constexpr int BLOCK_TILES = 64 / LANES;  // K tiles scored a block at a time: 64 slots (16 KB as float32 at D = 64)
constexpr int MAX_BLOCK = 6;  // queries a weigh call serves: NB x CB <= 24 sums (12 on 16 registers)
constexpr int MAX_CB = REGISTERS >= 32 ? 4 : 2;

template <typename K>
using WeighFn = void (*)(const K*, int64_t, const int64_t*, const float* const*, const int64_t*, float* const*, int);

template <typename K, int CB, int... NB>
constexpr std::array<WeighFn<K>, sizeof...(NB)> weigh_fns(std::integer_sequence<int, NB...>) {
  return {&weigh<K, NB + 1, CB>...};
}

// A thread's scratch (reused across calls): scores then probabilities [queries, stride]; queries as float32
// and their two parts' weighted sums [queries, D]; a block of K tiles [BLOCK_TILES, LANES, D]; each query's row,
// head and sum
struct TreeScratch {
  std::vector<float> sc, qf, a1, a2, kt, total;
  std::vector<int64_t> row, head;
};

template <typename E, typename K>
void run_tree(const yggtree::AttentionCall& a) {
  const int64_t B = a.B, W = a.W, H = a.H, D = a.D, C = a.C, Hkv = a.Hkv, T = a.T, G = H / Hkv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const auto [qp, kp, vp, op] = pointers<E, K>(a);
  const bool* hp = a.head;
  const int64_t* wp = a.window;
  const int64_t ks0 = a.ks0, ks1 = a.ks1, ks2 = a.ks2, vs0 = a.vs0, vs1 = a.vs1, vs2 = a.vs2;
  static constexpr auto groups = all_fns<E, K>(HeadChunks{});
  static constexpr auto scores = score_fns(HeadChunks{});
  static constexpr std::array<std::array<WeighFn<K>, MAX_BLOCK>, 3> weighs = {
      weigh_fns<K, 1>(std::make_integer_sequence<int, MAX_BLOCK>{}),
      weigh_fns<K, 2>(std::make_integer_sequence<int, MAX_BLOCK>{}),
      weigh_fns<K, MAX_CB>(std::make_integer_sequence<int, MAX_BLOCK>{})};
  const auto& by_group = groups[chunk_index(D)];
  const ScoreFn score = scores[chunk_index(D)];
  const int nc = static_cast<int>(D / LANES);
  const auto& by_block = weighs[nc % MAX_CB == 0 ? 2 : nc % 2 == 0 ? 1 : 0];
  const std::vector<Shared>& shared = shared_parts(hp, wp, B, W, C, T);
  const auto round_up = [](int64_t n) { return (n + LANES - 1) / LANES * LANES; };

  // A (batch entry, KV head)'s queries e0 <= e < e1 (row e / G, head e % G of the group)
  auto heads = [&](int64_t b, int64_t kvh, int64_t e0, int64_t e1, Scratch& rows_buf, TreeScratch& buf) {
    const Shared& sh = shared[b];
    const K* kb = kp + b * ks0 + kvh * ks2;
    const K* vb = vp + b * vs0 + kvh * vs2;
    buf.row.clear(), buf.head.clear();
    for (int64_t e = e0; e < e1;) {
      const int64_t r = e / G, h = kvh * G + e % G;
      if (sh.n1[r] >= 0) {
        buf.row.push_back(r), buf.head.push_back(h), ++e;
        continue;
      }
      const int64_t ng = std::min<int64_t>({e1 - e, (r + 1) * G - e, MAX_GROUP});
      by_group[ng - 1](qp + ((b * W + r) * H + h) * D, D, kb, vb, ks1, vs1, hp + (b * W + r) * C, C,
                       wp + (b * W + r) * T, T, scale, op + (b * W + r) * H * D + h * D, D, rows_buf);
      e += ng;
    }
    const int64_t nq = static_cast<int64_t>(buf.row.size());
    if (nq == 0) return;
    const int64_t* row = buf.row.data();
    int64_t n1max = 0;
    for (int64_t i = 0; i < nq; ++i) n1max = std::max(n1max, sh.n1[row[i]]);
    const int64_t stride = round_up(n1max) + round_up(T);  // a tile's store may pass a row's n1
    if (static_cast<int64_t>(buf.sc.size()) < nq * stride) buf.sc.resize(nq * stride);
    if (static_cast<int64_t>(buf.qf.size()) < nq * D) buf.qf.resize(nq * D), buf.a1.resize(nq * D), buf.a2.resize(nq * D);
    buf.kt.resize(BLOCK_TILES * LANES * D), buf.total.resize(nq);
    float *sc = buf.sc.data(), *qf = buf.qf.data(), *a1 = buf.a1.data(), *a2 = buf.a2.data(), *kt = buf.kt.data();
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t c = 0; c < D; c += LANES) store(qf + i * D + c, load16(qp + ((b * W + row[i]) * H + buf.head[i]) * D + c));
    // Up to BLOCK_TILES tiles of K rows from the slots sl[u0, n), LANES a tile: tp and ts get each tile's rows and
    // row stride (a full run of float32 rows read in place, other tiles converted once into kt, a short last tile
    // padded); returns how many, and in `few` the rows after them left to few_scores (a last tile that would be
    // mostly padding). `fetch`: the rows `ahead` slots on are fetched first where that is this machine's choice
    const int64_t ahead = yggtree::attention_ahead();
    auto load_tiles = [&](const int64_t* sl, int64_t n, int64_t u0, bool fetch, const float** tp, int64_t* ts,
                          int64_t& few) {
      int t = 0;
      few = 0;
      for (; t < BLOCK_TILES && u0 + t * LANES < n; ++t) {
        const int64_t v0 = u0 + t * LANES, m = std::min<int64_t>(LANES, n - v0);
        for (int64_t u = v0 + ahead; fetch && ahead && u < std::min<int64_t>(v0 + ahead + LANES, n); ++u)
          fetch_row(kb + sl[u] * ks1, D);
        if (2 * m < LANES) {
          few = m;
          break;
        }
        if constexpr (std::is_same_v<K, float>) {
          if (m == LANES && sl[v0 + LANES - 1] - sl[v0] == LANES - 1) {
            tp[t] = kb + sl[v0] * ks1, ts[t] = ks1;
            continue;
          }
        }
        tp[t] = kt + t * LANES * D, ts[t] = D;
        load_tile(kb, ks1, sl + v0, m, D, kt + t * LANES * D);
      }
      return t;
    };
    const float* tp[BLOCK_TILES];
    int64_t ts[BLOCK_TILES], few;
    // part 1: U's K rows a block of tiles at a time, each block loaded once and scored by every query that reads it
    // (a query reads the block's tiles that start before its n1)
    for (int64_t u0 = 0; u0 < n1max; u0 += BLOCK_TILES * LANES) {
      const int nt = load_tiles(sh.slots.data(), n1max, u0, true, tp, ts, few);
      for (int64_t u = u0 + BLOCK_TILES * LANES; u < std::min(n1max, u0 + 2 * BLOCK_TILES * LANES); ++u)
        fetch_row(kb + sh.slots[u] * ks1, D);  // the next block's rows, while this one is scored
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t n1 = sh.n1[row[i]], tail = u0 + nt * LANES;
        if (n1 <= u0) continue;
        score(qf + i * D, tp, ts, static_cast<int>(std::min<int64_t>(nt, (n1 - u0 + LANES - 1) / LANES)), scale,
              sc + i * stride + u0);
        if (few && n1 > tail) few_scores(qf + i * D, kb, ks1, sh.slots.data() + tail, few, D, scale, sc + i * stride + tail);
      }
    }
    // part 2: each row's window against its heads, after its part 1
    for (int64_t i = 0, j; i < nq; i = j) {
      const int64_t r = row[i], n1 = sh.n1[r], n2 = sh.n2[r];
      const int64_t* wl = sh.win.data() + r * T;
      for (j = i; j < nq && row[j] == r;) ++j;
      for (int64_t t0 = 0; t0 < n2; t0 += BLOCK_TILES * LANES) {
        const int nt = load_tiles(wl, n2, t0, false, tp, ts, few);
        const int64_t tail = t0 + nt * LANES;
        for (int64_t ii = i; ii < j; ++ii) {
          score(qf + ii * D, tp, ts, nt, scale, sc + ii * stride + n1 + t0);
          if (few) few_scores(qf + ii * D, kb, ks1, wl + tail, few, D, scale, sc + ii * stride + n1 + tail);
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t n1 = sh.n1[row[i]], n = n1 + sh.n2[row[i]];
      buf.total[i] = n > 0 ? softmax(sc + i * stride, n, n1) : 0.f;
    }
    // the weighted sums: part 1 in blocks of queries sharing U's V rows, part 2 per row (its window)
    const float* p[MAX_BLOCK];
    float* o[MAX_BLOCK];
    int64_t n[MAX_BLOCK];
    for (int64_t i = 0, j; i < nq; i = j) {
      for (j = i; j < nq && j - i < MAX_BLOCK; ++j) p[j - i] = sc + j * stride, n[j - i] = sh.n1[row[j]], o[j - i] = a1 + j * D;
      by_block[j - i - 1](vb, vs1, sh.slots.data(), p, n, o, nc);
    }
    for (int64_t i = 0, j; i < nq; i = j) {
      const int64_t r = row[i];
      for (j = i; j < nq && row[j] == r && j - i < MAX_BLOCK; ++j)
        p[j - i] = sc + j * stride + sh.n1[r], n[j - i] = sh.n2[r], o[j - i] = a2 + j * D;
      by_block[j - i - 1](vb, vs1, sh.win.data() + r * T, p, n, o, nc);
    }
    for (int64_t i = 0; i < nq; ++i) {
      E* oh = op + (b * W + row[i]) * H * D + buf.head[i] * D;
      const bool none = sh.n1[row[i]] + sh.n2[row[i]] == 0;  // a row that sees nothing: zeros, as head_group
      const F tv = set1(buf.total[i]);
      for (int64_t c = 0; c < D; c += LANES)
        store16(oh + c, none ? zero() : div(add(load(a1 + i * D + c), load(a2 + i * D + c)), tv));
    }
  };
  // Work items in (batch, KV head, row, query head of the group) order, as run's: a thread computes each KV
  // head of its share in one pass; a KV head split between the threads is walked by both (for their rows)
  yggtree::parallel_for(0, B * W * H, 1, [&](int64_t i0, int64_t i1) {
    static thread_local Scratch rows_buf;
    static thread_local TreeScratch buf;
    if (static_cast<int64_t>(rows_buf.slot.size()) < C + T)
      rows_buf.sc.resize(MAX_GROUP * (C + T)), rows_buf.slot.resize(C + T);
    for (int64_t i = i0; i < i1;) {
      const int64_t first = i / (W * G) * (W * G), b = i / (W * H), kvh = (i / (W * G)) % Hkv;
      const int64_t end = std::min(i1, first + W * G);
      heads(b, kvh, i - first, end - first, rows_buf, buf);
      i = end;
    }
  });
}

}  // namespace

bool yggtree::attention_head_dim(int64_t D) { return chunk_index(D) >= 0; }

// The kernel for the call's dtypes (ops.cpp checked them); a one-row call has nothing to share: rows_attention's
// loop (the same bits) costs less
void yggtree::attention(const AttentionCall& a, bool tree) {
  using yggtree::Dtype;
  tree = tree && a.W > 1;
  if (a.q_dtype == Dtype::BF16)
    (tree ? run_tree<BF16, BF16> : run<BF16, BF16>)(a);
  else if (a.kv_dtype == Dtype::F16)
    (tree ? run_tree<float, F16> : run<float, F16>)(a);
  else if (a.kv_dtype == Dtype::BF16)
    (tree ? run_tree<float, BF16> : run<float, BF16>)(a);
  else
    (tree ? run_tree<float, float> : run<float, float>)(a);
}
